"""Five operator actions at once on five running jobs, with the Celery worker at the concurrency bin/dev gives it
(two): two upgrades, a restore, a rescale of state partitions and a shadow run all succeed, and every job counts every
event exactly once afterwards. Then a rescale whose worker is killed with SIGKILL mid-action resumes on a new worker
and ends as if nothing happened (invariant 10)."""

from __future__ import annotations

import uuid

import pytest

from dashboard.models import Action, ActionKind, ActionStatus, Job, ResultRow, RunStatus
from dashboard.services.actions import action_request
from dashboard.services.runs import job_request_start, job_request_stop
from tests.conftest import send_events, wait_for
from tests.support import events_counted, finished, send

pytestmark = [pytest.mark.spark, pytest.mark.django_db(transaction=True)]


def url_total(job: Job) -> int:
    return sum(row.value["requests"] for row in ResultRow.objects.filter(job=job, kind="url"))


def new_job(make_job, pipeline: str, **fields) -> Job:
    backend = "memory" if pipeline == "url-counts" and fields.get("state_backend") != "rocksdb" else "rocksdb"
    return make_job(
        **{"pipeline": pipeline, "state_backend": backend, "parallelism": 1, "trigger_interval_seconds": 1,
           "source_stream": f"test:events:{uuid.uuid4().hex[:8]}", **fields}
    )  # fmt: skip


def counted(job: Job) -> int:
    return url_total(job) if job.pipeline == "url-counts" else events_counted(job)


def feed(redis, job: Job, count: int, seed: int) -> int:
    if job.pipeline == "url-counts":
        return send_events(redis, job.source_stream, "url-counts", count, seed=seed)
    return send(redis, job.source_stream, count, seed=seed)


def running(job: Job) -> bool:
    return job.runs.filter(status=RunStatus.RUNNING).exists()


@pytest.mark.chaos  # five drivers on two cores: about three minutes, beyond the default suite's budget
def test_five_actions_at_once_on_five_jobs_all_succeed_with_every_count_exact(make_job, redis, celery_worker):
    upgraded = [new_job(make_job, "user-sessions"), new_job(make_job, "user-sessions")]
    restored = new_job(make_job, "url-counts")
    rescaled = new_job(make_job, "url-counts", state_backend="rocksdb", state_partitions=2)
    shadowed = new_job(make_job, "user-sessions")
    jobs = [*upgraded, restored, rescaled, shadowed]
    sent = {job.id: feed(redis, job, 200, seed=1) for job in jobs}
    for job in jobs:
        job_request_start(job=job)
    for job in jobs:
        wait_for(lambda j=job: counted(Job.objects.get(id=j.id)) == sent[j.id], 300, 0.5, f"{job.name} to catch up")

    # The restore's job: a savepoint, more input, then stopped; it will be restored to the savepoint and replay.
    savepoint_action = finished(action_request(job=restored, kind=ActionKind.SAVEPOINT), 180)
    assert savepoint_action.status == ActionStatus.SUCCEEDED, savepoint_action.outcome
    sent[restored.id] += feed(redis, restored, 100, seed=2)
    wait_for(lambda: url_total(restored) == sent[restored.id], 120, 0.5, "the restore's job to catch up")
    job_request_stop(job=restored)
    wait_for(lambda: not restored.runs.filter(status__in=["running", "stopping"]).exists(), 120, 0.5, "its stop")

    # The shadow's job took a savepoint right after it caught up: nothing arrived after it to compare on.
    caught_up = finished(action_request(job=shadowed, kind=ActionKind.SAVEPOINT), 180)
    assert caught_up.status == ActionStatus.SUCCEEDED, caught_up.outcome

    # All five at once, as fast as an on-call engineer's script sends them.
    requests = [
        (upgraded[0], ActionKind.UPGRADE, {"pipeline": "user-sessions-v2"}),
        (upgraded[1], ActionKind.UPGRADE, {"pipeline": "user-sessions-v2"}),
        (restored, ActionKind.RESTORE, {"savepoint": restored.savepoints.get(action=savepoint_action).id, "start": 1}),
        (rescaled, ActionKind.RESCALE, {"state_partitions": 3}),
        (shadowed, ActionKind.UPGRADE_SHADOW, {"pipeline": "user-sessions-v2", "records": 100}),
    ]
    actions = [action_request(job=job, kind=kind, params=params) for job, kind, params in requests]
    done = [finished(action, 600) for action in actions]
    assert [(a.kind, a.status) for a in done] == [(a.kind, ActionStatus.SUCCEEDED) for a in done], [
        a.outcome for a in done
    ]
    assert all(a.phases and all("ended" in p for p in a.phases) for a in done), "every action kept its phases"
    shadow = done[4].params["shadow"]
    assert shadow["counts"]["added"] == shadow["counts"]["removed"] == 0 and shadow["counts"]["changed"] > 0
    assert shadow["records"] == 100 and shadow["savepoint"] != shadowed.savepoints.get(action=caught_up).id, (
        "compared on records before the newest savepoint, after which nothing had arrived"
    )

    # Afterwards every job runs (the restored one on its fork, the rescaled one with 3 partitions) and counts
    # every event exactly once, old and new.
    wait_for(lambda: all(running(job) for job in jobs), 300, 0.5, "every job to run again")
    for job in jobs:
        sent[job.id] += feed(redis, job, 50, seed=3)
    for job in jobs:
        wait_for(lambda j=job: counted(Job.objects.get(id=j.id)) == sent[j.id], 300, 0.5, f"{job.name} to count all")
    assert [Job.objects.get(id=j.id).pipeline for j in upgraded] == ["user-sessions-v2"] * 2
    assert Job.objects.get(id=rescaled.id).state_partitions == 3
    assert Job.objects.get(id=restored.id).checkpoint_dir == f"checkpoint-restore-{done[2].id}"
    assert ResultRow.objects.filter(job=upgraded[0], kind="totals", value__has_key="largest").exists()
    for job in jobs:
        job_request_stop(job=job)


@pytest.mark.chaos  # a worker killed mid-action: about 90 s, with -m chaos
def test_a_rescale_whose_worker_is_killed_mid_action_resumes_on_a_new_worker(make_job, redis, celery_worker):
    job = new_job(make_job, "url-counts", state_backend="rocksdb", state_partitions=2)
    sent = feed(redis, job, 300, seed=1)
    job_request_start(job=job)
    wait_for(lambda: url_total(job) == sent, 300, 0.5, "the job to catch up")

    rescale = action_request(job=job, kind=ActionKind.RESCALE, params={"state_partitions": 3})
    wait_for(
        lambda: Action.objects.filter(id=rescale.id, step__in=["savepoint", "verify", "repartition"]).exists(),
        180, 0.1, "the rescale to reach its savepoint",
    )  # fmt: skip
    celery_worker.kill()  # SIGKILL to the worker, its pool and its beat, mid-action
    sent += feed(redis, job, 100, seed=2)  # arrives while the job is down
    celery_worker.start()
    rescale = finished(rescale, 600)
    assert rescale.status == ActionStatus.SUCCEEDED, rescale.outcome
    steps = [p["step"] for p in rescale.phases]
    assert steps[-7:] == ["repartition", "check-state", "apply", "first-batch", "savepoint", "verify", "settle"], steps
    assert Job.objects.get(id=job.id).state_partitions == 3
    assert job.savepoints.filter(origin="before-rescale", status="verified").count() == 1, "one way back, not two"
    wait_for(lambda: url_total(job) == sent, 300, 0.5, "the rescaled job to count every event once")
    job_request_stop(job=job)
