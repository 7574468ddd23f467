"""The warm state reader: Spark's state reads (verification, inspector pages) answered by one long-lived JVM, which
still catches a damaged copy and is replaced when it dies."""

from __future__ import annotations

import os
import signal
import time

import pytest
from django.conf import settings
from django.utils import timezone

from dashboard.checkpoint_dir.files import committed_batches, copy_checkpoint
from dashboard.models import Action, ActionKind, ActionStatus
from dashboard.services.errors import ActionFailed
from dashboard.services.runs import pid_alive
from dashboard.services.state_reader_client import (
    _ask,
    _state_tool_process,
    run_state_tool,
    state_read,
    state_reader_pid,
    state_reader_stop,
    state_reader_warm,
    state_reader_warmed,
)
from tests.conftest import run_through, send_events, wait_for
from tests.support import visits_sent

pytestmark = [pytest.mark.spark, pytest.mark.django_db(transaction=True)]


def test_the_warm_reader_answers_as_a_new_process_would_and_still_catches_a_damaged_copy(
    make_job, start_driver, redis, stream_name, tmp_path
):
    job = make_job(max_records_per_batch=300)
    run_through(start_driver(job), redis, send_events(redis, stream_name, "url-counts", 600))
    batch = committed_batches(job.checkpoint_location)[-1]
    good, damaged = tmp_path / "good", tmp_path / "damaged"
    copy_checkpoint(job.checkpoint_location, good, batch)
    copy_checkpoint(job.checkpoint_location, damaged, batch)
    victim = next(p for p in (damaged / "state").rglob("*.delta") if p.stat().st_size)
    victim.write_bytes(b"\0" * victim.stat().st_size)

    state_reader_stop()
    wait_for(lambda: state_reader_pid() is None, 30, what="no state reader")
    first = run_state_tool("verify", good, batch)  # starts the reader
    pid = state_reader_pid()
    assert pid and pid_alive(pid)
    assert first["operators"][0]["rows"]["default"] == 8, "8 URLs in the state"
    assert _state_tool_process("verify", good, batch, 300, None) == first, "the same answer as a JVM of its own"

    # the damaged copy fails in the warm reader as it would in a new process, and the reader lives on
    with pytest.raises(ActionFailed, match="Spark could not read the state"):
        run_state_tool("verify", damaged, batch)
    assert "error" in _state_tool_process("verify", damaged, batch, 300, None)
    page = run_state_tool("inspect", good, batch, spec={"mode": "lookup", "operator": 0, "text": "/login"})
    assert page["total"] == 1 and '"/login"' in page["rows"][0]["key"]
    assert state_reader_pid() == pid, "one reader answered every read"
    wait_for(state_reader_warmed, 180, 0.5, "the reader's warm-up beside those reads to end")
    warmed = (settings.LOG_ROOT / "state-reader.log").read_text()
    assert "state reader warm after" in warmed and "warm-up failed" not in warmed
    assert not redis.keys("statekeeper:warmup:*"), "its warm-up's scratch stream (a batch read from Redis) is gone"

    # a shadow run's longer query is not the reader's: refused by the reader itself
    refused = _ask(settings.STATE_READER_SOCKET, {"command": "shadow", "path": str(good), "number": 4}, 60)
    assert "does not answer 'shadow'" in refused["error"]

    # a reader killed between reads is replaced by the next read
    os.killpg(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), 30, what="the reader to die")
    assert run_state_tool("verify", good, batch) == first
    log = settings.LOG_ROOT / "state-reader.log"
    # (when the killed reader's socket reset the request, that read was done in a process of its own and the new
    # reader is still starting: it takes the lock within seconds)
    replaced = wait_for(lambda: (new := state_reader_pid()) != pid and new, 60, 0.5, "a new reader to hold the lock")
    assert replaced and pid_alive(replaced), log.read_text()[-3000:] if log.exists() else "no reader log"


def test_an_action_step_asks_the_reader_without_holding_its_worker_and_outlives_a_reader_killed_with_its_request(
    make_job, start_driver, redis, stream_name, tmp_path
):
    job = make_job(max_records_per_batch=300)
    run_through(start_driver(job), redis, send_events(redis, stream_name, "url-counts", 600))
    batch = committed_batches(job.checkpoint_location)[-1]
    good = tmp_path / "good"
    copy_checkpoint(job.checkpoint_location, good, batch)
    state_reader_stop()
    wait_for(lambda: state_reader_pid() is None, 30, what="no state reader")

    action = Action.objects.create(job=job, kind=ActionKind.COUNT_PARTITION_ROWS, status=ActionStatus.RUNNING,
                                   step="run", phases=[{"step": "run", "started": timezone.now().isoformat()}])  # fmt: skip
    began = time.monotonic()
    assert state_read(action, "rows", "partition-rows", good, batch) is None, "asked, not waited for"
    assert time.monotonic() - began < 3, "the visit returns while a reader starts and reads"
    # the reader is killed with the request in hand: the step's next visit hands it back to a new reader
    pid = wait_for(state_reader_pid, 60, 0.2, "the reader to start")
    spool = settings.STATE_READER_SOCKET.with_suffix(".spool")
    (spool / f"action-{action.id}-rows.request").rename(spool / f"action-{action.id}-rows.taken")
    os.killpg(pid, signal.SIGKILL)
    wait_for(lambda: state_reader_pid() is None, 30, what="the reader to die")
    remade = []
    assert state_read(action, "rows", "partition-rows", good, batch, fresh_copy=lambda: remade.append(1)) is None
    assert action.memo["rows"]["restarts"] == 1
    assert remade == [1], "the copy it may have written into is made again before a new reader reads it"
    answer = wait_for(lambda: state_read(action, "rows", "partition-rows", good, batch), 240, 0.5, "the answer")
    assert sum(answer["operators"][0]["rows"].values()) == 8, "8 URLs in the state, over its partitions"
    assert state_reader_pid() not in (None, pid), "a new reader answered"
    assert not list(spool.glob(f"action-{action.id}-*")), "the request and its answer are gone once read"
    # the answer sends the action's visit: its step reads it then, not at Celery beat's next round
    wait_for(lambda: visits_sent(redis, action.id) == 1, 10, 0.1, "the reader to send the action's visit")

    # a reader that cannot read it says why, and the step fails with that reason
    Action.objects.filter(id=action.id).update(status=ActionStatus.SUCCEEDED)
    other = Action.objects.create(job=job, kind=ActionKind.COUNT_PARTITION_ROWS, status=ActionStatus.RUNNING,
                                  step="run", phases=[{"step": "run", "started": timezone.now().isoformat()}])  # fmt: skip
    assert state_read(other, "rows", "partition-rows", tmp_path / "nothing-here", batch) is None
    with pytest.raises(ActionFailed, match="Spark could not partition-rows the state"):
        wait_for(lambda: state_read(other, "rows", "partition-rows", tmp_path / "nothing-here", batch), 120, 0.5)


def test_the_spool_answers_a_verification_before_repartitions_asked_earlier_each_kind_oldest_first(tmp_path):
    """Five actions at once on the demo stack: a savepoint's verification waited behind two other jobs' repartitions
    in the one reader. Waiting requests are answered short before long, each kind in the order asked."""
    import json

    from workers.spark.state_reader import serve_spool

    spool = tmp_path / "reader.spool"
    spool.mkdir()
    asked = [("a", "repartition"), ("b", "plan"), ("c", "verify"), ("d", "repartition"), ("e", "inspect")]
    for n, (name, command) in enumerate(asked):
        request = spool / f"{name}.request"
        request.write_text(json.dumps({"command": command, "path": "/nowhere", "number": 1}))
        os.utime(request, (1_000_000 + n, 1_000_000 + n))
    (spool / "f.request").write_text("{not json")  # answered with its error, not left behind the long ones
    os.utime(spool / "f.request", (1_000_010, 1_000_010))
    answered: list[str] = []

    def read(request: dict, on_verdict=None) -> dict:
        answered.append(request["command"])
        return {"ok": True}

    while serve_spool(spool, read):
        pass
    assert answered == ["verify", "inspect", "repartition", "plan", "repartition"]
    assert json.loads((spool / "f.answer").read_text())["error"].startswith("the request could not be read")
    assert sorted(p.name for p in spool.iterdir()) == [f"{n}.answer" for n in "abcdef"]


def test_a_verification_asked_while_a_repartition_is_read_is_answered_before_it_ends(tmp_path):
    """Five actions at once on the demo stack: a savepoint's verification (0.75 s alone) waited 5-6 s behind the
    upgrades' re-runs being read. The reader answers long requests in a lane of their own, the short ones beside."""
    import json
    import threading

    from workers.spark.state_reader import LONG, SHORT, serve_lane

    spool = tmp_path / "reader.spool"
    spool.mkdir()
    for n, (name, command) in enumerate([("a", "repartition"), ("b", "plan"), ("c", "verify")]):
        request = spool / f"{name}.request"
        request.write_text(json.dumps({"command": command, "path": "/nowhere", "number": 1}))
        os.utime(request, (1_000_000 + n, 1_000_000 + n))
    verified = threading.Event()
    answered: list[str] = []

    def read(request: dict, on_verdict=None) -> dict:
        if request["command"] == "verify":
            verified.set()
        else:  # a long one ends only once the verification has been answered, or fails the test after 30 s
            assert verified.wait(30), "the verification waited for the long request being read"
        answered.append(request["command"])
        return {"ok": True}

    closing = threading.Event()
    lanes = [threading.Thread(target=serve_lane, args=(spool, read, lane, closing)) for lane in (LONG, SHORT)]
    for lane in lanes:
        lane.start()
    wait_for(lambda: len(answered) == 3, 60, 0.05, "the three answers")
    closing.set()
    for lane in lanes:
        lane.join(5)
    assert answered == ["verify", "repartition", "plan"], "the long ones one at a time, oldest first"
    assert sorted(p.name for p in spool.iterdir()) == ["a.answer", "b.answer", "c.answer"]
    assert not any(lane.is_alive() for lane in lanes), "both lanes end when the reader closes"


HOLD_LOCK = """
import fcntl, os, sys, time
held = open(sys.argv[1], "a+")
fcntl.flock(held, fcntl.LOCK_EX)
held.seek(0); held.truncate(); held.write(str(os.getpid())); held.flush()
time.sleep(120)
"""


def test_stopping_the_reader_ends_a_reader_that_waits_for_its_lock_too(settings, tmp_path):
    """``state_reader_stop`` ended the reader that held the lock; one started at the same moment (two requests at once
    after a reader was killed each start one) waited for the lock, took it once the first had gone, and ran on: a
    stack's stop could leave a reader behind it."""
    import subprocess
    import sys

    from dashboard.services.processes import processes_running

    settings.STATE_READER_SOCKET = tmp_path / "reader.sock"  # not the suite's reader
    lock = settings.STATE_READER_SOCKET.with_suffix(".lock")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock)], start_new_session=True)
    wait_for(lambda: state_reader_pid() == holder.pid, 30, 0.05, "the lock to be held")
    waiting = subprocess.Popen(
        [sys.executable, "-m", "workers.spark.state_reader", str(settings.STATE_READER_SOCKET), "60"],
        cwd=settings.BASE_DIR, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for(lambda: waiting.pid in processes_running("workers.spark.state_reader", str(settings.STATE_READER_SOCKET)),
             10, 0.05, "the second reader")  # fmt: skip
    try:
        assert state_reader_stop() == holder.pid, "the one that held the lock is named"
        assert holder.wait(10) == -signal.SIGTERM
        assert waiting.wait(30) == -signal.SIGTERM, "the waiting one ends too, before it takes the lock"
        assert state_reader_pid() is None
    finally:
        for process in (holder, waiting):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


TIMED = "user_sessions.timed:SESSIONS_TIMED"


def test_the_reader_plans_each_pipeline_the_console_names_as_it_warms_up_and_says_how_each_went(
    settings, redis, monkeypatch
):
    """A pipeline's first plan in the reader's JVM costs seconds more than its next, and the demo stack's previews
    paid it: the reader plans each pipeline once as it warms up, through the console's own spawn. The timed pipeline
    runs batches without data (a processing-time clock): planned in the checkpoint its query ran in, it meets a batch
    left half-way; a preview's copy at the newest commit does not."""
    from dashboard.services import state_reader_client

    named = ["workers.spark.pipelines.url_counts:PIPELINE", TIMED, "no_such_package.pipelines:PIPELINE"]
    # a reader started beside the one a test before stopped may still be waiting for its lock (LOCK_WAIT): it takes
    # it over, and is stopped in turn
    wait_for(lambda: state_reader_stop() is None and state_reader_pid() is None, 90, 1, "no state reader")
    settings.STATE_READER_WARM_PIPELINES_SECONDS = 300
    monkeypatch.setattr(state_reader_client, "warm_pipelines_order", lambda: named)
    # another reader's on this host (the demo stack's, one killed mid warm-up) are not this one's to remove
    scratch = settings.STATE_READER_SOCKET.parent
    before = set(scratch.glob("warm-pipeline-*"))

    def all_told() -> dict[str, str] | None:
        try:
            told = _ask(settings.STATE_READER_SOCKET, {"command": "status"}, 5).get("pipelines", {})
        except OSError:
            return None
        return told if len(told) == len(named) else None

    try:
        state_reader_warm()
        told = wait_for(all_told, 300, 1, "the reader to plan the three pipelines")
    finally:
        state_reader_stop()
    assert told[named[0]].startswith("planned in"), told
    assert told[TIMED].startswith("planned in"), told
    assert told[named[2]].startswith("failed:") and "no_such_package" in told[named[2]], told
    log = (settings.LOG_ROOT / "state-reader.log").read_text()
    assert f"state reader warm-up of {TIMED}: planned in" in log
    assert not redis.keys("statekeeper:warmup:*"), "the scratch streams are gone"
    assert not set(scratch.glob("warm-pipeline-*")) - before, "and its scratch checkpoints"


def test_the_pipelines_warm_up_keeps_to_its_budget(monkeypatch, tmp_path):
    from workers.spark.state_reader import warm_pipelines

    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:6379/15")
    warmed: dict[str, str] = {}
    warm_pipelines(None, tmp_path, ["a.b:C", "d.e:F"], 1e-9, warmed)  # spent before the first: no Spark is touched
    assert warmed == dict.fromkeys(["a.b:C", "d.e:F"], "not planned: the warm-up's 1e-09 s were spent")


def test_a_new_reader_removes_the_warm_up_scratch_a_killed_reader_left_and_no_live_readers(tmp_path):
    """A reader stopped mid warm-up (Ctrl-C of the stack in its first minutes) left its scratch checkpoint in the host's
    reader directory for good; the directory is shared by the host's readers, so only a gone reader's may go."""
    import subprocess
    import sys
    from pathlib import Path

    from workers.spark.state_reader import scratch, sweep_scratch

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = tmp_path / f"warm-pipeline-{gone.pid}-k2x_9abc"
    (left / "checkpoint" / "commits").mkdir(parents=True)
    (left / "checkpoint" / "commits" / "0").write_text("v1")
    # killed, not yet reaped by the worker that started it (as the stack's reader was, found so): gone too
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    wait_for(lambda: Path(f"/proc/{zombie.pid}/stat").read_text().split(") ")[1].startswith("Z"), 30, 0.05, "a zombie")
    killed = scratch(tmp_path, "warm-up").rename(tmp_path / f"warm-up-{zombie.pid}-zz_1")
    mine = scratch(tmp_path, "warm-up")  # this process lives: a reader still warming up
    older = tmp_path / "warm-pipeline-abc123xy"  # before the pid was in the name: whose it is cannot be told
    older.mkdir()
    other = tmp_path / "spool"
    other.mkdir()

    assert sorted(sweep_scratch(tmp_path)) == sorted([left, killed])
    zombie.wait()
    assert not left.exists() and not killed.exists()
    assert mine.exists() and mine.name.startswith(f"warm-up-{os.getpid()}-")
    assert older.exists() and other.exists()


def test_a_new_fork_server_removes_the_directory_a_killed_one_left(tmp_path, monkeypatch):
    """A fork server killed with its starter's process group (a stack's stop) left an empty
    /tmp/statekeeper-fork-* directory for good, two a stop of the demo stack."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from workers.spark.fork_server import ForkServer

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = tmp_path / f"statekeeper-fork-{gone.pid}-ab_cd12x"
    left.mkdir()
    older = tmp_path / "statekeeper-fork-5gz2nil6"  # before the pid was in the name: left alone
    older.mkdir()
    server = ForkServer()
    beside = ForkServer()  # another server of a live starter: the first one's directory is not its to remove
    try:
        assert server.ready(30) and beside.ready(30), "the new servers listen"
        assert not left.exists()
        assert older.exists()
        assert Path(server.directory).name.startswith(f"statekeeper-fork-{os.getpid()}-")
    finally:
        server.close()
        beside.close()
    assert not Path(server.directory).exists() and not Path(beside.directory).exists()


def test_the_console_names_the_pipelines_beside_its_jobs_pipelines_first(make_job):
    from dashboard import pipelines
    from dashboard.services.state_reader_client import warm_pipelines_order

    make_job(pipeline="user-sessions-timed")
    order = warm_pipelines_order()
    assert sorted(order) == sorted(pipelines.registry().references.values()), "each registered pipeline once"
    beside = [r for r in order if r.startswith("user_sessions.timed:")]
    assert len(beside) >= 2 and order[: len(beside)] == beside, order
