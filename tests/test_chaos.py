"""Exactly-once under kill -9: events flow while drivers (and once the Celery worker) are killed at random moments;
every restart is automatic, and at the end the sink equals the events sent. The short form (two kills) runs by
default; the long form, with both backends, more kills, a pause past the lease and a worker kill, is selected with
``-m chaos``."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from dashboard.models import Action, ActionKind, Run, RunStatus
from dashboard.services.actions import action_request
from dashboard.services.errors import ActionRefused
from dashboard.services.runs import job_request_start, pid_alive
from tests.conftest import wait_for
from tests.support import POISON, Producer, drain_and_stop, running_with_progress, sink_total

pytestmark = pytest.mark.django_db(transaction=True)


# What a broken or hostile producer writes among the access-log lines, one of every class: each must go to the dead
# letter with its reason and stop nothing (a regex source sees JSON's classes as lines that do not match).


def pause_past_lease(job, run: Run) -> Run:
    """SIGSTOP a driver until a successor commits, then wake it: it must be gone within 10 s, having written nothing."""
    os.killpg(run.pid, signal.SIGSTOP)
    successor = wait_for(lambda: running_with_progress(job, run.id), 180, 0.5, "a successor to the paused driver")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(run.pid, signal.SIGCONT)
    wait_for(lambda: not pid_alive(run.pid), 10, 0.2, "the paused driver's process to be gone")
    return successor


def chaos(job, redis, celery_worker, kills: int, kill_worker_at: int | None, pause_at: int | None = None) -> None:
    """Events and poison flow while drivers are killed (and once paused past their lease) at random moments. The sink
    must equal the good events, every poison entry must be in the dead letter with its reason, and no run may end
    other than by the test's own hand: the job is never down for longer than a restart."""
    rng = random.Random(kills)
    producer = Producer(redis, job.source_stream, poison_every=3)
    producer.start()
    job_request_start(job=job)
    run = wait_for(lambda: running_with_progress(job), 120, 0.5, "the first run to commit")
    interrupted: list[int] = []
    for kill in range(kills):
        time.sleep(rng.uniform(0.5, 4))  # a random moment: between batches or in the middle of one
        interrupted.append(run.id)
        if kill == pause_at:
            run = pause_past_lease(job, run)
            continue
        os.killpg(run.pid, signal.SIGKILL)
        if kill == kill_worker_at:  # the supervisor dies too; a new worker must pick up where it left
            celery_worker.kill()
            time.sleep(rng.uniform(1, 5))
            celery_worker.start()
        run = wait_for(
            lambda last=run.id: running_with_progress(job, last), 180, 0.5, f"recovery after kill {kill + 1}"
        )
    drain_and_stop(job, producer, redis)
    assert sink_total(job) == producer.sent, "every good event counted exactly once"
    dead = {f[b"entry"].decode(): f for _, f in redis.xrange(job.dead_letter_stream)}
    assert set(dead) == set(producer.poison) and len(producer.poison) >= len(POISON), "every poison entry, once"
    assert all(f[b"stage"] in (b"decode", b"parse", b"validate") and f[b"reason"] for f in dead.values())
    ended = {r.id: r.status for r in job.runs.all()}
    assert {ended[i] for i in interrupted} == {RunStatus.LOST}, "only the runs the test killed or paused were lost"
    others = {status for i, status in ended.items() if i not in interrupted}
    assert others == {RunStatus.STOPPED}, "no run failed: no entry stopped the job"
    assert job.recoveries.count() == kills
    assert all(r.restart_run_id for r in job.recoveries.all())


@pytest.mark.chaos
def test_two_kill_minus_nines_and_poison_lose_and_duplicate_nothing(make_job, redis, stream_name, celery_worker):
    # the default suite has a driver paused past its lease (test_fenced_driver.py), a driver killed (test_cluster.py's
    # shared jobs, test_console_e2e.py) and poison among good events (test_poison_events.py), each on its own
    job = make_job(parallelism=1, trigger_interval_seconds=1, restart_strategy="fixed-delay", restart_delay_seconds=1)
    chaos(job, redis, celery_worker, kills=2, kill_worker_at=None)


@pytest.mark.chaos
@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_long_chaos_with_a_worker_kill(make_job, redis, stream_name, celery_worker, backend):
    job = make_job(
        parallelism=1,
        trigger_interval_seconds=1,
        state_backend=backend,
        standby=backend == "rocksdb",  # one run with warm standbys taking over, one with cold restarts
        restart_strategy="fixed-delay",
        restart_delay_seconds=1,
        failure_rate_max=20,
    )
    chaos(job, redis, celery_worker, kills=6, kill_worker_at=2, pause_at=4)


def test_many_concurrent_restore_requests_start_exactly_one_action_and_one_driver(make_job):
    job = make_job()

    def request(_: int) -> str:
        try:
            return f"action {action_request(job=job, kind=ActionKind.RESTORE, params={'savepoint': 1}).id}"
        except ActionRefused:
            return "refused"
        finally:
            connection.close()

    def start(_: int) -> str:
        try:
            return f"run {job_request_start(job=job).id}"
        except ActionRefused:
            return "refused"
        finally:
            connection.close()

    with ThreadPoolExecutor(10) as pool:
        actions = list(pool.map(request, range(10)))
        runs = list(pool.map(start, range(10)))
    assert sum(a != "refused" for a in actions) == 1 and Action.objects.filter(job=job).count() == 1
    assert sum(r != "refused" for r in runs) == 1 and Run.objects.filter(job=job).count() == 1
