"""Who may act, enforced on the server; a read-only switch; throttled logins; an append-only, exportable audit trail."""

from __future__ import annotations

import csv
import io
import re
import time

import pytest
from django.db import DatabaseError, connection, transaction
from django.urls import URLPattern, URLResolver, get_resolver

from dashboard.models import AppendOnly, AuditEntry, Job, Run
from tests.conftest import grant

pytestmark = pytest.mark.django_db


def test_a_viewer_is_refused_every_action_on_the_server(as_role, make_job):
    job = make_job(name="orders")
    viewer = as_role("viewer")
    for path in ("start", "stop", "savepoint", "stop-with-savepoint", "count-partition-rows", "rescale", "edit"):
        response = viewer.post(f"/jobs/orders/{path}")
        assert response.status_code == 403, path
    assert "needs the operator role; viewer is viewer" in viewer.post("/jobs/orders/start").content.decode()
    assert not Run.objects.filter(job=job).exists() and not job.actions.exists(), "nothing happened"
    assert viewer.post("/jobs/new", {"name": "x"}).status_code == 403
    denied = AuditEntry.objects.filter(verb="denied", username="viewer")
    assert denied.filter(target="/jobs/orders/start").exists()


def test_an_operator_acts_but_only_an_admin_edits_jobs(as_role, make_job):
    make_job(name="orders")
    operator = as_role("operator")
    assert operator.post("/jobs/orders/start").status_code == 302
    assert Run.objects.filter(job__name="orders").count() == 1
    assert operator.get("/jobs/orders/edit").status_code == 403
    assert operator.get("/jobs/new").status_code == 403
    admin = as_role("admin")
    assert admin.get("/jobs/orders/edit").status_code == 200


def test_read_only_turns_every_action_off(as_role, make_job, settings):
    settings.READ_ONLY = True
    make_job(name="orders")
    admin = as_role("admin")
    response = admin.post("/jobs/orders/start")
    assert response.status_code == 403 and "read-only" in response.content.decode()
    page = admin.get("/jobs/orders/").content.decode()
    assert "Read-only." in page and 'action="/jobs/orders/start"' not in page


def _paths(resolver=None, prefix: str = "") -> list[str]:
    found = []
    for entry in (resolver or get_resolver()).url_patterns:
        route = prefix + str(entry.pattern)
        if isinstance(entry, URLResolver):
            if not route.startswith("admin/"):
                found += _paths(entry, route)
        elif isinstance(entry, URLPattern):
            found.append(route)
    return found


def test_every_console_page_and_endpoint_needs_a_login(client, make_job):
    make_job(name="orders")
    samples = {
        "<str:name>": "orders",
        "<int:savepoint_id>": "1",
        "<str:directory>": "checkpoint-old",
        "<int:action_id>": "1",
    }
    checked = 0
    for route in _paths():
        if route in ("login/", "logout/", "api/openapi.json"):  # the API's description is public, like /login/
            continue
        if route == "api/^":  # the API's JSON 404 for paths it does not have: it names nothing but the path asked
            continue
        path = "/" + route
        for pattern, value in samples.items():
            path = path.replace(pattern, value)
        posted = client.post(path)
        if path.startswith(("/api/", "/metrics")):  # automation gets a 401 and the way to authenticate
            assert client.get(path).status_code in (401, 405) and posted.status_code in (401, 405), path
            checked += 1
            continue
        assert posted.status_code == 302 and posted["Location"].startswith("/login/"), (path, posted)
        got = client.get(path)  # a POST-only endpoint answers a GET with 405 before anything else
        assert got.status_code == 405 or got["Location"].startswith("/login/"), (path, got)
        checked += 1
    assert checked >= 34, "every route of the console and the API was tried"


def test_logins_are_throttled_per_user_name(client, django_user_model, settings):
    settings.LOGIN_FAILURES_ALLOWED = 3
    settings.LOGIN_LOCKOUT_SECONDS = 1
    django_user_model.objects.create_user("oncall", password="right-password")
    for _ in range(3):
        assert (
            "Please enter a correct username"
            in client.post("/login/", {"username": "oncall", "password": "guess"}).content.decode()
        )
    refused = client.post("/login/", {"username": "oncall", "password": "right-password"})
    assert refused.status_code == 200 and "Too many failed logins" in refused.content.decode()
    assert AuditEntry.objects.filter(verb="login", outcome="failed", username="oncall").count() == 3
    assert AuditEntry.objects.filter(verb="login", outcome="throttled").count() == 1
    time.sleep(2)  # a whole second past the lockout, not on its edge
    assert client.post("/login/", {"username": "oncall", "password": "right-password"}).status_code == 302


def test_the_admin_login_is_throttled_like_the_consoles(client, django_user_model, settings):
    settings.LOGIN_FAILURES_ALLOWED = 3
    django_user_model.objects.create_superuser("root", password="right-password")
    for _ in range(3):
        assert client.post("/admin/login/", {"username": "root", "password": "guess"}).status_code == 200
    refused = client.post("/admin/login/?next=/admin/", {"username": "root", "password": "right-password"})
    assert refused.status_code == 200 and "Too many failed logins" in refused.content.decode()
    assert client.get("/admin/").status_code == 302, "not logged in"
    assert AuditEntry.objects.filter(verb="login", outcome="failed", username="root").count() == 3


def test_actions_and_changes_are_in_the_audit_trail_with_who_where_and_what(as_role, make_job):
    make_job(name="orders")
    operator = as_role("operator", "alice")
    operator.post("/jobs/orders/start", REMOTE_ADDR="10.1.2.3")
    operator.post("/jobs/orders/start", REMOTE_ADDR="10.1.2.3")  # a second click: refused, and recorded as such
    admin = as_role("admin", "bob")
    job = Job.objects.get(name="orders")
    form = {
        f: getattr(job, f)
        for f in ("name", "pipeline", "source_stream", "state_backend", "trigger_interval_seconds",
                  "state_partitions", "parallelism", "batches_retained", "max_records_per_batch",
                  "savepoint_interval_minutes", "savepoints_max_count", "savepoints_max_age_hours",
                  "restart_strategy", "restart_delay_seconds", "restart_max_delay_seconds", "failure_rate_max",
                  "failure_rate_window_minutes", "memory_budget_mb", "disk_budget_gb", "autoscale_mode",
                  "autoscale_max_per_day", "autoscale_window_minutes")
    }  # fmt: skip
    assert admin.post("/jobs/orders/edit", {**form, "max_records_per_batch": 777}).status_code == 302

    started, refused = AuditEntry.objects.filter(verb="start").order_by("id")
    assert (started.username, started.address, started.job, started.outcome) == (
        "alice",
        "10.1.2.3",
        "orders",
        "requested",
    )
    assert refused.outcome == "refused" and "already has run" in refused.message
    edit = AuditEntry.objects.get(verb="job-edit")
    assert edit.username == "bob" and edit.params == {"max_records_per_batch": [job.max_records_per_batch, 777]}

    exported = admin.get("/audit/?user=alice&format=csv")
    with pytest.warns(Warning, match="consume asynchronous iterators"):  # the sync client reads it whole
        rows = list(csv.DictReader(io.StringIO(b"".join(exported).decode())))
    assert exported["Content-Type"].startswith("text/csv")
    assert [(r["username"], r["verb"], r["outcome"]) for r in rows] == [
        ("alice", "start", "refused"), ("alice", "start", "requested"), ("alice", "login", "succeeded"),
    ]  # fmt: skip
    page = admin.get("/audit/?job=orders").content.decode()
    assert "job-edit" in page and "10.1.2.3" in page
    assert admin.get("/audit/?since=yesterday").status_code == 400


@pytest.mark.django_db(transaction=True)
def test_the_audit_trail_is_append_only(make_job):
    entry = AuditEntry.objects.create(verb="savepoint", job="orders", outcome="requested")
    with pytest.raises(AppendOnly):
        entry.save()
    with pytest.raises(AppendOnly):
        entry.delete()
    if connection.vendor == "postgresql":  # and not even past the model
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            AuditEntry.objects.filter(id=entry.id).update(outcome="succeeded")
        with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
            AuditEntry.objects.filter(id=entry.id).delete()
    assert AuditEntry.objects.get(id=entry.id).outcome == "requested"


def test_names_and_paths_from_users_stay_inside_the_checkpoint_root(as_role, make_job, checkpoint_root):
    job = make_job(name="orders")
    admin = as_role("admin")
    outside = checkpoint_root.parent / "precious"
    outside.mkdir()
    for name in ("..%2Fprecious", "checkpoint%2F..%2F..%2Fprecious", "..", "checkpoint"):
        response = admin.post(f"/jobs/orders/old-checkpoints/{name}/discard", follow=True)
        assert response.status_code in (200, 404)
    assert outside.is_dir() and not job.actions.exists(), "no discard was even requested"
    created = admin.post("/jobs/new", {"name": "../precious", "pipeline": "url-counts", "source_stream": "s"})
    assert created.status_code == 400 and "lower-case letters" in created.content.decode()
    assert not Job.objects.filter(name__contains="/").exists()


def test_forms_need_their_csrf_token(make_job, django_user_model):
    from django.test import Client

    make_job(name="orders")
    browser = Client(enforce_csrf_checks=True)
    browser.force_login(grant(django_user_model.objects.create_user("op", password="x"), "operator"))
    assert browser.post("/jobs/orders/start").status_code == 403
    assert not Run.objects.exists()


def test_a_server_error_shows_no_stack_trace(make_job, django_user_model, monkeypatch):
    from django.test import Client

    from dashboard import views

    def broken(*args, **kwargs):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(views.jobs, "job_list", broken)
    browser = Client(raise_request_exception=False)
    browser.force_login(django_user_model.objects.create_user("viewer", password="x"))
    response = browser.get("/")
    body = response.content.decode()
    assert response.status_code == 500 and "Something went wrong" in body
    assert "Traceback" not in body and "secret internals" not in body


def test_the_storage_page_lists_orphans_and_only_an_operator_removes_them(as_role, make_job):
    job = make_job(name="orders")
    job.directory.mkdir(parents=True)
    (job.directory / "stray.tmp").write_bytes(b"x" * 10)
    viewer = as_role("viewer")
    page = viewer.get("/jobs/orders/storage").content.decode()
    assert "stray.tmp" in page and 'id="storage-total">10<' in page
    assert viewer.post("/jobs/orders/storage", {"orphan": "stray.tmp"}).status_code == 403
    operator = as_role("operator")
    assert operator.post("/jobs/orders/storage", {"orphan": "../../etc"}).status_code == 302
    assert not job.actions.exists(), "a name that is not a listed orphan is not even requested"
    operator.post("/jobs/orders/storage", {"orphan": "stray.tmp"})
    assert job.actions.get().params == {"orphans": ["stray.tmp"]}


def test_the_state_inspector_form_checks_its_input_and_needs_an_operator(as_role, make_job):
    job = make_job(name="orders")
    viewer = as_role("viewer")
    assert "needs the operator role" in viewer.get("/jobs/orders/inspect").content.decode()
    assert viewer.post("/jobs/orders/inspect", {"mode": "keys"}).status_code == 403
    operator = as_role("operator")
    bad = operator.post("/jobs/orders/inspect", {"mode": "diff", "batch": "5"})
    assert bad.status_code == 400 and "A diff needs the earlier batch" in bad.content.decode()
    assert operator.post("/jobs/orders/inspect", {"mode": "lookup", "text": "o10", "limit": "20"}).status_code == 302
    assert job.actions.get().params == {"mode": "lookup", "text": "o10", "limit": 20}


def test_the_inspector_offers_the_next_page_of_the_same_batch(as_role, make_job):
    job = make_job(name="orders")
    rows = [{"key": f'{{"url":"/{n}"}}', "value": '{"value":{"count":1}}', "partition": 0} for n in range(5)]
    job.actions.create(
        kind="inspect-state", status="succeeded",
        params={"mode": "keys", "limit": 5, "offset": 0, "batch": 55, "origin_read": "batch 55 of checkpoint",
                "result": {"total": 8, "offset": 0, "rows": rows, "operators": []}},
    )  # fmt: skip
    page = as_role("operator").get("/jobs/orders/inspect").content.decode()
    assert "showing 1–5." in page
    assert '<input type="hidden" name="offset" value="5">' in page
    assert '<input type="hidden" name="batch" value="55">' in page, "the next page reads the same batch"


def test_the_inspector_refuses_a_typed_batch_that_the_chosen_savepoint_does_not_hold(as_role, make_job):
    job = make_job(name="orders")
    savepoint = job.savepoints.create(status="verified", batch_id=12, path="/nowhere")
    operator = as_role("operator")
    bad = operator.post("/jobs/orders/inspect", {"mode": "keys", "savepoint": savepoint.id, "batch": "7"})
    assert bad.status_code == 400
    assert f"Savepoint #{savepoint.id} holds batch 12 only" in bad.content.decode()
    assert not job.actions.exists(), "nothing is read when the choice is ambiguous"
    assert operator.post("/jobs/orders/inspect", {"mode": "keys", "batch": "7"}).status_code == 302
    assert job.actions.get().params == {"mode": "keys", "batch": 7}


def test_the_inspector_offers_the_live_checkpoint_first_beside_the_verified_savepoints(as_role, make_job):
    """With a verified savepoint, the form's first choice is still the live checkpoint (a browser submits the first
    option of a select left as it is): the savepoints are offered beside it, not in its place."""
    job = make_job(name="orders")
    savepoint = job.savepoints.create(status="verified", batch_id=12, path="/nowhere")
    page = as_role("operator").get("/jobs/orders/inspect").content.decode()
    select = page[page.index('name="savepoint"') :]
    select = select[: select.index("</select>")]
    options = re.findall(r'<option value="([^"]*)"', select)
    assert options == ["", str(savepoint.id)], options
    assert "the live checkpoint (a scratch copy)" in select


def test_the_first_admin_gets_a_random_password_kept_for_its_owner_only(db, tmp_path, monkeypatch, client):
    from django.core.management import CommandError, call_command

    kept = tmp_path / "admin-password"
    monkeypatch.setenv("STATEKEEPER_ADMIN_PASSWORD_FILE", str(kept))
    monkeypatch.delenv("STATEKEEPER_ADMIN_PASSWORD", raising=False)
    out = io.StringIO()
    call_command("ensure_admin", stdout=out)
    password = kept.read_text().strip()
    assert len(password) >= 20 and password in out.getvalue() and password != "statekeeper"
    assert kept.stat().st_mode & 0o777 == 0o600
    assert client.login(username="admin", password=password)
    assert not client.login(username="admin", password="statekeeper")
    again = io.StringIO()
    call_command("ensure_admin", stdout=again)
    assert password not in again.getvalue() and kept.read_text().strip() == password, "made once, never shown again"
    monkeypatch.setenv("STATEKEEPER_ADMIN_USER", "root")
    monkeypatch.setenv("STATEKEEPER_ADMIN_PASSWORD", "statekeeper")
    with pytest.raises(CommandError, match="too weak"):
        call_command("ensure_admin", stdout=io.StringIO())


def test_variants_of_a_user_name_are_throttled_as_one(client, django_user_model, settings):
    settings.LOGIN_FAILURES_ALLOWED = 3
    django_user_model.objects.create_user("oncall", password="right-password")
    for variant in ("oncall ", "ONCALL", "ｏｎｃａｌｌ"):  # a trailing space, upper case, full-width letters
        client.post("/login/", {"username": variant, "password": "guess"})
    refused = client.post("/login/", {"username": "oncall", "password": "right-password"})
    assert "Too many failed logins" in refused.content.decode()


def test_a_forwarded_address_counts_only_from_a_trusted_proxy(client, settings):
    from django.test import RequestFactory

    from dashboard.services.audit import client_address

    forged = RequestFactory().get("/", REMOTE_ADDR="203.0.113.9", HTTP_X_FORWARDED_FOR="10.0.0.1")
    assert client_address(forged) == "203.0.113.9", "no proxy is trusted by default"
    settings.TRUSTED_PROXIES = frozenset({"10.9.9.9"})
    proxied = RequestFactory().get("/", REMOTE_ADDR="10.9.9.9", HTTP_X_FORWARDED_FOR="1.2.3.4, 198.51.100.7")
    assert client_address(proxied) == "198.51.100.7", "the hop the trusted proxy saw, not what the client wrote"


def test_the_admin_obeys_read_only_mode_audits_its_changes_and_cannot_edit_a_run(
    client, django_user_model, settings, make_job
):
    job = make_job(name="orders")
    run = Run.objects.create(job=job, status="running", pid=4242, fencing_token=7)
    client.force_login(django_user_model.objects.create_superuser("root", password="x"))
    page = client.get(f"/admin/dashboard/run/{run.id}/change/").content.decode()
    assert 'name="pid"' not in page and 'name="fencing_token"' not in page and 'name="status"' not in page
    form = client.get(f"/admin/dashboard/job/{job.id}/change/")
    assert form.status_code == 200
    client.post(f"/admin/dashboard/job/{job.id}/delete/", {"post": "yes"})
    assert not Job.objects.filter(id=job.id).exists()
    entry = AuditEntry.objects.get(verb="admin-delete")
    assert (entry.job, entry.target, entry.username, entry.origin) == ("orders", f"job #{job.id}", "root", "admin")
    settings.READ_ONLY = True
    again = make_job(name="clicks")
    assert client.post(f"/admin/dashboard/job/{again.id}/delete/", {"post": "yes"}).status_code == 403
    assert Job.objects.filter(id=again.id).exists()


def test_the_audit_pages_user_filter_lists_real_users_only(as_role, client):
    client.post("/login/", {"username": "attacker-made-this-up", "password": "guess"})
    page = as_role("admin", "auditor").get("/audit/").content.decode()
    assert "<option >auditor</option>" in page
    assert "<option >attacker-made-this-up</option>" not in page, "a failed login's name is not a user"
    assert "attacker-made-this-up" in page, "the attempt itself is still in the trail"


@pytest.mark.django_db(transaction=True)
def test_the_app_role_cannot_rewrite_or_erase_the_audit_trail(make_job, settings):
    """The console's processes connect as the app role (the suite's worker and drivers do too): it adds entries and
    runs jobs, but cannot change, delete, truncate or unprotect the audit trail."""
    if connection.vendor != "postgresql":
        pytest.skip("roles are PostgreSQL's")
    import psycopg

    AuditEntry.objects.create(verb="savepoint", job="orders", outcome="requested")
    db = connection.settings_dict
    app = psycopg.connect(
        host=db["HOST"], port=db["PORT"], dbname=db["NAME"], user=settings.DB_APP_ROLE, autocommit=True
    )
    app.execute("INSERT INTO dashboard_auditentry (at, user_id, username, address, origin, verb, job, target, params,"
                " outcome, message) VALUES (now(), NULL, 'x', '', 'system', 'probe', '', '', '{}', '', '')")  # fmt: skip
    app.execute("UPDATE dashboard_job SET max_records_per_batch = 5 WHERE false")  # the app's own tables it may change
    for statement, refusal in [
        ("UPDATE dashboard_auditentry SET outcome = 'succeeded'", "permission denied"),
        ("DELETE FROM dashboard_auditentry", "permission denied"),
        ("TRUNCATE dashboard_auditentry", "permission denied"),
        ("ALTER TABLE dashboard_auditentry DISABLE TRIGGER audit_append_only", "must be owner"),
        ("DROP TRIGGER audit_append_only ON dashboard_auditentry", "must be owner"),
        ("DROP TABLE dashboard_auditentry", "must be owner"),
    ]:
        with pytest.raises(psycopg.Error, match=refusal):
            app.execute(statement)
    app.close()
    assert AuditEntry.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_the_audit_export_streams_asynchronously_up_to_its_row_cap(as_role, settings):
    import asyncio

    from django.test import AsyncClient

    AuditEntry.objects.bulk_create(AuditEntry(verb="start", job="orders", target=str(i)) for i in range(30))
    settings.AUDIT_CSV_MAX_ROWS = 25
    admin = as_role("admin", "bob")

    async def export() -> tuple[object, list[str]]:
        client = AsyncClient()
        client.cookies = admin.cookies
        response = await client.get("/audit/?format=csv")
        assert response.is_async, "an async iterator: under ASGI it is sent as it is read, never whole in memory"
        return response, [chunk.decode() async for chunk in response.streaming_content]

    response, chunks = asyncio.run(export())
    rows = list(csv.DictReader(io.StringIO("".join(chunks))))
    assert len(rows) == 25 and response["X-Statekeeper-Rows"] == "25"
    assert response["X-Statekeeper-Truncated"].startswith("25 of 31 entries")  # 30 and bob's login
    assert rows[0]["verb"] == "login" and rows[-1]["target"] == "6", "the newest first"
