"""Jobs as code: create, read, change (with If-Match) and archive jobs through the API, validated as the form validates;
a plan of a set of specs that changes nothing; and the `statekeeper` command applying a directory of specs to a
running console (three jobs through create, upgrade, refusal, suspend, resume and archive)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dashboard.api.tokens import token_create
from dashboard.models import ACTIVE_RUN_STATUSES, AuditEntry, Job, ResultRow
from dashboard.specs import SETTINGS, plan, spec_reference
from tests.conftest import grant, send_events, wait_for
from tests.support import SPEND, Orders, sink

pytestmark = pytest.mark.django_db

SPEC = {
    "name": "clicks",
    "pipeline": "url-counts",
    "source_stream": "events:clicks",
    "state_backend": "memory",
    "trigger_interval_seconds": 2,
    "parallelism": 1,
    "state_partitions": 2,
    "state": "suspended",
}


@pytest.fixture
def admin(django_user_model) -> str:
    user = django_user_model.objects.create_user("deployer", password="x")
    grant(user, "admin")
    return "Bearer " + token_create(user=user, name="ci")[1]


def send(client, method: str, path: str, auth: str, body=None, **headers):
    data = json.dumps(body) if body is not None else ""
    return client.generic(method, path, data, content_type="application/json", HTTP_AUTHORIZATION=auth, **headers)


def test_a_job_is_created_changed_with_if_match_and_archived_through_the_api(client, admin, django_user_model):
    viewer_user = django_user_model.objects.create_user("watcher", password="x")
    viewer = "Bearer " + token_create(user=viewer_user, name="ro")[1]
    assert send(client, "POST", "/api/v1/jobs", viewer, SPEC).status_code == 403, "creating needs the admin role"

    bad = send(client, "POST", "/api/v1/jobs", admin, {**SPEC, "parallelism": 0, "colour": "red"})
    assert bad.status_code == 400 and bad.json()["problems"] == {"colour": ["is not a setting of a job"]}
    bad = send(client, "POST", "/api/v1/jobs", admin, {**SPEC, "parallelism": 0})
    assert bad.status_code == 400 and "parallelism" in bad.json()["problems"], "the form's own checks"
    created = send(client, "POST", "/api/v1/jobs", admin, SPEC)
    assert created.status_code == 201, created.json()
    assert created["Location"] == "/api/v1/jobs/clicks" and created["ETag"] == created.json()["job"]["etag"]
    assert "run" not in created.json(), "suspended: created, not started"
    assert send(client, "POST", "/api/v1/jobs", admin, SPEC).status_code == 400, "the name is taken"

    got = send(client, "GET", "/api/v1/jobs/clicks", viewer)
    tag = got["ETag"]
    assert got.json()["spec"]["trigger_interval_seconds"] == 2 and got.json()["drift"] == []
    assert send(client, "PATCH", "/api/v1/jobs/clicks", admin, {"trigger_interval_seconds": 5}).status_code == 428
    assert send(client, "PATCH", "/api/v1/jobs/clicks", admin, {"trigger_interval_seconds": 5},
                HTTP_IF_MATCH='"stale"').status_code == 412  # fmt: skip
    refused = send(client, "PATCH", "/api/v1/jobs/clicks", admin, {"trigger_interval_seconds": -1}, HTTP_IF_MATCH=tag)
    assert refused.status_code == 400 and "trigger_interval_seconds" in refused.json()["problems"]
    changed = send(client, "PATCH", "/api/v1/jobs/clicks", admin, {"trigger_interval_seconds": 5}, HTTP_IF_MATCH=tag)
    assert changed.status_code == 200 and changed["ETag"] != tag
    assert Job.objects.get(name="clicks").trigger_interval_seconds == 5
    again = send(client, "PATCH", "/api/v1/jobs/clicks", admin, {"parallelism": 2}, HTTP_IF_MATCH=tag)
    assert again.status_code == 412, "the ETag changed with the first PATCH: a lost update is refused"

    # changed in the console afterwards: the job says how it drifted from its spec
    Job.objects.filter(name="clicks").update(max_records_per_batch=777)  # a setting the spec leaves out: no drift
    assert send(client, "GET", "/api/v1/jobs/clicks", viewer).json()["drift"] == []
    Job.objects.filter(name="clicks").update(trigger_interval_seconds=9)
    assert send(client, "GET", "/api/v1/jobs/clicks", viewer).json()["drift"] == [
        "trigger_interval_seconds: the spec says 5, the job has 9.0"
    ]

    archived = send(client, "DELETE", "/api/v1/jobs/clicks", admin)
    assert archived.status_code == 200 and archived.json() == {"archived": "clicks"}
    assert send(client, "GET", "/api/v1/jobs/clicks", viewer).status_code == 404
    assert Job.objects.get(name="clicks").archived_at is not None, "kept, with its state and history"
    assert send(client, "POST", "/api/v1/jobs", admin, SPEC).status_code == 400, "the name stays taken"
    # asked to, the archived job gives its name up: renamed, its files moving with it, and the name is free again
    job = Job.objects.get(name="clicks")
    (job.savepoint_root / "sp-1").mkdir(parents=True)
    saved = job.savepoints.create(path=str(job.savepoint_root / "sp-1"), status="verified")
    freed = send(client, "DELETE", "/api/v1/jobs/clicks?free_name=true", admin)
    assert freed.status_code == 200 and freed.json() == {"freed": "clicks", "archived_as": f"clicks-archived-{job.id}"}
    saved.refresh_from_db()
    assert Path(saved.path).is_dir() and f"clicks-archived-{job.id}" in saved.path and not job.directory.exists()
    assert send(client, "POST", "/api/v1/jobs", admin, SPEC).status_code == 201
    verbs = list(AuditEntry.objects.filter(job="clicks").order_by("id").values_list("verb", "outcome"))
    assert verbs == [("job-create", "refused"), ("job-create", "refused"), ("job-create", "succeeded"),
                     ("job-create", "refused"), ("job-edit", "refused"), ("job-edit", "succeeded"),
                     ("job-archive", "succeeded"), ("job-create", "refused"),
                     ("job-free-name", "succeeded"), ("job-create", "succeeded")]  # fmt: skip


def test_a_plan_says_what_applying_would_do_and_changes_nothing(make_job, tmp_path):
    make_job(name="kept", pipeline="url-counts", parallelism=1, applied_spec={"name": "kept"})
    make_job(name="gone", pipeline="url-counts", applied_spec={"name": "gone"})
    make_job(name="manual", pipeline="url-counts")
    specs = [
        {**SPEC, "name": "fresh", "state": "running"},
        {"name": "kept", "parallelism": 2, "trigger_interval_seconds": 3, "state": "suspended"},
        {**SPEC, "name": "broken", "source_stream": "bad stream name!"},
        {"name": "manual", "parallelism": "two"},
    ]
    before = list(Job.objects.order_by("name").values())
    found = {p.name: p for p in plan(specs, prune=True)}
    assert [s.action for s in found["fresh"].steps] == ["create", "start"]
    assert [(s.action, s.params) for s in found["kept"].steps] == [
        ("update", {"spec": {"trigger_interval_seconds": 3}}), ("rescale", {"parallelism": 2}),
    ]  # fmt: skip
    assert found["broken"].change == "refused" and "source_stream" in found["broken"].refusal
    assert [s.action for s in found["gone"].steps] == ["archive"], "a spec-made job no file names"
    assert found["manual"].change == "refused" and "parallelism: a whole number" in found["manual"].refusal
    assert [p.name for p in plan(specs[:3], prune=True)].count("manual") == 0, "a console-made job is never pruned"
    assert list(Job.objects.order_by("name").values()) == before


def test_an_existing_jobs_spec_is_validated_as_a_new_ones_and_a_typo_is_never_guessed(make_job):
    """The same typos a new job's spec is refused for are refused for an existing job's: nothing is planned from a
    spec that says something the console does not know (``Running`` is not read as "not running")."""
    make_job(name="live", pipeline="url-counts", applied_spec={"name": "live"})
    typos = {
        "state": {"state": "Running"},
        "upgrade_mode": {"pipeline": "url-counts-v2", "upgrade_mode": "blue_green"},
        "paralelism": {"paralelism": 2},
        "package": {"package": 5},
        "pipeline": {"pipeline": 5},
        "parameters": {"parameters": "top=3"},
    }
    for field, typo in typos.items():
        for name in ("live", "new-one"):
            spec = ({"name": name} if name == "live" else {**SPEC, "name": name}) | typo
            found = plan([spec])[0]
            assert found.change == "refused" and field in found.refusal and not found.steps, (name, typo, found)


def cli(console: str, token: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "STATEKEEPER_URL": console, "STATEKEEPER_TOKEN": token}
    command = [str(Path(sys.executable).parent / "statekeeper"), "--json", "--timeout", "300", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)


def url_total(job: Job) -> int:
    return sum(int(r.value["requests"]) for r in ResultRow.objects.filter(job=job, kind="url"))


def session_total(job: Job) -> int:
    return sum(int(r.value["events"]) for r in ResultRow.objects.filter(job=job, kind="totals"))


@pytest.mark.spark  # three jobs through every kind of change, on a running console: about two minutes
@pytest.mark.django_db(transaction=True)
def test_statekeeper_apply_takes_a_directory_of_specs_through_create_upgrade_refusal_suspend_resume_and_archive(
    asgi_server, celery_worker, admin, redis, tmp_path
):
    specs = tmp_path / "jobs"
    specs.mkdir()
    streams = {name: f"events:{name}:{tmp_path.name[-6:]}" for name in ("counts", "sessions", "spend")}
    (specs / "counts.yaml").write_text(
        f"pipeline: url-counts\nsource_stream: '{streams['counts']}'\nparallelism: 1\nstate_partitions: 2\n"
        "trigger_interval_seconds: 1\ndriver: shared\n"
    )
    sessions = (
        "pipeline: {pipeline}\nsource_stream: '" + streams["sessions"] + "'\nstate_backend: rocksdb\nparallelism: 1\n"
        "state_partitions: 2\ntrigger_interval_seconds: 1\nupgrade_mode: savepoint\ndriver: shared\n"
    )
    (specs / "sessions.yaml").write_text(sessions.format(pipeline="user-sessions"))
    spend = (
        'pipeline = "customer-spend"\nsource_stream = "' + streams["spend"] + '"\nstate_backend = "rocksdb"\n'
        'parallelism = 1\nstate_partitions = 2\ntrigger_interval_seconds = 1\nstate = "{state}"\ndriver = "shared"\n'
        "[parameters]\nwindow_minutes = 30\n"
    )
    (specs / "spend.toml").write_text(spend.format(state="running"))
    token = admin.removeprefix("Bearer ")
    sent = {"counts": send_events(redis, streams["counts"], "url-counts", 200, seed=1),
            "sessions": send_events(redis, streams["sessions"], "user-sessions", 200, seed=2)}  # fmt: skip
    orders = Orders(redis, streams["spend"])
    orders.send(40, seed=3)

    def exact() -> bool:
        jobs = {j.name: j for j in Job.objects.all()}
        want = {k: {f: v[f] for f in SPEND} for k, v in orders.expected(window_minutes=30).items()}
        return (
            url_total(jobs["counts"]) == sent["counts"]
            and session_total(jobs["sessions"]) == sent["sessions"]
            and sink(jobs["spend"]) == want
        )

    planned = cli(asgi_server, token, "plan", str(specs))
    assert planned.returncode == 2, planned.stderr
    assert {j["name"]: j["change"] for j in json.loads(planned.stdout)["jobs"]} == {
        "counts": "create", "sessions": "create", "spend": "create",
    }  # fmt: skip
    assert not Job.objects.exists(), "a plan changes nothing"
    applied = cli(asgi_server, token, "apply", str(specs))
    assert applied.returncode == 0, applied.stderr
    wait_for(exact, 300, 2, "the three jobs to count every event")
    assert cli(asgi_server, token, "plan", str(specs)).returncode == 0, "applied: nothing left to do"

    # a version change: planned as a compatible upgrade (the preview on the job's state), applied with the state kept
    (specs / "sessions.yaml").write_text(sessions.format(pipeline="user-sessions-v2"))
    planned = cli(asgi_server, token, "plan", str(specs))
    assert planned.returncode == 2, planned.stderr
    step = next(j for j in json.loads(planned.stdout)["jobs"] if j["name"] == "sessions")["steps"][0]
    assert step["action"] == "upgrade" and step["verdict"]["verdict"] == "compatible", step
    applied = cli(asgi_server, token, "apply", str(specs))
    assert applied.returncode == 0, applied.stderr
    assert Job.objects.get(name="sessions").pipeline == "user-sessions-v2"
    # what apply upgraded is the spec applied: status shows no drift, and a plan has nothing left to do
    shown = json.loads(cli(asgi_server, token, "status", "sessions").stdout)["jobs"][0]
    assert shown["drift"] == [], shown["drift"]
    assert cli(asgi_server, token, "plan", str(specs)).returncode == 0
    sent["sessions"] += send_events(redis, streams["sessions"], "user-sessions", 100, seed=4)
    wait_for(exact, 300, 2, "the upgraded job to count on from its state")

    # a key change: planned as refused, and an apply changes nothing
    (specs / "sessions.yaml").write_text(sessions.format(pipeline="user-sessions-by-region"))
    planned = cli(asgi_server, token, "plan", str(specs))
    assert planned.returncode == 1 and "refused" in planned.stderr, planned.stderr
    applied = cli(asgi_server, token, "apply", str(specs))
    assert applied.returncode == 1 and Job.objects.get(name="sessions").pipeline == "user-sessions-v2"
    (specs / "sessions.yaml").write_text(sessions.format(pipeline="user-sessions-v2"))

    # suspended: stopped with a savepoint; running: resumed from it, every order counted once
    (specs / "spend.toml").write_text(spend.format(state="suspended"))
    assert cli(asgi_server, token, "apply", str(specs)).returncode == 0
    job = Job.objects.get(name="spend")
    assert not job.runs.filter(status__in=ACTIVE_RUN_STATUSES).exists() and job.savepoints.exists()
    orders.send(20, seed=5)
    (specs / "spend.toml").write_text(spend.format(state="running"))
    assert cli(asgi_server, token, "apply", str(specs)).returncode == 0
    wait_for(exact, 300, 2, "the resumed job to count the orders sent while it was suspended")

    # a file removed: the job is archived (stopped with a savepoint, its state kept)
    (specs / "counts.yaml").unlink()
    applied = cli(asgi_server, token, "apply", "--prune", str(specs))
    assert applied.returncode == 0, applied.stderr
    counts = Job.objects.get(name="counts")
    assert counts.archived_at is not None and counts.savepoints.exists()
    wait_for(
        lambda: not counts.runs.filter(status__in=ACTIVE_RUN_STATUSES).exists(), 120, 0.5, "the archived job to stop"
    )
    assert url_total(counts) == sent["counts"] and exact()
    status = json.loads(cli(asgi_server, token, "status").stdout)
    assert sorted(j["name"] for j in status["jobs"]) == ["sessions", "spend"]


def test_the_spec_reference_in_docs_is_the_one_the_form_makes():
    """docs/specs.md is generated from the form that validates a spec: a setting added, bounded or renamed there
    without `./manage.py spec_reference > docs/specs.md` fails here."""
    written = (Path(__file__).resolve().parent.parent / "docs" / "specs.md").read_text()
    assert written == spec_reference()
    for key in (*SETTINGS, "state", "upgrade_mode", "package"):
        assert f"| `{key}` |" in written
    assert "| `parallelism` | a whole number from 1 to 64 |" in written
