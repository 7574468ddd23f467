"""Savepoint policy and housekeeping: periodic savepoints, retention, dispose, discarding old checkpoints."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from dashboard.models import Action, ActionKind, ActionStatus, Run, RunStatus, Savepoint, SavepointStatus
from dashboard.services.actions import action_execute, action_request
from dashboard.services.forks import old_checkpoints, savepoint_preview
from dashboard.services.periodic import savepoints_periodic
from dashboard.services.savepoints import savepoints_retain
from tests.conftest import grant

pytestmark = pytest.mark.django_db


def savepoint(job, age_hours: float = 0, status=SavepointStatus.VERIFIED) -> Savepoint:
    made = Savepoint.objects.create(
        job=job, status=status, batch_id=3, created_at=timezone.now() - timedelta(hours=age_hours)
    )
    folder = job.savepoint_root / f"sp-{made.id}-batch-3"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "checkpoint" / "metadata").write_text("{}")
    Savepoint.objects.filter(id=made.id).update(path=str(folder))
    made.refresh_from_db()
    return made


def test_retention_keeps_the_newest_and_disposes_by_count_and_age(make_job):
    job = make_job(savepoints_max_count=2, savepoints_max_age_hours=24)
    ancient = savepoint(job, age_hours=48)
    old, middle, newest = savepoint(job, 3), savepoint(job, 2), savepoint(job, 1)
    assert sorted(savepoints_retain(job=job)) == sorted([ancient.id, old.id])
    statuses = {sp.id: sp.status for sp in Savepoint.objects.filter(job=job)}
    assert statuses == {ancient.id: "disposed", old.id: "disposed", middle.id: "verified", newest.id: "verified"}
    assert (
        not (job.savepoint_root / f"sp-{old.id}-batch-3").exists()
        and (job.savepoint_root / f"sp-{newest.id}-batch-3").exists()
    )


def test_the_newest_verified_savepoint_survives_even_when_too_old(make_job):
    job = make_job(savepoints_max_age_hours=1)
    only = savepoint(job, age_hours=100)
    assert savepoints_retain(job=job) == []
    assert Savepoint.objects.get(id=only.id).status == "verified"


def test_disposing_asks_nothing_of_the_newest_and_deletes_the_files_of_others(make_job):
    job = make_job()
    older, newest = savepoint(job, 2), savepoint(job, 1)
    refused = action_execute(
        action_id=action_request(job=job, kind=ActionKind.DISPOSE_SAVEPOINT, params={"savepoint": newest.id}).id
    )
    assert refused.status == ActionStatus.FAILED and "newest verified savepoint" in refused.outcome
    done = action_execute(
        action_id=action_request(job=job, kind=ActionKind.DISPOSE_SAVEPOINT, params={"savepoint": older.id}).id
    )
    assert done.status == ActionStatus.SUCCEEDED
    assert (
        Savepoint.objects.get(id=older.id).status == "disposed"
        and not (job.savepoint_root / f"sp-{older.id}-batch-3").exists()
    )


def test_periodic_savepoints_are_requested_when_the_interval_has_passed(make_job):
    from dashboard.models import Checkpoint

    due = make_job(savepoint_interval_minutes=10)
    recent = make_job(savepoint_interval_minutes=10)
    off = make_job(savepoint_interval_minutes=0)
    for job in (due, recent, off):
        Run.objects.create(job=job, status=RunStatus.RUNNING)
        job.latest_checkpoint = Checkpoint.objects.create(
            job=job, batch_id=1, committed_at=timezone.now(), duration_ms=1
        )
        job.save()
    savepoint(due, age_hours=1)
    savepoint(recent, age_hours=0.05)
    requested = savepoints_periodic()
    assert [Action.objects.get(id=i).job_id for i in requested] == [due.id]
    assert Action.objects.get(id=requested[0]).origin == "periodic"
    assert savepoints_periodic() == [], "not twice while the first is in flight"


def test_old_checkpoint_directories_can_be_discarded_but_never_the_live_one(make_job):
    job = make_job()
    (job.directory / "checkpoint" / "commits").mkdir(parents=True)
    (job.directory / "checkpoint-restore-9" / "commits").mkdir(parents=True)
    (job.directory / "checkpoint-restore-9" / "commits" / "0").write_text("v1")
    job.checkpoint_dir = "checkpoint-restore-9"
    job.save()
    assert [(o.name, o.batches) for o in old_checkpoints(job)] == [("checkpoint", 0)]
    live = action_execute(
        action_id=action_request(
            job=job, kind=ActionKind.DISCARD_CHECKPOINT, params={"directory": "checkpoint-restore-9"}
        ).id
    )
    assert live.status == ActionStatus.FAILED and (job.directory / "checkpoint-restore-9").exists()
    escape = action_execute(
        action_id=action_request(job=job, kind=ActionKind.DISCARD_CHECKPOINT, params={"directory": "../../etc"}).id
    )
    assert escape.status == ActionStatus.FAILED
    done = action_execute(
        action_id=action_request(job=job, kind=ActionKind.DISCARD_CHECKPOINT, params={"directory": "checkpoint"}).id
    )
    assert done.status == ActionStatus.SUCCEEDED and not (job.directory / "checkpoint").exists()


def test_restore_previews_refuse_a_running_job_and_an_unverified_savepoint(make_job, redis):
    job = make_job()
    failed = savepoint(job, status=SavepointStatus.FAILED)
    assert savepoint_preview(job, failed).refusal == "Refused: only a verified savepoint can be restored."
    good = savepoint(job)
    Run.objects.create(job=job, status=RunStatus.RUNNING)
    assert "is running. Stop it first" in savepoint_preview(job, good).refusal


def test_the_restore_page_shows_the_preview_and_refuses_to_confirm_while_running(
    client, django_user_model, make_job, redis
):
    client.force_login(grant(django_user_model.objects.create_user("oncall", password="x"), "operator"))
    job = make_job(name="clicks")
    good = savepoint(job)
    Run.objects.create(job=job, status=RunStatus.RUNNING)
    page = client.get(f"/jobs/clicks/savepoints/{good.id}/restore")
    assert page.status_code == 200 and "Records to replay" in page.content.decode()
    confirm = client.post(f"/jobs/clicks/savepoints/{good.id}/restore")
    assert confirm.status_code == 409 and not job.actions.exists()
