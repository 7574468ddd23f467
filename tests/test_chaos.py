"""Exactly-once under kill -9: events flow while drivers (and once the Celery worker) are killed at random moments;
every restart is automatic, and at the end the sink equals the events sent. The short form runs by default; the long
form, with both backends and more kills, is selected with ``-m chaos``."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection

from dashboard.models import Action, ActionKind, Checkpoint, ResultRow, Run, RunStatus
from dashboard.services.actions import action_request
from dashboard.services.errors import ActionRefused
from dashboard.services.runs import job_request_start, job_request_stop
from tests.conftest import send_events, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


class Producer(threading.Thread):
    """Writes url-counts events at a steady rate until stopped; ``sent`` is exact."""

    def __init__(self, redis, stream: str, rate: int = 150) -> None:
        super().__init__(daemon=True)
        self.redis, self.stream, self.rate = redis, stream, rate
        self.sent, self.halt = 0, threading.Event()

    def run(self) -> None:
        seed = 0
        while not self.halt.wait(0.2):
            seed += 1
            self.sent += send_events(self.redis, self.stream, "url-counts", self.rate // 5, seed=seed)


def sink_total(job) -> int:
    return sum(row.value["requests"] for row in ResultRow.objects.filter(job=job, kind="url"))


def running_with_progress(job, after_run: int = 0) -> Run | None:
    run = job.runs.filter(status=RunStatus.RUNNING, id__gt=after_run).first()
    if run and Checkpoint.objects.filter(run=run).exists():
        return run
    return None


def chaos(job, redis, celery_worker, kills: int, kill_worker_at: int | None) -> None:
    rng = random.Random(kills)
    producer = Producer(redis, job.source_stream)
    producer.start()
    job_request_start(job=job)
    run = wait_for(lambda: running_with_progress(job), 120, 1, "the first run to commit")
    for kill in range(kills):
        time.sleep(rng.uniform(0.5, 4))  # a random moment: between batches or in the middle of one
        os.killpg(run.pid, signal.SIGKILL)
        if kill == kill_worker_at:  # the supervisor dies too; a new worker must pick up where it left
            celery_worker.kill()
            time.sleep(rng.uniform(1, 5))
            celery_worker.start()
        run = wait_for(lambda last=run.id: running_with_progress(job, last), 180, 1, f"recovery after kill {kill + 1}")
    producer.halt.set()
    producer.join()
    entries = producer.sent
    wait_for(
        lambda: (c := job.checkpoints.order_by("-committed_at").first()) and c.end_offset["n"] >= entries,
        180,
        1,
        "the job to catch up",
    )
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, 1, "the stop")
    assert sink_total(job) == producer.sent, "every event counted exactly once"
    assert job.recoveries.count() == kills
    assert all(r.restart_run_id for r in job.recoveries.all())


@pytest.mark.browser
def test_kill_minus_nine_twice_loses_and_duplicates_nothing(make_job, redis, stream_name, celery_worker):
    job = make_job(parallelism=1, trigger_interval_seconds=1, restart_strategy="fixed-delay", restart_delay_seconds=1)
    chaos(job, redis, celery_worker, kills=2, kill_worker_at=None)


@pytest.mark.chaos
@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_long_chaos_with_a_worker_kill(make_job, redis, stream_name, celery_worker, backend):
    job = make_job(
        parallelism=1,
        trigger_interval_seconds=1,
        state_backend=backend,
        restart_strategy="fixed-delay",
        restart_delay_seconds=1,
        failure_rate_max=20,
    )
    chaos(job, redis, celery_worker, kills=6, kill_worker_at=2)


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
