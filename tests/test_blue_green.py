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

from dashboard.models import Action, ActionKind, ActionStatus, Checkpoint, GreenBatch, Job, Run, RunStatus
from dashboard.services.actions import action_request
from dashboard.services.blue_green import green_request, green_view
from dashboard.services.runs import job_request_start
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


def handed_over(action: Action, timeout: float) -> None:
    """Until the upgrade has handed over to green; the action's state in the failure otherwise."""
    try:
        wait_for(lambda: Action.objects.get(id=action.id).params.get("handed_over"), timeout, 0.2, "the handover")
    except TimeoutError:
        raise AssertionError(state(action)) from None


def ended(action: Action, timeout: float) -> Action:
    try:
        return finished(action, timeout)
    except TimeoutError:
        raise AssertionError(state(action)) from None


def running_team_job(
    make_job, redis, stream_name: str, team_database: str, lake, driver: str, kafka_servers: str = ""
) -> tuple[Job, Orders, Run, Flow]:
    """The team's job running with its three sinks, orders flowing into it (``kafka_servers``: from the Kafka topic
    ``stream_name`` there)."""
    source = (
        {"source_kind": "kafka", "source_stream": stream_name, "source_path": kafka_servers} if kafka_servers else {}
    )
    job = team_job(make_job, team_database, lake, driver=driver, **source)
    orders = Orders(redis, stream_name, kafka_servers)
    orders.send(40, seed=1)
    job_request_start(job=job)
    blue = wait_for(lambda: running_with_progress(job), 240, 0.5, "the job to run")
    flow = Flow(orders)
    flow.start()
    return job, orders, blue, flow


def beside(job: Job, params: dict) -> Action:
    """A blue/green upgrade requested, once green has run two batches beside the job."""
    action = action_request(job=job, kind=ActionKind.BLUE_GREEN, params=params)
    try:
        wait_for(lambda: green_running(action), 240, 0.5, "green to run two batches beside the job")
    except TimeoutError:
        raise AssertionError(state(action)) from None
    action.refresh_from_db()
    return action


def green_running(action: Action) -> Run | None:
    action.refresh_from_db()
    run = Run.objects.filter(id=action.params.get("green_run")).first()
    return run if run is not None and GreenBatch.objects.filter(action=action).count() >= 2 else None


def promoted(action: Action, timeout: float) -> Action:
    """Green's rows compared with blue's key by key, none added or removed by a parameter change; then promoted, and
    the upgrade succeeded."""
    compared = list(GreenBatch.objects.filter(action=action))
    assert all(b.removed == 0 and b.added == 0 for b in compared), [(b.batch_id, b.samples) for b in compared]
    assert sum(b.same + b.changed for b in compared) > 0, "green's rows compared with blue's, key by key"
    green_request(action, "promote")
    action = ended(action, timeout)
    assert action.status == ActionStatus.SUCCEEDED, state(action)
    return action


def one_line(job: Job, action: Action) -> str:
    """Why the job's checkpoint history is not one line (empty when it is): the job's batches, then the new version's
    from the batch after the handover, each number once in its checkpoint directory."""
    after = action.params["handover_after"]
    blue = [b for (b,) in Checkpoint.objects.filter(job=job, location="checkpoint").values_list("batch_id")]
    green = [b for (b,) in Checkpoint.objects.filter(job=job, location=action.params["fork"]).values_list("batch_id")]
    problems = [
        "a batch of the job's twice" if len(blue) != len(set(blue)) else "",
        "a batch of the new version's twice" if len(green) != len(set(green)) else "",
        "no batch of the new version's" if not green else "",
        f"the new version's first batch {min(green)} is not after {after}" if green and min(green) <= after else "",
        # at most the job's newest batch, which the handover came before and green's first batch replaced, and the
        # batch the job had in flight at the handover, which green replaced too
        f"the job committed {max(blue)}, more than two batches after {after}" if max(blue) > after + 2 else "",
    ]
    return "; ".join(filter(None, problems)) + (
        f" (job {sorted(blue)[-5:]}, new {sorted(green)[:5]})" if any(problems) else ""
    )


def lake_batches_once(spark, lake) -> bool:
    from tests.support import lake_rows

    pairs = [(r["batch_id"], r["customer"], r["start"]) for r in lake_rows(spark, lake)]
    return len(pairs) == len(set(pairs))


def test_a_parameter_change_hands_over_in_the_shared_driver_with_every_sink_exact_through_a_worker_and_driver_kill(
    make_job, redis, stream_name, celery_worker, spark, team_database, tmp_path, client, django_user_model
):
    """In the shared driver, green beside blue; the Celery worker killed while green follows (the upgrade goes on
    in the next worker), then kill -9 of the shared driver, blue and green in it: the job's restart is the job's run
    (its status says running, not green's), green starts again on its fork and follows; the operator promotes; green
    writes the job's sinks from the batch after blue's last. In the default suite: the headline handover."""
    from dashboard.api.tokens import token_create

    lake = tmp_path / "lake"
    viewer = django_user_model.objects.create_user("watcher", password="x")
    bearer = "Bearer " + token_create(user=viewer, name="ci")[1]
    job, orders, blue, flow = running_team_job(make_job, redis, stream_name, team_database, lake, "shared")
    try:
        action = beside(job, {"pipeline": "customer-spend", "parameters": {"threshold": 50}})
        green = Run.objects.get(id=action.params["green_run"])
        assert green.driver_host_id == blue.driver_host_id, "green is a second query in the job's shared driver"
        celery_worker.kill()
        time.sleep(3)
        celery_worker.start()
        os.killpg(blue.pid, signal.SIGKILL)  # the shared driver: blue and green die together
        killed = green
        # blue's restart and green's may come in either order: whichever is numbered higher, the job's run is blue's
        blue = wait_for(lambda: running_with_progress(job, blue.id), 240, 0.5, "the job's restart")
        green = wait_for(lambda: (r := green_running(action)) and r.id != killed.id and r, 240, 0.5, "green again")
        shown = client.get(f"/api/v1/jobs/{job.name}", HTTP_AUTHORIZATION=bearer).json()
        assert (shown["status"], shown["driver"]["run"], shown["driver"]["process_alive"]) == ("running", blue.id, True)
        action = promoted(action, 180)
    finally:
        flow.stop()
    job.refresh_from_db()
    green.refresh_from_db()
    assert green.status == RunStatus.RUNNING and job.checkpoint_dir == action.params["fork"]
    assert job.parameters["threshold"] == 50 and green.fencing_token == job.lease_token
    handed = Run.objects.get(id=blue.id)
    assert handed.status == RunStatus.STOPPED and f"after batch {action.params['handover_after']}" in handed.message
    assert isinstance(action.params["gap_seconds"], float), action.params
    assert action.params["first_batch"] > action.params["handover_after"]
    after = action.params["handover_after"]
    assert all(after < b <= after + 2 for b in action.params["replaced"]), action.params  # named in the outcome
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5, "every order in every sink")
    assert not (why := one_line(job, action)), why
    assert lake_batches_once(spark, lake)


@pytest.mark.headline
@pytest.mark.chaos
def test_a_code_upgrade_with_a_driver_of_its_own_survives_green_killed_before_and_after_the_handover(
    make_job, redis, stream_name, celery_worker, spark, team_database, tmp_path
):
    """A driver of its own for green; kill -9 of green before it caught up (started again on its fork, it goes on
    following), an automatic promotion once caught up, and kill -9 of green just after the handover (the job
    restarts on the new version's checkpoint under its strategy): every sink exact."""
    lake = tmp_path / "lake"
    job, orders, _, flow = running_team_job(make_job, redis, stream_name, team_database, lake, "own")
    try:
        action = action_request(job=job, kind=ActionKind.BLUE_GREEN, params={"pipeline": "customer-spend-v2"})
        first = wait_for(lambda: Run.objects.filter(id=Action.objects.get(id=action.id).params.get("green_run"),
                                                    started_at__isnull=False).first(), 240, 0.5, "green's driver")  # fmt: skip
        assert first.driver_host_id is None and first.pid
        os.killpg(first.pid, signal.SIGKILL)
        again = wait_for(lambda: (r := green_running(action)) and r.id != first.id and r, 300, 0.5, "green again")
        assert Run.objects.get(id=first.id).status == RunStatus.FAILED
        changed = wait_for(lambda: GreenBatch.objects.filter(action=action, changed__gt=0).first(), 120, 0.5, "a diff")
        assert any("average" in (s.get("after") or {}) for s in changed.samples), "v2's rows carry the average"
        # green started again far behind (its driver's start): it catches up before the operator promotes it
        wait_for(lambda: (green_view(action)["behind"] or 99) <= 2, 900, 1, "green to catch up")
        green_request(action, "promote")
        handed_over(action, 300)
        os.killpg(again.pid, signal.SIGKILL)
        action = ended(action, 240)
    finally:
        flow.stop()
    job.refresh_from_db()
    assert job.pipeline == "customer-spend-v2" and job.checkpoint_dir == action.params["fork"]
    wait_for(lambda: running_with_progress(job, again.id), 240, 0.5, "the job's restart on the new version")
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5, "every order in every sink")
    assert not (why := one_line(job, action)), why
    assert lake_batches_once(spark, lake)


@pytest.mark.headline
@pytest.mark.chaos
def test_an_abort_leaves_the_jobs_output_as_if_green_never_ran(
    make_job, redis, stream_name, celery_worker, spark, team_database, tmp_path
):
    lake = tmp_path / "lake"
    job, orders, blue, flow = running_team_job(make_job, redis, stream_name, team_database, lake, "shared")
    try:
        action = action_request(job=job, kind=ActionKind.BLUE_GREEN, params={"pipeline": "customer-spend-v2"})
        # asked before green is up: kept, and done once green follows the job
        assert green_request(action, "abort") is False
        action = ended(action, 240)
    finally:
        flow.stop()
    assert action.status == ActionStatus.ABORTED and "aborted (on request)" in action.outcome, action.outcome
    assert action.params.get("green_run"), "green came up before the abort was done"
    job.refresh_from_db()
    assert job.pipeline == "customer-spend" and job.checkpoint_dir == "checkpoint"
    assert Run.objects.get(id=blue.id).status == RunStatus.RUNNING, "blue never stopped"
    assert not (job.directory / action.params["fork"]).exists() and not GreenBatch.objects.filter(action=action)
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5, "every order in every sink")
    # nothing of green's in any sink: only blue's token ever wrote there, and nothing was rewound
    fences = {p.read_text() for p in (lake / "_statekeeper" / "fences").iterdir()}
    assert fences == {str(blue.fencing_token)} and not (lake / "_statekeeper" / "rewound").exists()
    assert {r.batch_id for r in job.checkpoints.all()} and all(c.run_id == blue.id for c in job.checkpoints.all())


@pytest.mark.headline
@pytest.mark.chaos
def test_blue_killed_as_the_handover_is_asked_for_leaves_every_sink_exact(
    make_job, redis, stream_name, celery_worker, spark, team_database, tmp_path
):
    """A driver of its own for each: blue killed with kill -9 right after the promotion is asked for. Whether its
    restart or the handover comes first, one of them fences the other, and every sink stays exact."""
    lake = tmp_path / "lake"
    job, orders, blue, flow = running_team_job(make_job, redis, stream_name, team_database, lake, "own")
    try:
        action = beside(job, {"pipeline": "customer-spend", "parameters": {"threshold": 70}})
        green_request(action, "promote")
        os.killpg(blue.pid, signal.SIGKILL)
        action = ended(action, 300)
        assert action.status == ActionStatus.SUCCEEDED, state(action)
    finally:
        flow.stop()
    job.refresh_from_db()
    assert job.parameters["threshold"] == 70 and job.checkpoint_dir == action.params["fork"]
    wait_for(lambda: running_with_progress(job, blue.id), 240, 0.5, "the new version running")
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5, "every order in every sink")
    assert lake_batches_once(spark, lake)
    assert job.runs.filter(status__in=("pending", "starting", "running", "stopping")).count() == 1


@pytest.mark.headline
@pytest.mark.chaos
def test_a_rescale_by_blue_green_hands_over_on_repartitioned_state_through_a_worker_and_a_driver_kill(
    make_job, redis, stream_name, celery_worker, spark, team_database, tmp_path
):
    """State partitions 2 → 3 without stopping the output: the Celery worker killed while Spark repartitions green's
    fork (the rescale resumes in the next worker), an automatic promotion once caught up, and kill -9 of the shared
    driver just after the handover (the job restarts on the repartitioned checkpoint). Green's batches run one number
    ahead of the job's (the repartition's batch of no input); the sinks number them as the job's, so the batch the job
    had in flight is replaced, never written twice."""
    from dashboard.checkpoint_dir.files import batch_offsets, lineage_base

    lake = tmp_path / "lake"
    job, orders, blue, flow = running_team_job(make_job, redis, stream_name, team_database, lake, "shared")
    assert job.state_partitions == 2
    try:
        action = action_request(job=job, kind=ActionKind.BLUE_GREEN,
                                params={"pipeline": job.pipeline, "state_partitions": 3, "auto": 1})  # fmt: skip
        try:
            wait_for(lambda: Action.objects.get(id=action.id).step == "repartition", 240, 0.2, "the repartition")
        except TimeoutError:
            raise AssertionError(state(action)) from None
        celery_worker.kill()
        time.sleep(3)
        celery_worker.start()
        handed_over(action, 600)
        action.refresh_from_db()
        os.killpg(blue.pid, signal.SIGKILL)  # the shared driver: green, the job's run now, dies in it
        action = ended(action, 240)
    finally:
        flow.stop()
    assert action.params["shift"] == 1, action.params
    job.refresh_from_db()
    assert job.state_partitions == 3 and job.checkpoint_dir == action.params["fork"]
    assert job.pipeline == "customer-spend" and blue.id != action.params["green_run"]
    fork = job.directory / action.params["fork"]
    assert lineage_base(fork) == -1, "the sinks number green's batch n as the job's n - 1"
    wait_for(lambda: running_with_progress(job, action.params["green_run"]), 300, 0.5, "the job's restart")
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5, "every order in every sink")
    newest = max(int(p.name) for p in (fork / "commits").iterdir() if p.name.isdigit())
    assert batch_offsets(fork, newest)["metadata"]["conf"]["spark.sql.shuffle.partitions"] == "3"
    assert not (why := one_line(job, action)), why
    assert lake_batches_once(spark, lake)


def test_a_state_migration_by_blue_green_keeps_the_output_going_and_every_total_exact(
    make_job, redis, stream_name, celery_worker, spark, team_database, tmp_path
):
    """customer-spend (hourly windows) to customer-spend-daily (days, in transformWithState), a change no upgrade
    reads the state across, without stopping the job: green starts on the state the migration built from a savepoint
    of batch K, in a new checkpoint whose batch 0 follows blue's K + 1, and takes over at a batch boundary. Every sink
    then holds the hours blue wrote up to the handover and each day's total over every order sent. In the default
    suite: the headline migration."""
    from dashboard.checkpoint_dir.files import lineage, seed_dir
    from tests.test_state_migration import daily_totals_go_on

    lake = tmp_path / "lake"
    job, orders, blue, flow = running_team_job(make_job, redis, stream_name, team_database, lake, "shared")
    try:
        action = beside(job, {"pipeline": "customer-spend-daily", "migrate": 1})
        savepoint = job.savepoints.get(id=action.params["savepoint"])
        assert action.params["shift"] == -(savepoint.batch_id + 1), "green's batch 0 is blue's batch after K"
        assert (seed_dir(job.directory / action.params["fork"]) / "_SUCCESS").exists()
        assert Run.objects.get(id=blue.id).status == RunStatus.RUNNING, "the job never stopped"
        green_request(action, "promote")
        action = ended(action, 240)
        assert action.status == ActionStatus.SUCCEEDED, state(action)
    finally:
        flow.stop()
    job.refresh_from_db()
    assert job.pipeline == "customer-spend-daily" and job.checkpoint_dir == action.params["fork"]
    assert lineage(job.checkpoint_location)["base"] == savepoint.batch_id + 1, "the sinks number on from K + 1"
    assert job.start_offset == action.params["green_start"]
    assert isinstance(action.params["gap_seconds"], float), action.params
    after = action.params["handover_after"]
    read = wait_for(lambda: Checkpoint.objects.filter(job=job, location="checkpoint", batch_id=after).first(), 60, 0.5,
                    "blue's last batch in the history")  # fmt: skip
    daily_totals_go_on(spark, job, orders, team_database, lake, int(read.end_offset["n"]))
