"""The JSON API as automation uses it: token auth with the console's roles, idempotent actions, an OpenAPI schema
that the API keeps (fuzzed with schemathesis: no input gets a 5xx), and /metrics for Prometheus."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import schemathesis
from django.conf import settings as console_settings
from django.core.management import CommandError, call_command
from django.utils import timezone
from hypothesis import HealthCheck, settings

from dashboard.api.tokens import token_create
from dashboard.models import Action, AuditEntry, Checkpoint, IdempotentRequest, ResultRow, Run, RunStatus
from tests.conftest import grant

pytestmark = pytest.mark.django_db


@pytest.fixture
def token(django_user_model):
    def make(role: str, name: str | None = None) -> str:
        user = django_user_model.objects.create_user(name or f"{role}-bot", password="x")
        if role != "viewer":
            grant(user, role)
        return "Bearer " + token_create(user=user, name="ci")[1]

    return make


def call(client, method: str, path: str, auth: str | None = None, body: dict | None = None, **headers):
    if auth:
        headers["HTTP_AUTHORIZATION"] = auth
    if method == "GET":
        return client.get(path, **headers)
    return client.post(path, json.dumps(body or {}), content_type="application/json", **headers)


def test_reads_list_jobs_runs_and_checkpoints_page_by_page(client, token, make_job):
    job = make_job(name="orders")
    for b in range(7):
        Checkpoint.objects.create(job=job, batch_id=b, committed_at=f"2026-11-22T00:00:0{b}Z", duration_ms=100 + b)
    viewer = token("viewer")
    listed = call(client, "GET", "/api/v1/jobs", viewer).json()
    assert [j["name"] for j in listed["jobs"]] == ["orders"] and listed["jobs"][0]["status"] == "never-run"
    detail = call(client, "GET", "/api/v1/jobs/orders", viewer).json()
    assert detail["summary"]["checkpoints"] == 7
    seen, before = [], ""
    while True:
        page = call(client, "GET", f"/api/v1/jobs/orders/checkpoints?limit=3{before}", viewer).json()
        seen += [c["batch_id"] for c in page["checkpoints"]]
        assert ("summary" in page) == (not before), "the first page carries the summary"
        if not page["next_before"]:
            break
        before = f"&before={page['next_before']}"
    assert seen == [6, 5, 4, 3, 2, 1, 0]
    assert call(client, "GET", "/api/v1/jobs/nope", viewer).status_code == 404
    bad = call(client, "GET", "/api/v1/jobs/orders/runs?limit=zero", viewer)
    assert bad.status_code == 400 and "limit must be an integer" in bad.json()["error"]


def test_tokens_carry_their_users_role_and_a_session_cannot_write(client, token, make_job, django_user_model):
    make_job(name="orders")
    assert call(client, "GET", "/api/v1/jobs").status_code == 401
    assert call(client, "GET", "/api/v1/jobs", "Bearer sk_not-a-token").status_code == 401
    refused = call(client, "POST", "/api/v1/jobs/orders/start", token("viewer"))
    assert refused.status_code == 403 and "operator role" in refused.json()["error"]
    operator = django_user_model.objects.create_user("human", password="x")
    client.force_login(grant(operator, "operator"))
    assert call(client, "GET", "/api/v1/jobs").status_code == 200, "a logged-in browser may read"
    assert call(client, "POST", "/api/v1/jobs/orders/start").status_code == 401, "but writes need a token (no CSRF)"
    assert not Run.objects.exists()


def test_a_retried_start_with_the_same_idempotency_key_acts_once(client, token, make_job):
    make_job(name="orders")
    operator = token("operator", "deployer")
    first = call(client, "POST", "/api/v1/jobs/orders/start", operator, HTTP_IDEMPOTENCY_KEY="deploy-42")
    again = call(client, "POST", "/api/v1/jobs/orders/start", operator, HTTP_IDEMPOTENCY_KEY="deploy-42")
    assert first.status_code == again.status_code == 202
    assert again.json() == first.json() and again["Idempotent-Replayed"] == "true"
    assert Run.objects.count() == 1
    other = call(client, "POST", "/api/v1/jobs/orders/stop", operator, HTTP_IDEMPOTENCY_KEY="deploy-42")
    assert other.status_code == 422, "the same key for a different request is an error, not a replay"
    second = call(client, "POST", "/api/v1/jobs/orders/start", operator, HTTP_IDEMPOTENCY_KEY="deploy-43")
    assert second.status_code == 409 and "already has run" in second.json()["error"]
    entry = AuditEntry.objects.filter(verb="start", origin="api").order_by("id").first()
    assert (entry.username, entry.outcome) == ("deployer", "requested")


def test_a_key_whose_first_attempt_failed_is_tried_again_and_an_old_key_expires(client, token, make_job):
    make_job(name="orders")
    operator = token("operator", "deployer")
    missing = {"savepoint": 999}
    for _ in range(2):  # a 404 on the first attempt must not leave the key "still being handled" for good
        lost = call(client, "POST", "/api/v1/jobs/orders/restore", operator, missing, HTTP_IDEMPOTENCY_KEY="r-1")
        assert lost.status_code == 404
    first = call(client, "POST", "/api/v1/jobs/orders/start", operator, HTTP_IDEMPOTENCY_KEY="d-1")
    IdempotentRequest.objects.filter(key="d-1").update(created_at=timezone.now() - timedelta(hours=25))
    Run.objects.update(status=RunStatus.STOPPED)
    again = call(client, "POST", "/api/v1/jobs/orders/start", operator, HTTP_IDEMPOTENCY_KEY="d-1")
    assert first.status_code == again.status_code == 202 and "Idempotent-Replayed" not in again
    assert Run.objects.count() == 2, "a day later the key is a new request"


def test_bad_bodies_get_a_clear_400(client, token, make_job):
    make_job(name="orders", state_backend="rocksdb")
    operator = token("operator")
    for body, message in [
        ({"parallelism": 0}, "parallelism must be an integer from 1 to 64"),
        ({"parallelism": "2"}, "parallelism must be an integer"),
        ({"cores": 2}, "Unknown field(s): cores"),
        ({}, "Give parallelism, state_partitions or both"),
    ]:
        response = call(client, "POST", "/api/v1/jobs/orders/rescale", operator, body)
        assert response.status_code == 400 and message in response.json()["error"], body
    rollback = call(client, "POST", "/api/v1/jobs/orders/rollback", operator, {"batch": 3})
    assert rollback.status_code == 409 and "not among the retained batches" in rollback.json()["error"]
    raw = client.post(
        "/api/v1/jobs/orders/savepoint", "{not json", content_type="application/json", HTTP_AUTHORIZATION=operator
    )
    assert raw.status_code == 400 and raw.json() == {"error": "The body must be JSON."}
    deep = client.post(
        "/api/v1/jobs/orders/savepoint", "[" * 100_000 + "]" * 100_000, content_type="application/json",
        HTTP_AUTHORIZATION=operator,
    )  # fmt: skip
    assert deep.status_code == 400 and deep.json() == {"error": "The body is nested deeper than 64 levels."}
    upgrade = call(client, "POST", "/api/v1/jobs/orders/upgrade", operator, {"pipeline": "no-such-pipeline"})
    assert (
        upgrade.status_code == 409 and "There is no registered pipeline 'no-such-pipeline'" in upgrade.json()["error"]
    )
    shadow = call(client, "POST", "/api/v1/jobs/orders/upgrade-shadow", operator, {"pipeline": "x" * 41})
    assert shadow.status_code == 400 and "pipeline must be a string of 1 to 40 characters" in shadow.json()["error"]


def test_metrics_for_prometheus(client, token, make_job):
    job = make_job(name="orders")
    Run.objects.create(job=job, status=RunStatus.RUNNING, heap_after_gc_bytes=300 * 2**20, heap_max_bytes=2**30)
    checkpoint = Checkpoint.objects.create(
        job=job, batch_id=41, committed_at="2026-11-22T00:00:00Z", duration_ms=1500, lag_records=120,
        processed_rate=60, state_rows_total=9, full_size_bytes=4096,
    )  # fmt: skip
    job.latest_checkpoint = checkpoint
    job.save(update_fields=["latest_checkpoint"])
    assert client.get("/metrics").status_code == 401
    text = client.get("/metrics", HTTP_AUTHORIZATION=token("viewer")).content.decode()
    assert 'statekeeper_job_running{job="orders"} 1' in text
    assert 'statekeeper_job_lag_records{job="orders"} 120' in text
    assert 'statekeeper_job_lag_seconds{job="orders"} 2' in text
    assert 'statekeeper_checkpoint_duration_seconds{job="orders"} 1.5' in text
    assert 'statekeeper_checkpoint_size_bytes{job="orders"} 4096' in text
    assert 'statekeeper_job_restarts_total{job="orders"} 0' in text
    assert "# TYPE statekeeper_job_restarts_total counter" in text
    # in full: six significant digits made a commit at midnight 1795310000, 73 minutes late
    assert 'statekeeper_checkpoint_last_commit_timestamp_seconds{job="orders"} 1795305600' in text
    assert f'statekeeper_driver_heap_after_gc_bytes{{job="orders"}} {300 * 2**20}' in text
    assert f'statekeeper_driver_heap_max_bytes{{job="orders"}} {2**30}' in text


def test_a_token_is_created_from_the_command_line(django_user_model, capsys, client):
    django_user_model.objects.create_user("prometheus", password="x")
    call_command("create_token", "prometheus", "scraper")
    printed = capsys.readouterr()
    assert printed.out.startswith("sk_") and len(printed.out.split()) == 1, "captured: the key alone on stdout"
    assert "cannot be shown again" in printed.err
    assert call(client, "GET", "/api/v1/jobs", "Bearer " + printed.out.strip()).status_code == 200


def test_a_token_command_makes_the_deploying_user_with_its_role_or_says_how(
    django_user_model, capsys, client, make_job
):
    with pytest.raises(CommandError, match="no user 'deployer': add --role operator"):
        call_command("create_token", "deployer", "ci")
    assert not django_user_model.objects.filter(username="deployer").exists()

    call_command("create_token", "deployer", "ci", "--role", "operator", "--quiet")
    key = capsys.readouterr().out.strip()
    deployer = django_user_model.objects.get(username="deployer")
    assert not deployer.has_usable_password(), "a token-only user cannot log in to the pages"
    make_job(name="orders")
    assert call(client, "POST", "/api/v1/jobs/orders/start", "Bearer " + key).status_code == 202, "an operator starts"
    assert call(client, "POST", "/api/v1/jobs", "Bearer " + key, {"name": "x"}).status_code == 403, "not an admin"

    # a second token for the same user; a role other than the user's is refused, not silently granted
    call_command("create_token", "deployer", "ci-2", "--role", "operator")
    assert capsys.readouterr().out.startswith("sk_")
    with pytest.raises(CommandError, match="exists with the operator role, not admin"):
        call_command("create_token", "deployer", "ci-3", "--role", "admin")


@pytest.fixture
def wsgi_in_test_transaction(db):
    """The app called in-process over WSGI, inside the test's transaction: as Django's test client does, the handler
    must not close the database connection at the end of each request."""
    from django.core.signals import request_finished, request_started
    from django.db import close_old_connections

    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


def _schema():
    # loaded from the app itself, as a client would (pytest 9 breaks schemathesis' lazy fixture loader, so the
    # schema is loaded when this module is collected; that request touches no database)
    from django.core.wsgi import get_wsgi_application

    return schemathesis.openapi.from_wsgi("/api/openapi.json", get_wsgi_application())


@pytest.fixture
def admin_token(token, make_job):
    """An admin's: every operation (creating, changing and archiving jobs too) goes past the role check."""
    make_job(name="orders")  # a job that exists, so some generated requests go past the 404
    return token("admin")


schema = _schema()


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_makes_the_api_fail_with_a_server_error(case, wsgi_in_test_transaction, admin_token):
    from schemathesis.checks import not_a_server_error

    case.call_and_validate(headers={"Authorization": admin_token}, checks=[not_a_server_error])


def test_every_api_route_is_in_the_schema_and_so_fuzzed():
    """A new endpoint that the schema forgets would escape the fuzzing above."""
    from dashboard.api import urls

    documented = {path.removeprefix("/api/") for path in schema.raw_schema["paths"]}
    routes = {str(p.pattern).replace("<str:", "{").replace("<int:", "{").replace(">", "}") for p in urls.urlpatterns}
    assert routes - {"openapi.json", "^"} == documented


@pytest.mark.fuzz
@schema.parametrize()
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
def test_long_fuzz_every_operation_keeps_its_schema(case, wsgi_in_test_transaction, admin_token):
    """The long run (-m fuzz): more examples, and every answer checked against the schema, not only for 5xx."""
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    case.call_and_validate(headers={"Authorization": admin_token}, checks=checks)


def test_a_path_the_api_does_not_have_is_a_json_404(client, token):
    for path in ("/api/v1/actions/null,null", "/api/v2/jobs", "/api/v1/actions/0"):
        answer = client.get(path, HTTP_AUTHORIZATION=token("viewer", f"v{len(path)}"))
        assert answer.status_code == 404 and answer["Content-Type"] == "application/json", path
        assert "error" in answer.json()


def test_an_upgrade_through_the_api_takes_parameter_values_checked_against_the_pipeline(client, token, make_job):
    make_job(name="spend", pipeline="customer-spend", state_backend="rocksdb", parameters={"threshold": 80})
    operator = token("operator")
    listed = call(client, "GET", "/api/v1/jobs/spend", operator).json()
    assert listed["parameters"] == {"threshold": 80}
    for body, status, message in [
        ({"pipeline": "customer-spend"}, 409, "already runs customer-spend with window_minutes=60, threshold=80.0"),
        ({"pipeline": "customer-spend", "parameters": {"threshold": 80}}, 409, "already runs customer-spend"),
        ({"pipeline": "customer-spend", "parameters": {"threshold": -1}}, 409, "threshold: must be at least 0"),
        (
            {"pipeline": "customer-spend", "parameters": {"colour": 1}},
            409,
            "colour: the pipeline has no such parameter",
        ),
        ({"pipeline": "customer-spend", "parameters": [1]}, 400, "parameters must be an object"),
    ]:
        response = call(client, "POST", "/api/v1/jobs/spend/upgrade-preview", operator, body)
        assert response.status_code == status and message in response.json()["error"], (body, response.json())
    accepted = call(
        client, "POST", "/api/v1/jobs/spend/upgrade-preview", operator,
        {"pipeline": "customer-spend", "parameters": {"window_minutes": "15"}},
    )  # fmt: skip
    assert accepted.status_code == 202, accepted.json()
    action = Action.objects.get(id=accepted.json()["action"]["id"])
    assert action.params["parameters"] == {
        "window_minutes": 15,
        "threshold": 80.0,
        "lateness_minutes": 10,
        "orders_dsn": "",
        "lake_dir": "",
    }


def test_a_jobs_results_are_read_view_by_view_page_by_page(client, token, make_job):
    job = make_job(name="orders")
    ResultRow.objects.bulk_create(
        [ResultRow(job=job, kind="url", key=f"/p{i:02d}", value={"requests": i}, batch_id=i) for i in range(5)]
        + [ResultRow(job=job, kind="totals", key="all", value={"events": 10}, batch_id=4)]
    )
    viewer = token("viewer")
    views = call(client, "GET", "/api/v1/jobs/orders/results", viewer).json()
    kept = {"rows": console_settings.RESULTS_KEEP_ROWS, "hours": None}  # url-counts' views set no bound of their own
    assert views == {"views": [{"view": "totals", "rows": 1, "kept": kept}, {"view": "url", "rows": 5, "kept": kept}]}
    first = call(client, "GET", "/api/v1/jobs/orders/results?view=url&limit=3", viewer).json()
    assert [r["key"] for r in first["results"]] == ["/p00", "/p01", "/p02"] and first["next_after"] == "/p02"
    rest = call(client, "GET", f"/api/v1/jobs/orders/results?view=url&limit=3&after={first['next_after']}", viewer)
    assert [(r["key"], r["value"]["requests"]) for r in rest.json()["results"]] == [("/p03", 3), ("/p04", 4)]
    assert rest.json()["next_after"] is None
    assert call(client, "GET", "/api/v1/jobs/orders/results?view=url&after=%00", viewer).status_code == 400


HOSTILE_BODIES = {  # what the schema-driven fuzzing never generates (it writes valid JSON), sent to every operation
    "NaN": b'{"pipeline": "url-counts", "parameters": {"top": NaN}, "threshold": NaN}',
    "Infinity": b'{"savepoint": Infinity, "batch": -Infinity, "records": 1e400}',
    "nested 500 deep": b'{"jobs": ' + b"[" * 500 + b"]" * 500 + b"}",
    "NUL": b'{"name": "a\\u0000b", "value": "x\\u0000", "pipeline": "url-counts"}',
    "lone surrogate": b'{"name": "\\ud800", "value": "\\udfff"}',
}


def test_every_operation_of_the_schema_refuses_each_hostile_body_and_path_without_a_server_error(client, admin_token):
    """Each operation of the OpenAPI schema, with an admin's token (every role check passed), gets each hostile body
    and a NUL in each path parameter: a 4xx in JSON with a sentence, never a 5xx."""
    failures = []
    for path, operations in schema.raw_schema["paths"].items():
        for method in operations:
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            concrete = "/api" + path.replace("{name}", "orders").replace("{id}", "1").replace("{view}", "url")
            sends = [(concrete.replace("orders", "or%00ders") if "orders" in concrete else concrete + "?q=%00", None)]
            if method in ("post", "put", "patch"):
                sends += [(concrete, body) for body in HOSTILE_BODIES.values()]
            for url, body in sends:
                answer = client.generic(method.upper(), url, body or b"", content_type="application/json",
                                        HTTP_AUTHORIZATION=admin_token, HTTP_IF_MATCH="*")  # fmt: skip
                shown = answer.content[:200]
                if answer.status_code >= 500 or not answer["Content-Type"].startswith("application/json"):
                    failures.append((method, url, body and body[:40], answer.status_code, shown))
    assert not failures, failures[:10]
