"""Start and stop requests: one driver per checkpoint whatever the clicks, redeliveries or races."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from unittest.mock import patch

import pytest
from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from statekeeper_sdk import ResultRecord, ResultView

from dashboard.models import Action, ActionKind, AuditEntry, Job, ResultRow, ResultUndo, Run, RunStatus
from dashboard.pipelines import get as get_pipeline
from dashboard.services import runs as run_services
from dashboard.services.actions import actions_resume
from dashboard.services.errors import ActionRefused
from dashboard.services.lease import lease_acquire, lease_renew
from dashboard.services.runs import job_request_start, job_request_stop, run_launch, runs_supervise
from tests.conftest import grant
from workers.sink import Fenced, SinkSet, batch_writer, results_rows, write_results

pytestmark = pytest.mark.django_db


@pytest.fixture
def spawned(monkeypatch):
    """Record driver spawns instead of starting a JVM: these tests are about who may start one, not the driver."""
    calls: list[int] = []

    def spawn(run: Run) -> int:
        calls.append(run.id)
        return 999_999

    monkeypatch.setattr(run_services, "spawn_driver", spawn)
    return calls


@pytest.fixture
def operator_client(client, django_user_model):
    client.force_login(grant(django_user_model.objects.create_user("operator", password="x"), "operator"))
    return client


def test_a_second_start_of_a_running_job_is_refused_with_a_clear_message(make_job, operator_client, spawned):
    job = make_job()
    first = operator_client.post(f"/jobs/{job.name}/start", follow=True)
    assert "Start of" in first.content.decode()
    second = operator_client.post(f"/jobs/{job.name}/start", follow=True)
    page = second.content.decode()
    assert "already has run #" in page and "one driver per checkpoint" in page
    assert job.runs.count() == 1


def test_the_database_refuses_a_second_active_run_even_without_the_check(make_job):
    job = make_job()
    Run.objects.create(job=job, status=RunStatus.RUNNING)
    with pytest.raises(IntegrityError), transaction.atomic():  # PostgreSQL names the index; SQLite the column
        Run.objects.create(job=job, status=RunStatus.PENDING)
    Run.objects.filter(job=job).update(status=RunStatus.STOPPED)
    Run.objects.create(job=job, status=RunStatus.PENDING)  # a finished run does not count


def test_a_redelivered_start_task_does_not_start_a_second_driver(make_job, spawned):
    job = make_job()
    run = Run.objects.create(job=job)
    assert run_launch(run_id=run.id).status == RunStatus.STARTING
    assert run_launch(run_id=run.id).status == RunStatus.STARTING
    assert spawned == [run.id]


def test_a_start_is_refused_while_another_driver_holds_the_lease(make_job, spawned):
    job = make_job()
    assert lease_acquire(job_id=job.id) is not None  # a driver from elsewhere holds the checkpoint
    run = Run.objects.create(job=job)
    refused = run_launch(run_id=run.id)
    assert refused.status == RunStatus.REFUSED
    assert "leased by another driver" in refused.message
    assert spawned == []


def test_an_expired_lease_is_taken_over_with_a_higher_fencing_token(make_job):
    job = make_job()
    old = lease_acquire(job_id=job.id)
    assert old is not None
    assert lease_acquire(job_id=job.id) is None
    Job.objects.filter(id=job.id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    new = lease_acquire(job_id=job.id)
    assert new is not None and new > old
    assert not lease_renew(job_id=job.id, token=old), "the old holder learns it was fenced"


def test_a_fenced_driver_cannot_write_results(make_job):
    job = make_job()
    old = lease_acquire(job_id=job.id)
    assert old is not None
    write_results(job_id=job.id, token=old, batch_id=0, results=[("url", "/a", {"requests": 1})])
    Job.objects.filter(id=job.id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert lease_acquire(job_id=job.id) is not None
    with pytest.raises(Fenced):
        write_results(job_id=job.id, token=old, batch_id=1, results=[("url", "/a", {"requests": 99})])
    assert job.results.get().value == {"requests": 1}


def test_a_result_the_pipelines_views_do_not_show_goes_to_the_dead_letters_and_the_rest_is_stored(make_job):
    """Results are typed records: a kind no view shows (stored, it would never be seen), a value that is not a dict,
    an item that is not (kind, key, value) are each refused with the reason, and the batch's other results stored."""
    job = make_job()
    token = lease_acquire(job_id=job.id)
    assert token is not None

    def results(rows):
        yield ResultRecord("url", "/a", {"requests": 2})
        yield "url", "/b", {"requests": 1}
        yield "urls", "/c", {"requests": 5}
        yield "url", "/d", 7
        yield ("url", "/e")

    pipeline = replace(get_pipeline("url-counts"), results=results)
    rejected: list = []
    write_results(job_id=job.id, token=token, batch_id=0, results=results_rows(pipeline, iter([{}])), rejected=rejected)
    assert sorted((r.key, r.value["requests"]) for r in job.results.all()) == [("/a", 2), ("/b", 1)]
    reasons = [r.reason for r in rejected]
    assert reasons[0].startswith("the kind 'urls' has no view in url-counts (its views show 'url')"), reasons
    assert reasons[1:] == [
        "a url result's value is a dict, not int",
        "a result is (kind, key, value), not tuple ('url', '/e')",
    ]
    assert {r.stage for r in rejected} == {"sink"} and all(r.entry.startswith("batch-0:results:") for r in rejected)


def test_a_replayed_batch_changes_nothing_in_the_sink(make_job):
    job = make_job()
    token = lease_acquire(job_id=job.id)
    assert token is not None
    rows = [("url", "/a", {"requests": 3}), ("url", "/b", {"requests": 1})]
    write_results(job_id=job.id, token=token, batch_id=4, results=rows)
    write_results(job_id=job.id, token=token, batch_id=4, results=rows)
    assert sorted((r.key, r.value["requests"]) for r in job.results.all()) == [("/a", 3), ("/b", 1)]


def test_going_back_undoes_what_later_batches_did_to_the_results_even_for_keys_the_replay_does_not_emit(make_job):
    """A rollback to batch 1: batch 2 added /c and changed /a; the replay of batch 2 emits only /b. The results table
    is then as the state is: /c gone, /a back to its value of batch 1, /b as the replay made it."""
    job = make_job()
    token = lease_acquire(job_id=job.id)
    assert token is not None

    def write(batch: int, rows: dict[str, int]) -> None:
        write_results(job_id=job.id, token=token, batch_id=batch,
                      results=[("url", key, {"requests": n}) for key, n in rows.items()])  # fmt: skip

    def table() -> dict[str, tuple[int, int]]:
        return {r.key: (r.value["requests"], r.batch_id) for r in job.results.all()}

    write(0, {"/a": 1, "/b": 1})
    write(1, {"/a": 2})
    write(2, {"/a": 3, "/c": 1})
    write(3, {"/b": 5})
    assert table() == {"/a": (3, 2), "/b": (5, 3), "/c": (1, 2)}
    write(2, {"/b": 2})  # the replay after the rollback to batch 1
    assert table() == {"/a": (2, 1), "/b": (2, 2)}, "as of batch 1, then the replayed batch 2"
    write(2, {"/b": 2})  # the same batch again (a retry): the same rows
    assert table() == {"/a": (2, 1), "/b": (2, 2)}

    # trimmed below what a restore or rollback can reach: going back further is no longer recorded
    SinkSet(job_id=job.id, job_name=job.name, token=token, pipeline=get_pipeline("url-counts"), parameters={}).trim(2)
    assert not ResultUndo.objects.filter(job=job, batch_id__lt=2).exists()
    assert ResultUndo.objects.filter(job=job, batch_id=2).exists()


def test_the_results_table_keeps_each_kind_to_its_views_bound_and_the_results_tab_says_so(
    make_job, settings, admin_client
):
    """A view of per-entity results would add a row per entity for good: a view's keep_rows keeps the rows its latest
    batches wrote, keep_hours drops the ones no batch has written for that long, and a kind without a bound of its own
    keeps the console's default count."""
    settings.RESULTS_KEEP_ROWS = 3
    columns = (("URL", "key"), ("Requests", "requests"))
    pipeline = replace(
        get_pipeline("url-counts"),
        views=(ResultView("url", "Top URLs", columns, "requests", keep_rows=2),
               ResultView("hour", "Recent", columns, keep_hours=1)),
    )  # fmt: skip
    job = make_job()
    token = lease_acquire(job_id=job.id)
    assert token is not None
    sinks = SinkSet(job_id=job.id, job_name=job.name, token=token, pipeline=pipeline, parameters={})
    for batch, key in enumerate(["/a", "/b", "/c", "/a", "/d"]):
        write_results(job_id=job.id, token=token, batch_id=batch,
                      results=sinks._noted([("url", key, {"requests": batch}), ("hour", key, {"requests": batch}),
                                            ("other", key, {"requests": batch})]))  # fmt: skip
    ResultRow.objects.filter(job=job, kind="hour", key__in=["/b", "/c"]).update(
        updated_at=timezone.now() - timedelta(minutes=61)
    )
    sinks.trim(None)  # nothing reachable yet: the bounds hold all the same

    def keys(kind: str) -> list[str]:
        return sorted(ResultRow.objects.filter(job=job, kind=kind).values_list("key", flat=True))

    assert keys("url") == ["/a", "/d"], "the two keys the latest batches wrote"
    assert keys("hour") == ["/a", "/d"], "the rows no batch wrote in the last hour are gone"
    assert keys("other") == ["/a", "/c", "/d"], "a kind without a view keeps the default count"
    assert write_results(job_id=job.id, token=token, batch_id=5, results=[("url", "/b", {"requests": 9})]) == 1

    with patch("dashboard.selectors.jobs.pipelines.find", return_value=pipeline):
        page = admin_client.get(f"/jobs/{job.name}/results").content.decode()
    assert "Keeps the newest 2 rows" in page and "Keeps rows written in the last 1 h" in page


@pytest.mark.parametrize(
    "bound", [{"keep_rows": 0}, {"keep_rows": 2.5}, {"keep_hours": -1}, {"keep_hours": float("nan")}]
)
def test_a_views_bound_that_is_not_a_positive_number_is_refused_at_import(bound):
    with pytest.raises(ValueError, match="view 'url': keep_"):
        ResultView("url", "Top URLs", (("URL", "key"),), **bound)


def test_a_key_given_twice_in_a_batch_keeps_its_last_value_and_a_failed_batch_leaves_nothing(make_job):
    job = make_job()
    token = lease_acquire(job_id=job.id)
    assert token is not None
    rows = [("url", "/a", {"requests": 1}), ("url", "/b", {"requests": 5}), ("url", "/a", {"requests": 2})]
    assert write_results(job_id=job.id, token=token, batch_id=1, results=rows) == 2, "two distinct keys"
    assert sorted((r.key, r.value["requests"], r.batch_id) for r in job.results.all()) == [("/a", 2, 1), ("/b", 5, 1)]

    def breaks_midway():
        yield "url", "/a", {"requests": 7}
        raise RuntimeError("the frame failed")

    with pytest.raises(RuntimeError, match="the frame failed"):
        write_results(job_id=job.id, token=token, batch_id=2, results=breaks_midway())
    # the next batch starts from an empty scratch table: nothing of the failed one is upserted with it
    write_results(job_id=job.id, token=token, batch_id=2, results=[("url", "/b", {"requests": 6})])
    assert sorted((r.key, r.value["requests"]) for r in job.results.all()) == [("/a", 2), ("/b", 6)]


def test_stop_is_safe_to_ask_twice_and_refused_when_not_running(make_job):
    job = make_job()
    with pytest.raises(ActionRefused, match="is not running"):
        job_request_stop(job=job)
    run = Run.objects.create(job=job, status=RunStatus.RUNNING)
    job_request_stop(job=job)
    asked = Run.objects.get(id=run.id).stop_requested_at
    job_request_stop(job=job)
    run.refresh_from_db()
    assert run.status == RunStatus.STOPPING and run.stop_requested_at == asked


def test_a_dead_driver_is_marked_lost_and_its_lease_released(make_job):
    job = make_job()
    token = lease_acquire(job_id=job.id)
    run = Run.objects.create(
        job=job,
        status=RunStatus.RUNNING,
        fencing_token=token,
        pid=2**22 + 12345,
        host=settings.HOST_ID,
        started_at=timezone.now(),
    )
    assert run_services.runs_supervise() == [f"run {run.id} lost"]
    run.refresh_from_db()
    assert run.status == RunStatus.LOST and "exited without reporting" in run.message
    job.refresh_from_db()
    assert not job.lease_is_held()
    assert job_request_start(job=job).status == RunStatus.PENDING


def test_a_job_whose_checkpoint_vanished_is_not_started_from_nothing(make_job, spawned):
    from dashboard.models import Checkpoint
    from dashboard.services.recovery import recoveries_supervise

    job = make_job()
    checkpoint = Checkpoint.objects.create(job=job, batch_id=41, committed_at=timezone.now(), duration_ms=1)
    Job.objects.filter(id=job.id).update(latest_checkpoint=checkpoint)
    run = Run.objects.create(job=job)
    failed = run_launch(run_id=run.id)
    assert failed.status == RunStatus.FAILED
    assert "checkpoint directory is missing or empty" in failed.message and "batch 41" in failed.message
    assert spawned == []
    recoveries_supervise()
    job.refresh_from_db()
    assert "The checkpoint is broken" in job.failed_reason, "reported, not restarted in a loop"


def test_a_person_cannot_start_a_job_while_an_action_is_in_flight_but_the_action_can(
    make_job, operator_client, spawned
):
    from dashboard.models import Action
    from dashboard.services.runs import job_request_start

    job = make_job()
    action = Action.objects.create(job=job, kind="rollback", status="running")
    page = operator_client.post(f"/jobs/{job.name}/start", follow=True).content.decode()
    assert f"has roll back to a batch #{action.id} in flight: wait for it." in page
    assert not job.runs.exists()
    assert job_request_start(job=job).status == RunStatus.PENDING, "a rollback starts the job on its fork itself"


def test_starts_and_requests_no_worker_ever_took_are_expired_with_the_reason(make_job):
    job = make_job()
    long_ago = timezone.now() - timedelta(minutes=11)
    run = Run.objects.create(job=job, status=RunStatus.PENDING, requested_at=long_ago)
    action = Action.objects.create(job=job, kind=ActionKind.SAVEPOINT, requested_at=long_ago)
    runs_supervise()
    assert actions_resume() == ["1 requests no worker took marked failed"]
    run.refresh_from_db()
    action.refresh_from_db()
    assert run.status == RunStatus.FAILED and "No driver was launched" in run.message
    assert action.status == "failed" and "No worker took this request" in action.outcome
    assert job_request_start(job=job).status == RunStatus.PENDING, "the job is not stuck behind them"


def test_an_expired_lease_is_not_renewed_a_paused_driver_must_not_take_it_back(make_job):
    job = make_job()
    token = lease_acquire(job_id=job.id)
    assert lease_renew(job_id=job.id, token=token)
    Job.objects.filter(id=job.id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert not lease_renew(job_id=job.id, token=token)


@pytest.mark.spark
def test_a_fenced_driver_does_not_even_compute_its_batch(make_job, spark, tmp_path):
    """Computing a batch's frame runs its stateful operators, which write the batch's state files: a driver that lost
    its lease is stopped before that, not only at the sink."""
    from pyspark.sql import functions as F

    from dashboard.pipelines import get as get_pipeline

    job = make_job()
    old = lease_acquire(job_id=job.id)
    Job.objects.filter(id=job.id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
    assert old is not None and lease_acquire(job_id=job.id) is not None
    marker = tmp_path / "computed"

    @F.udf("string")
    def touched(url):  # no type hints: Spark would read them as a pandas UDF's
        marker.write_text("the frame was computed")
        return url

    frame = spark.range(3).select(touched(F.concat(F.lit("/"), F.col("id").cast("string"))).alias("url"))
    frame = frame.groupBy("url").agg(F.count(F.lit(1)).alias("requests"))
    write = batch_writer(job_id=job.id, token=old, pipeline=get_pipeline("url-counts"))
    with pytest.raises(Fenced, match="not running batch 5"):
        write(frame, 5)
    assert not marker.exists() and not job.results.exists()


def _left_by_an_earlier_console(job: Job) -> None:
    """Batches 0–3 committed in the job's directory, and the journals of the earlier console's runs #1 and #2 (the
    second cut short by a kill), as an earlier console on another database leaves them."""
    commits = job.checkpoint_location / "commits"
    commits.mkdir(parents=True)
    for batch in range(4):
        (commits / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')
    journal = job.directory / "journal"
    journal.mkdir()

    def line(run: int, batch: int) -> str:
        at = (timezone.now() - timedelta(days=3) + timedelta(seconds=batch)).isoformat()
        record = {
            "batch_id": batch,
            "committed_at": at,
            "location": "checkpoint",
            "input_rows": 10 * (batch + 1),
            "duration_ms": 100,
        }
        return json.dumps({"job": 999, "run": run, "record": record}) + "\n"

    (journal / "run-1.jsonl").write_text(line(1, 0) + line(1, 1))
    (journal / "run-2.jsonl").write_text(line(2, 2) + line(2, 3) + '{"job": 999, "run": 2, "rec')


def test_a_checkpoint_this_console_never_recorded_is_not_resumed_without_a_word(make_job, as_role, spawned):
    job = make_job()
    _left_by_an_earlier_console(job)
    with pytest.raises(ActionRefused, match=r"holds batches 0–3 that this console never recorded.*2 journal\(s\)"):
        job_request_start(job=job)
    assert not job.runs.exists(), "refused: nothing started"

    # the job's page says so and offers the two choices
    page = as_role("operator").get(f"/jobs/{job.name}/")
    assert b"A checkpoint this console never recorded" in page.content
    assert b"Adopt the checkpoint" in page.content and b"Set it aside, start empty" in page.content

    # adopted: the earlier runs' history comes in run by run, as it happened; the journals move out of the way of
    # this console's own runs (whose ids would otherwise find them), and the job starts on the checkpoint
    as_role("operator", "op-2").post(f"/jobs/{job.name}/checkpoint/adopt")
    adopted = list(job.runs.order_by("id"))
    assert [(r.status, r.host) for r in adopted] == [(RunStatus.STOPPED, "adopted")] * 2
    assert "run #1 of an earlier console" in adopted[0].message and "batches 2–3" in adopted[1].message
    assert [list(r.checkpoints.order_by("batch_id").values_list("batch_id", flat=True)) for r in adopted] == [
        [0, 1], [2, 3],
    ]  # fmt: skip
    assert Job.objects.get(id=job.id).latest_checkpoint.batch_id == 3
    assert not (job.directory / "journal").exists() and list(job.directory.glob("journal-adopted-*/run-2.jsonl"))
    run = job_request_start(job=job)
    assert run.status == RunStatus.PENDING and AuditEntry.objects.filter(verb="checkpoint-adopt", job=job.name).exists()


def test_an_unknown_checkpoint_set_aside_through_the_api_lets_the_job_start_from_nothing(make_job, client, spawned):
    from django.contrib.auth.models import User

    from dashboard.api.tokens import token_create

    operator = grant(User.objects.create_user("deployer"), "operator")
    auth = {"HTTP_AUTHORIZATION": "Bearer " + token_create(user=operator, name="ci")[1]}
    job = make_job()
    _left_by_an_earlier_console(job)
    shown = client.get(f"/api/v1/jobs/{job.name}", **auth).json()
    assert "holds batches 0–3" in shown["unknown_checkpoint"]
    refused = client.post(f"/api/v1/jobs/{job.name}/start", {}, content_type="application/json", **auth)
    assert refused.status_code == 409 and "never recorded" in refused.json()["error"]
    bad = client.post(f"/api/v1/jobs/{job.name}/checkpoint-decision", {"decision": "keep"}, content_type="application/json",
                      **auth)  # fmt: skip
    assert bad.status_code == 400

    done = client.post(f"/api/v1/jobs/{job.name}/checkpoint-decision", {"decision": "set-aside"},
                       content_type="application/json", **auth)  # fmt: skip
    assert done.status_code == 200 and "starts from nothing" in done.json()["outcome"]
    assert not job.checkpoint_location.exists(), "the job's directory is empty for it"
    kept = list(job.directory.glob("checkpoint-set-aside-*/commits/3"))
    assert kept, "the earlier checkpoint is kept beside it"
    assert client.get(f"/api/v1/jobs/{job.name}", **auth).json()["unknown_checkpoint"] == ""
    again = client.post(f"/api/v1/jobs/{job.name}/checkpoint-decision", {"decision": "adopt"},
                        content_type="application/json", **auth)  # fmt: skip
    assert again.status_code == 409 and "nothing to adopt" in again.json()["error"], again.json()
    assert client.post(f"/api/v1/jobs/{job.name}/start", {}, content_type="application/json", **auth).status_code == 202


def test_the_demo_seeding_leaves_a_checkpoint_it_never_recorded_to_the_operator_and_starts_the_rest(spawned):
    """`./bin/dev` run again on new databases finds the checkpoints an earlier console left: the console comes up, the
    job with one is not started (its page offers adopt or set aside), the others are."""
    from io import StringIO

    from django.core.management import call_command

    left = Job.objects.create(name="url-counts-memory", pipeline="url-counts", source_stream="events:access-log")
    (left.checkpoint_location / "commits").mkdir(parents=True)
    (left.checkpoint_location / "commits" / "7").write_text('v1\n{"nextBatchWatermarkMs":0}\n')
    out = StringIO()
    call_command("seed_demo", stdout=out)
    assert "  Not started: " in out.getvalue() and "batches 7–7 that this console never recorded" in out.getvalue()
    assert not left.runs.exists()
    assert Job.objects.get(name="orders-rocksdb").runs.filter(status=RunStatus.PENDING).exists()
