"""The parts of a blue/green upgrade that need no running job: green's source following the job's checkpoint batch by
batch, the file sink's fence, the per-batch diff against what the job wrote, the promotion rules, and the API and page
that drive it (the whole upgrade, with kills, runs in tests/test_blue_green.py, ``-m chaos``)."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from django.conf import settings
from django.utils import timezone
from pyspark.sql.streaming.datasource import ReadAllAvailable

from dashboard.checkpoint_dir.files import handed_over_after, mark_handed_over
from dashboard.engine.sinks import Fenced, FileLog
from dashboard.models import Action, ActionKind, ActionStatus, GreenBatch, ResultRow, ResultUndo, Run, RunStatus
from dashboard.selectors.jobs import job_lag_status
from dashboard.services import blue_green
from dashboard.services.action_steps import Next, Wait
from dashboard.services.blue_green import (
    action_rules,
    green_committed_lag,
    green_view,
    handover_point,
    rules_problems,
)
from tests.conftest import wait_for
from tests.support import visits_sent
from tests.test_api import call, token  # noqa: F401  (a fixture)
from workers.green import GreenRecorder, GreenState, blue_output, diff, wait_for_fork
from workers.spark.sources.following import BatchFollower
from workers.spark.sources.redis_streams import RedisStreamReader


def offsets_file(root: Path, batch: int, entry: str, n: int) -> None:
    (root / "offsets").mkdir(parents=True, exist_ok=True)
    (root / "offsets" / str(batch)).write_text(f'v1\n{{"batchTimestampMs":{batch}}}\n{{"id":"{entry}","n":{n}}}\n')


def commit_file(root: Path, batch: int) -> None:
    (root / "commits").mkdir(parents=True, exist_ok=True)
    (root / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}\n')


def test_green_reads_exactly_the_offsets_of_the_jobs_batch_of_its_number_once_the_job_committed_it(tmp_path):
    blue, own = tmp_path / "checkpoint", tmp_path / "checkpoint-green-1"
    for batch, (entry, n) in enumerate([("1-0", 1), ("5-0", 5), ("5-0", 5), ("9-0", 9)]):
        offsets_file(blue, batch, entry, n)
    for batch in (0, 1, 2):
        commit_file(blue, batch)
    offsets_file(own, 0, "1-0", 1)  # green forked at batch 0: its next batch is 1
    follower = BatchFollower(str(blue), str(own))
    follower.idle_wait = 0.1
    assert follower.next_end({"id": "1-0", "n": 1}) == {"id": "5-0", "n": 5}, "blue's batch 1, as blue read it"

    offsets_file(own, 1, "5-0", 5)
    assert follower.next_end({"id": "5-0", "n": 5}) == {"id": "5-0", "n": 5, "followed": 2}, (
        "blue's batch 2 read nothing (a watermark's): green runs it too, marked so that Spark plans it"
    )

    offsets_file(own, 2, "5-0", 5)
    began = time.monotonic()
    follower.RUNNING_WAIT_SECONDS = 0.3
    assert follower.next_end({"id": "5-0", "n": 5}) is None, "blue runs batch 3 and has not committed it"
    assert time.monotonic() - began >= 0.3, "green waited for it rather than answer 'no new data' at once"
    assert follower.next_end({"id": "5-0", "n": 5}, planned=True) == {"id": "9-0", "n": 9}, (
        "after the handover, blue's batch in flight: green replaces it over the same offsets"
    )
    commit_file(blue, 3)
    assert follower.next_end({"id": "4-0", "n": 4}) is None, "the numbers parted: green reads on by itself"


def test_after_a_rescale_green_runs_the_jobs_batch_one_number_below_its_own(tmp_path):
    """Spark's offline repartition wrote green's fork a batch of no input (batch 2 after blue's 1): green's batch 3
    reads blue's batch 2, and so on, one number apart."""
    blue, own = tmp_path / "checkpoint", tmp_path / "checkpoint-green-1"
    for batch, (entry, n) in enumerate([("1-0", 1), ("5-0", 5), ("7-0", 7), ("9-0", 9)]):
        offsets_file(blue, batch, entry, n)
    for batch in (0, 1, 2):
        commit_file(blue, batch)
    offsets_file(own, 0, "1-0", 1)
    offsets_file(own, 1, "5-0", 5)
    offsets_file(own, 2, "5-0", 5)  # the repartition's batch: it reads nothing
    follower = BatchFollower(str(blue), str(own), shift=1)
    follower.RUNNING_WAIT_SECONDS = 0.2
    assert follower.next_end({"id": "5-0", "n": 5}) == {"id": "7-0", "n": 7}, "green's 3 is blue's 2"
    offsets_file(own, 3, "7-0", 7)
    assert follower.next_end({"id": "7-0", "n": 7}) is None, "blue runs its 3 (green's 4), not committed yet"
    assert follower.next_end({"id": "7-0", "n": 7}, planned=True) == {"id": "9-0", "n": 9}, "after the handover"
    commit_file(blue, 3)
    assert follower.next_end({"id": "7-0", "n": 7}) == {"id": "9-0", "n": 9}, "green's 4 is blue's 3, once committed"


def kafka_offsets_file(root: Path, batch: int, offsets: dict[str, int], mark: int | None = None) -> None:
    (root / "offsets").mkdir(parents=True, exist_ok=True)
    source = {"orders": offsets, **({"followed": mark} if mark is not None else {})}
    (root / "offsets" / str(batch)).write_text(f'v1\n{{"batchTimestampMs":{batch}}}\n{json.dumps(source)}\n')


def test_a_kafka_green_follows_the_jobs_offsets_and_its_mark_of_a_no_data_batch_leaves_before_sparks_source_reads(
    tmp_path,
):
    """On Kafka, green's batch ends where the job's did per partition (in any key order); a batch the job ran without
    new data comes back marked so that Spark runs it; the job's next run with Spark's Kafka source finds the
    checkpoint unmarked (the mark would read as a topic), every file at the place it said."""
    from workers.spark.sources.following import same_place, unmark_followed

    blue, own = tmp_path / "checkpoint", tmp_path / "checkpoint-green-1"
    for batch, offsets in enumerate([{"0": 3, "1": 2}, {"1": 4, "0": 5}, {"0": 5, "1": 4}]):
        kafka_offsets_file(blue, batch, offsets)
        commit_file(blue, batch)
    kafka_offsets_file(own, 0, {"0": 3, "1": 2})
    follower = BatchFollower(str(blue), str(own))
    follower.idle_wait = 0.1
    assert follower.next_end({"orders": {"0": 3, "1": 2}}) == {"orders": {"1": 4, "0": 5}}
    kafka_offsets_file(own, 1, {"1": 4, "0": 5})
    marked = follower.next_end({"orders": {"0": 5, "1": 4}})
    assert marked == {"orders": {"0": 5, "1": 4}, "followed": 2}, "the job's batch 2 read nothing: marked"
    assert same_place(marked, {"orders": {"1": 4, "0": 5}}), "the mark says the same place"
    kafka_offsets_file(own, 2, {"0": 5, "1": 4}, mark=2)
    (own / "offsets" / ".2.crc").write_bytes(b"checksum of the marked text")

    assert unmark_followed(str(own)) == 1 and unmark_followed(str(own)) == 0
    lines = (own / "offsets" / "2").read_text().splitlines()
    assert lines[:2] == ["v1", '{"batchTimestampMs":2}'] and json.loads(lines[2]) == {"orders": {"0": 5, "1": 4}}
    assert not (own / "offsets" / ".2.crc").exists()


def test_green_follows_batches_spark_purged_from_the_jobs_checkpoint_through_the_consoles_copies(tmp_path):
    from dashboard.checkpoint_dir.files import follow_mirror, mirror_committed

    blue, own = tmp_path / "checkpoint", tmp_path / "checkpoint-green-1"
    for batch, (entry, n) in enumerate([("1-0", 1), ("5-0", 5), ("7-0", 7), ("9-0", 9)]):
        offsets_file(blue, batch, entry, n)
    for batch in (0, 1, 2):
        commit_file(blue, batch)
    mirror = follow_mirror(own)
    assert mirror_committed(blue, mirror, since=1) == 2, "batches 1 and 2: committed from the fork on"
    assert mirror_committed(blue, mirror, since=1) == 0, "each copied once"
    commit_file(blue, 3)
    assert mirror_committed(blue, mirror, since=1) == 1
    for batch in (0, 1, 2):  # Spark's retention purged them while green's driver started
        (blue / "offsets" / str(batch)).unlink()
        (blue / "commits" / str(batch)).unlink()
    offsets_file(own, 0, "1-0", 1)
    offsets_file(own, 1, "5-0", 5)
    alone = BatchFollower(str(blue), str(own))
    alone.idle_wait = 0.1
    assert alone.next_end({"id": "5-0", "n": 5}) is None, "without the copies, green cannot run blue's batch 2"
    follower = BatchFollower(str(blue), str(own), mirror=str(mirror))
    assert follower.next_end({"id": "5-0", "n": 5}) == {"id": "7-0", "n": 7}, "blue's batch 2, from the copy"


@pytest.mark.django_db
def test_green_reads_the_stream_itself_after_the_jobs_last_batch_once_handed_over(tmp_path, redis, stream_name):
    blue, own = tmp_path / "checkpoint", tmp_path / "checkpoint-green-1"
    ids = [redis.xadd(stream_name, {"v": "{}"}).decode() for _ in range(6)]
    offsets_file(blue, 0, ids[1], 2)
    offsets_file(blue, 1, ids[3], 4)
    commit_file(blue, 0)
    offsets_file(own, 0, ids[1], 2)
    handover = tmp_path / "checkpoint-green-1.handover"
    reader = RedisStreamReader({
        "url": f"redis://127.0.0.1:6379/{redis.connection_pool.connection_kwargs['db']}",
        "stream": stream_name, "format": "{}", "follow": str(blue), "owncheckpoint": str(own),
        "handoverfile": str(handover), "pacems": "100",
    })  # fmt: skip
    reader.following.follower.RUNNING_WAIT_SECONDS = 0.2  # type: ignore[union-attr]
    start = {"id": ids[1], "n": 2}
    assert reader.latestOffset(start, ReadAllAvailable()) == start, "blue runs batch 1 and has not committed it"
    handover.write_text("{}")
    assert reader.latestOffset(start, ReadAllAvailable()) == {"id": ids[3], "n": 4}, "blue's batch in flight"
    offsets_file(own, 1, ids[3], 4)
    assert reader.latestOffset({"id": ids[3], "n": 4}, ReadAllAvailable()) == {"id": ids[5], "n": 6}, (
        "past the job's last batch: the stream's head"
    )


def test_the_file_sinks_fence_refuses_an_older_token_and_lets_one_writer_in_at_a_time(tmp_path):
    log = FileLog(tmp_path / "lake")
    with log.fenced("orders", 7):
        pass
    with pytest.raises(Fenced, match="token 6 is stale"), log.fenced("orders", 6):
        pass
    with log.fenced("other-job", 1):  # each job's fence is its own
        pass
    inside: list[str] = []

    def second() -> None:
        with log.fenced("orders", 8):
            inside.append("second")

    with log.fenced("orders", 7):
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)
        assert inside == [], "the newer writer waits for the batch being written"
    thread.join(5)
    assert inside == ["second"]
    with pytest.raises(Fenced), log.fenced("orders", 7):
        pass


@pytest.mark.django_db
def test_greens_rows_are_compared_with_what_the_job_wrote_for_the_same_batch(make_job):
    job = make_job(name="orders")
    ResultRow.objects.create(job=job, kind="spend", key="a", value={"total": 1}, batch_id=5)
    ResultRow.objects.create(job=job, kind="spend", key="b", value={"total": 9}, batch_id=6)  # b changed again at 6
    ResultUndo.objects.create(job=job, batch_id=6, kind="spend", key="b", value={"total": 2}, prior_batch=5)
    ResultRow.objects.create(job=job, kind="spend", key="c", value={"total": 3}, batch_id=4)
    blue = blue_output(job.id, 5)
    assert blue == {("spend", "a"): {"total": 1}, ("spend", "b"): {"total": 2}}, "b as batch 5 left it"
    found = diff(blue, {("spend", "a"): {"total": 1}, ("spend", "b"): {"total": 3}, ("spend", "d"): {"total": 4}})
    assert (found["added"], found["removed"], found["changed"], found["same"]) == (1, 0, 1, 1)
    assert {s["key"]: s["change"] for s in found["samples"]} == {"b": "changed", "d": "added"}
    assert diff(blue, {})["removed"] == 2


@pytest.mark.django_db
def test_green_wakes_the_upgrade_as_it_commits_the_jobs_batch_before_its_newest(
    make_job, redis, tmp_path, django_capture_on_commit_callbacks
):
    """Green whose batches take as long as the job's interval stays a batch behind; it commits the job's batch before
    the newest only for a moment each batch, shorter than a wait's wake-up. Green's driver sends the upgrade's visit
    as it commits, so the handover sees that moment, rather than waiting out its exact wait and handing over with
    green a batch further back (a batch more of output gap)."""
    job = make_job(name="orders")
    blue, green = job.directory / job.checkpoint_dir, job.directory / "checkpoint-green-1"
    for batch in range(8):
        commit_file(blue, batch)
    for batch in range(6):
        commit_file(green, batch)
    action = Action.objects.create(job=job, kind=ActionKind.BLUE_GREEN, status=ActionStatus.RUNNING,
                                   params={"fork": "checkpoint-green-1"}, wake_at=timezone.now() + timedelta(minutes=1))  # fmt: skip
    assert green_committed_lag(action) == 2, "green is two batches behind"
    recorder = GreenRecorder(job_id=job.id, run_id=0, checkpoint=green, journal=tmp_path / "journal",
                             redis_url=settings.REDIS_URL, stream="unused")  # fmt: skip
    recorder.green_setup(action.id, SimpleNamespace(after=None, live=threading.Event()))  # type: ignore[arg-type]
    with django_capture_on_commit_callbacks(execute=True):
        recorder.on_progress({"batchId": 6, "durationMs": {"triggerExecution": 5}, "numInputRows": 0})
    assert visits_sent(redis, action.id) == 0, "an idle trigger commits nothing"

    commit_file(green, 6)
    with django_capture_on_commit_callbacks(execute=True):
        recorder.on_progress({"batchId": 6, "durationMs": {"addBatch": 3, "triggerExecution": 5}, "numInputRows": 9})
    assert visits_sent(redis, action.id) == 1, "green's commit sends the upgrade's visit at once"
    assert green_committed_lag(action) == 1, "and that visit finds green ready to take over"
    action.params["shift"] = 1  # a rescale: green's batch n is the job's n - 1
    assert green_committed_lag(action) == 2


@pytest.mark.django_db
def test_green_takes_over_before_the_jobs_newest_batch_unless_its_writer_began_that_batch_as_a_shadow(make_job):
    """The handover comes after the job's batch before its newest, so that green's batch of the newest number is the
    first it writes to the job's sinks (it replaces the job's output of it): a batch sooner than after the newest. A
    batch green's writer has begun as a shadow already is not written again: the handover then comes after it."""
    job = make_job(name="orders")
    run = Run.objects.create(job=job, status=RunStatus.GREEN, green={"action": 1})
    state = GreenState(run.id)
    assert state.decide(7) == (RunStatus.GREEN, 0, None), "a shadow before the handover"
    assert Run.objects.get(id=run.id).green == {"action": 1, "shadowing": 7}, "recorded under the run's lock"
    assert handover_point(8, 7) == 7, "the job is at 8, green has not begun its 8: green's 8 replaces the job's"
    assert handover_point(8, 6) == 7, "green further back: still after 7, green's 7 and 8 are the job's"
    state.decide(8)
    assert handover_point(8, Run.objects.get(id=run.id).green["shadowing"]) == 8, "8 begun as a shadow: after it"
    assert handover_point(8, 8, shift=1) == 7, "a rescale: green's 8 is the job's 7"
    assert handover_point(8, None) == 8, "no record (a green of an earlier release): after the newest, as before"

    Run.objects.filter(id=run.id).update(status=RunStatus.RUNNING, fencing_token=5,
                                         green={"action": 1, "shadowing": 8, "handover": 8})  # fmt: skip
    assert state.decide(9) == (RunStatus.RUNNING, 5, 8), "the job's batch, written with the handover's token"
    assert state.decide(8) == (RunStatus.RUNNING, 5, 8), "a replay of 8 after a restart: the writer shadows it"
    assert Run.objects.get(id=run.id).green["shadowing"] == 8, "nothing recorded for the job's batches"


@pytest.mark.django_db(transaction=True)
def test_greens_driver_of_its_own_starts_before_the_savepoint_and_green_forks_the_jobs_newest_batch(
    make_job, monkeypatch
):
    """A driver of its own takes a JVM's start (30-40 s on a busy host): started after the fork, green began that far
    behind the job and caught up only as fast as its batches were shorter than the interval (989 s once). Its driver
    now starts first and waits with its Spark up; the savepoint it forks from is then of the job's newest batch, and
    the same driver runs green on it."""
    job = make_job(name="own", driver="own", pipeline="user-sessions", state_backend="rocksdb")
    blue = job.directory / job.checkpoint_dir
    for batch in range(4):
        commit_file(blue, batch)
    spawned: list[int] = []
    monkeypatch.setattr(blue_green, "spawn_driver", lambda run: spawned.append(run.id) or os.getpid())  # alive
    plan = {"target": "user-sessions", "batch": 3, "verdicts": [], "incompatible": False, "summary": "fine"}
    action = Action.objects.create(
        job=job, kind=ActionKind.BLUE_GREEN, status=ActionStatus.RUNNING, step="boot",
        params={"pipeline": "user-sessions", "parameters": {"x": 1}, "plan": plan, "bg_batch": 3},
        phases=[{"step": "boot", "label": "start green's driver of its own", "started": timezone.now().isoformat()}],
    )  # fmt: skip
    assert blue_green._boot(action) == Next("booted")
    run = blue_green.green_run(action)
    assert run is not None and run.green["boot"] is True and spawned == [run.id], "its driver started, no fork yet"
    assert isinstance(blue_green._booted(action), Wait), "the savepoint waits for green's Spark"

    told: list[bool] = []
    driver = threading.Thread(target=lambda: told.append(wait_for_fork(run.id, job.id)))
    driver.start()
    for batch in (4, 5):
        commit_file(blue, batch)  # the job ran on meanwhile
    wait_for(lambda: Run.objects.get(id=run.id).green.get("up"), 10, 0.05, "green's driver to say it is up")
    assert blue_green._booted(action) == Next("savepoint")
    assert action.params["bg_batch"] == 5, "the savepoint, and so green's fork, is of the job's newest batch"

    blue_green.remember(action, fork=blue_green.fork_name(action, "green"), follow=str(blue))  # its fork (not run here)
    assert blue_green._green_start(action) == Next("follow")
    driver.join(10)
    assert told == [True] and spawned == [run.id], "the same driver runs green: no second start"
    green = Run.objects.get(id=run.id).green
    assert green["go"] and green["fork"] == blue_green.fork_name(action, "green") and green["parameters"] == {"x": 1}

    # aborted while its driver waits: the driver ends without running anything
    Run.objects.filter(id=run.id).update(green={**green, "go": None})
    waiting = threading.Thread(target=lambda: told.append(wait_for_fork(run.id, job.id)))
    waiting.start()
    wait_for(lambda: waiting.is_alive(), 5, 0.05)
    Run.objects.filter(id=run.id).update(status=RunStatus.STOPPED)
    waiting.join(10)
    assert told == [True, False]


def test_the_console_and_greens_driver_write_the_handover_file_at_once_without_failing(tmp_path):
    """Both write it as the handover comes (the console's step, green's driver as it goes live): each through a
    temporary file of its own, where one name for both made one writer's rename fail, and with it the upgrade's step
    after the handover (seen on the demo stack)."""
    fork = tmp_path / "job" / "checkpoint-green-4"
    fork.mkdir(parents=True)
    errors: list[BaseException] = []

    def write(batch: int) -> None:
        try:
            for _ in range(200):
                (fork.parent / f"{fork.name}.handover").unlink(missing_ok=True)
                mark_handed_over(fork, batch)
        except BaseException as exc:  # noqa: BLE001 - what the test is about
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(7,)) for _ in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert errors == [] and handed_over_after(fork) == 7
    assert sorted(p.name for p in fork.parent.iterdir()) == [fork.name, f"{fork.name}.handover"], "no temporary file"


def test_the_promotion_rules():
    rules = action_rules({"no_removed": 1, "max_changed_percent": 10})
    assert rules == {"no_removed": True, "max_changed_share": 0.1}
    assert rules_problems(rules, {"added": 0, "removed": 0, "changed": 1, "same": 99}) == []
    assert rules_problems(rules, {"added": 0, "removed": 2, "changed": 20, "same": 78}) == [
        "2 row(s) blue wrote are missing from green's output", "20 of 100 rows changed, more than 10%",
    ]  # fmt: skip
    assert rules_problems(action_rules({}), {"removed": 5, "changed": 5, "same": 0}) == []


@pytest.mark.django_db
def test_the_api_and_the_page_drive_a_blue_green_upgrade(client, token, make_job, as_role):  # noqa: F811
    job = make_job(name="orders", pipeline="url-counts")
    operator, viewer = token("operator"), token("viewer", "watcher")
    bad = call(client, "POST", "/api/v1/jobs/orders/blue-green", operator, {"pipeline": "url-counts",
                                                                             "max_changed_percent": 150})  # fmt: skip
    assert bad.status_code == 400 and "max_changed_percent" in bad.json()["error"]
    assert call(client, "POST", "/api/v1/jobs/orders/blue-green", viewer, {"pipeline": "x"}).status_code == 403
    assert call(client, "GET", "/api/v1/jobs/orders/blue-green/state", viewer).status_code == 404
    assert call(client, "POST", "/api/v1/jobs/orders/blue-green/promote", operator).status_code == 404

    action = Action.objects.create(job=job, kind=ActionKind.BLUE_GREEN, status=ActionStatus.RUNNING,
                                   params={"pipeline": "url-counts", "plan": {"target": "url-counts"}, "auto": 1,
                                           "no_removed": 1, "bg_batch": 3})  # fmt: skip
    early = call(client, "POST", "/api/v1/jobs/orders/blue-green/promote", operator)
    assert early.status_code == 200 and early.json()["green_up"] is False, "no green yet: kept for when it is up"
    assert "promote" in Action.objects.get(id=action.id).asked
    blue = Run.objects.create(job=job, status=RunStatus.RUNNING)
    green = Run.objects.create(job=job, status=RunStatus.GREEN, green={"action": action.id})
    action.params["green_run"] = green.id
    Action.objects.filter(id=action.id).update(params=action.params)
    GreenBatch.objects.create(action=action, batch_id=4, input_rows=10, output_rows=3, same=2, changed=1,
                              samples=[{"change": "changed", "kind": "url", "key": "/a", "before": 1, "after": 2}])  # fmt: skip
    state = call(client, "GET", "/api/v1/jobs/orders/blue-green/state", viewer).json()
    assert state["green_batch"] == 4 and state["totals"]["changed"] == 1 and state["rules"] == {"no_removed": True}
    assert call(client, "POST", "/api/v1/jobs/orders/blue-green/promote", viewer).status_code == 403
    answer = call(client, "POST", "/api/v1/jobs/orders/blue-green/abort", operator)
    assert answer.status_code == 200 and answer.json()["green_up"] is True
    assert blue_green.asked(action, green) == {"abort", "promote"}

    page = as_role("operator").get("/jobs/orders/deploys").content.decode()
    assert 'value="blue-green"' in page and 'id="blue-green"' in page
    # the job's own run heads its page, its row and its API record, with its Stop, not green beside it
    assert 'id="run-status" data-rendered="running"' in page and ">Stop</button>" in page
    assert call(client, "GET", "/api/v1/jobs/orders", viewer).json()["status"] == "running"
    assert call(client, "GET", "/api/v1/jobs/orders", viewer).json()["driver"]["run"] == blue.id
    assert job_lag_status(job)["run"]["status"] == "running", "and the header's live push says so too"
    assert 'data-green-diff="0/0/1/2"' in page and "Promote (hand over)" in page and "/a" in page
    panel = as_role("viewer", "v2").get("/jobs/orders/blue-green").content.decode()
    assert 'data-green-diff="0/0/1/2"' in panel and "Promote (hand over)" not in panel, "a viewer sees, cannot act"
    assert json.loads(json.dumps(green_view(action)))["green_batch"] == 4, "the view is plain JSON"


@pytest.mark.django_db
def test_the_page_and_the_api_say_when_green_cannot_gain_on_the_job(client, token, make_job, as_role):  # noqa: F811
    """Green's gain on blue is measured a minute at a time: a minute in which it fell further behind is said on the
    page beside Abort, with the numbers, and in the API; a minute in which it gained says how long it has to go."""
    job = make_job(name="orders", pipeline="url-counts")
    action = Action.objects.create(job=job, kind=ActionKind.BLUE_GREEN, status=ActionStatus.RUNNING,
                                   params={"pipeline": "url-counts", "plan": {"target": "url-counts"}})  # fmt: skip
    Run.objects.create(job=job, status=RunStatus.RUNNING)
    green = Run.objects.create(job=job, status=RunStatus.GREEN, green={"action": action.id})
    blue_green.remember(action, green_run=green.id, bg_batch=3)
    operator = as_role("operator")
    assert blue_green._gain(action, 12) is None, "the first visit opens the window: nothing to say yet"
    assert "cannot gain" not in operator.get("/jobs/orders/deploys").content.decode()
    a_minute_ago = (timezone.now() - timedelta(seconds=61)).isoformat()
    blue_green.memo_save(action, gain_from={"at": a_minute_ago, "behind": 12})
    seen = blue_green._gain(action, 42)
    assert seen is not None and (seen["gaining"], seen["gained"], seen["without_gain"]) == (False, -30, 1)
    page = operator.get("/jobs/orders/deploys").content.decode()
    assert (
        'data-green-gaining="no"' in page
        and "Green cannot gain on blue: 12 → 42 batches behind over the last 61 s" in page
    )
    assert "Abort</button>" in page
    state = call(client, "GET", "/api/v1/jobs/orders/blue-green/state", token("viewer", "watcher")).json()
    assert state["catch_up"]["behind"] == 42 and state["catch_up"]["gaining"] is False
    blue_green.memo_save(action, gain_from={"at": a_minute_ago, "behind": 42})
    seen = blue_green._gain(action, 12)
    assert seen is not None and seen["gaining"] and seen["without_gain"] == 0 and seen["to_go_seconds"] == 22
    page = operator.get("/jobs/orders/deploys").content.decode()
    assert 'data-green-gaining="yes"' in page and "Green gains on blue: 30 batches in 61 s, about 22 s to go" in page
    Action.objects.filter(id=action.id).update(status=ActionStatus.ABORTED)
    page = operator.get("/jobs/orders/deploys").content.decode()
    assert "data-green-gaining" not in page and " behind" not in page.split("data-green-behind")[1][:400], (
        "an aborted upgrade says nothing of a gain or of how far behind green was"
    )


@pytest.mark.django_db
def test_a_blue_green_rescale_from_the_rescale_page_the_api_and_a_spec(client, token, make_job, as_role):  # noqa: F811
    from dashboard.services.blue_green import BLUE_GREEN_STEPS
    from dashboard.services.errors import ActionFailed
    from dashboard.specs import plan

    def with_state(job):
        (job.checkpoint_location / "commits").mkdir(parents=True, exist_ok=True)
        (job.checkpoint_location / "commits" / "0").write_text('v1\n{"nextBatchWatermarkMs":0}\n')
        return job

    job = with_state(make_job(name="orders", pipeline="user-sessions", state_backend="rocksdb", state_partitions=2,
                              applied_spec={"name": "orders"}))  # fmt: skip
    operator = token("operator")
    page = as_role("operator")
    form = {"parallelism": job.parallelism, "state_partitions": 4, "how": "blue-green"}
    refused = page.post("/jobs/orders/rescale", form).content.decode()
    assert "orders is not running: blue/green runs the new scale beside it" in refused
    Run.objects.create(job=job, status=RunStatus.RUNNING)
    cores = page.post("/jobs/orders/rescale", form | {"parallelism": job.parallelism + 1}).content.decode()
    assert "the cores change by a restart" in cores and not Action.objects.filter(job=job).exists()

    nothing = call(client, "POST", "/api/v1/jobs/orders/blue-green", operator, {})
    assert nothing.status_code == 400 and "Give what changes" in nothing.json()["error"]
    asked = call(client, "POST", "/api/v1/jobs/orders/blue-green", operator, {"state_partitions": 4})
    assert asked.status_code == 202, asked.content
    action = Action.objects.get(id=asked.json()["action"]["id"])
    assert (action.params["pipeline"], action.params["state_partitions"]) == ("user-sessions", 4)
    what = BLUE_GREEN_STEPS["what"][1]
    assert what(action).step == "gate", "a rescale alone needs no preview: its state is the job's, repartitioned"
    assert "repartitioned 2 → 4" in action.params["plan"]["summary"] and not action.params["plan"]["incompatible"]
    Action.objects.filter(id=action.id).delete()

    assert page.post("/jobs/orders/rescale", form).status_code == 302
    action = Action.objects.get(job=job)
    assert action.kind == ActionKind.BLUE_GREEN and action.params["state_partitions"] == 4 and action.params["auto"]
    Action.objects.filter(id=action.id).delete()

    [found] = plan([{"name": "orders", "state_partitions": 4, "upgrade_mode": "blue-green"}])
    assert [(s.action, s.params) for s in found.steps] == [("blue-green", {"state_partitions": 4, "auto": 1})]
    [both] = plan(
        [{"name": "orders", "state_partitions": 4, "upgrade_mode": "blue-green", "pipeline": "user-sessions-v2"}]
    )
    assert [(s.action, s.params["state_partitions"]) for s in both.steps] == [("blue-green", 4)], "one does both"

    memory = with_state(make_job(name="mem", pipeline="url-counts", state_backend="memory", state_partitions=2))
    action = Action.objects.create(job=memory, kind=ActionKind.BLUE_GREEN, params={"state_partitions": 4})
    with pytest.raises(ActionFailed, match="memory-backend job cannot change"):
        what(action)


@pytest.mark.django_db
def test_greens_order_is_checked_when_written_and_read_and_reports_never_overwrite_each_other(make_job):
    from dashboard.green_order import GreenOrder, OrderError, order_write, report

    job = make_job(name="orders", pipeline="url-counts", state_partitions=2)
    order = GreenOrder(action=7, fork="green-7", follow="/x/checkpoint", pipeline="url-counts-v2",
                       parameters={"top": 3}, partitions=4, shift=1)  # fmt: skip
    green = order.applied_to(job)
    assert (green.pipeline, green.parameters, green.checkpoint_dir, green.state_partitions) == (
        "url-counts-v2", {"top": 3}, "green-7", 4)  # fmt: skip
    assert (job.pipeline, job.checkpoint_dir, job.state_partitions) == ("url-counts", "checkpoint", 2), "a copy"
    with pytest.raises(OrderError, match="partitions holds str"):
        GreenOrder(**(order.as_json() | {"partitions": "4"}))
    with pytest.raises(OrderError, match="version 2"):
        GreenOrder.read(order.as_json() | {"version": 2})
    with pytest.raises(OrderError, match="does not know: fork_dir"):
        GreenOrder.read(order.as_json() | {"fork_dir": "x"})
    with pytest.raises(OrderError, match="incomplete"):
        GreenOrder.read({k: v for k, v in order.as_json().items() if k != "follow"})

    run = Run.objects.create(job=job, status=RunStatus.GREEN, green=order.as_json())
    stale = Run.objects.get(id=run.id)
    report(run.id, shadowing=5)  # green's driver, while the console holds an older copy of the row
    order_write(stale, GreenOrder(**(order.as_json() | {"boot": True})), go="now")
    kept = Run.objects.get(id=run.id).green
    assert kept["shadowing"] == 5 and kept["go"] == "now" and GreenOrder.read(kept).boot
    with pytest.raises(OrderError, match="not a report"):
        report(run.id, handed=1)
    with pytest.raises(OrderError, match="holds str"):
        report(run.id, shadowing="5")
