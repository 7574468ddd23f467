"""Operator actions: every one is a persisted record, refused while another action on the job is in flight, executed
by a Celery worker, and safe to retry (a finished action is never executed twice).

This is the dispatcher: it sits above the modules that do each kind of action (savepoints, forks, rescale, …), which
take their errors from ``errors`` and their shared steps from ``action_steps``, never from here."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser, User
from django.db import IntegrityError, transaction
from django.utils import timezone

from dashboard.models import Action, ActionKind, ActionStatus, Job
from dashboard.selectors.incidents import action_incidents
from dashboard.services import (
    dead_letters,
    forks,
    inspector,
    partitions,
    rescale,
    savepoints,
    shadow,
    skips,
    storage,
    upgrades,
)
from dashboard.services.audit import audit_record
from dashboard.services.enqueue import RUN_ACTION, enqueue
from dashboard.services.errors import ActionFailed, ActionRefused
from dashboard.services.incidents import incidents_publish


def action_request(
    *,
    job: Job,
    kind: str,
    params: dict[str, Any] | None = None,
    requested_by: AbstractBaseUser | AnonymousUser | None = None,
    origin: str = "user",
) -> Action:
    """Record an action and queue it; refused while another action on this job is pending or running."""
    user = requested_by if isinstance(requested_by, User) else None
    try:
        with transaction.atomic():
            Job.objects.select_for_update().get(id=job.id)
            busy = job.actions.filter(status__in=[ActionStatus.PENDING, ActionStatus.RUNNING]).first()
            if busy is not None:
                raise ActionRefused(
                    f"{job.name} already has {busy.get_kind_display().lower()} #{busy.id} "
                    f"{busy.get_status_display().lower()}: one action at a time per job."
                )
            action = Action.objects.create(job=job, kind=kind, params=params or {}, requested_by=user, origin=origin)
            enqueue(RUN_ACTION, action.id)
            if origin not in ("user", "api"):  # requests from people are audited where they arrive, with the address
                audit_record(
                    None, verb=kind, job=job.name, target=f"action #{action.id}", params=params, outcome="requested",
                    origin=origin,
                )  # fmt: skip
    except IntegrityError:
        raise ActionRefused(f"{job.name} already has an action in flight: one action at a time per job.") from None
    return action


def action_execute(*, action_id: int) -> Action:
    """Run a pending action to its end. A second call (a redelivered task) finds it no longer pending and returns."""
    claimed = Action.objects.filter(id=action_id, status=ActionStatus.PENDING).update(
        status=ActionStatus.RUNNING, started_at=timezone.now()
    )
    action = Action.objects.select_related("job").get(id=action_id)
    if not claimed:
        return action
    handlers: dict[str, Callable[[Action], str]] = {
        ActionKind.SAVEPOINT: savepoints.savepoint_action,
        ActionKind.STOP_WITH_SAVEPOINT: savepoints.stop_with_savepoint_action,
        ActionKind.DISPOSE_SAVEPOINT: savepoints.dispose_action,
        ActionKind.RESTORE: forks.restore_action,
        ActionKind.DISCARD_CHECKPOINT: forks.discard_action,
        ActionKind.ROLLBACK: forks.rollback_action,
        ActionKind.RESCALE: rescale.rescale_action,
        ActionKind.COUNT_PARTITION_ROWS: partitions.count_rows_action,
        ActionKind.CLEAN_ORPHANS: storage.clean_orphans_action,
        ActionKind.INSPECT_STATE: inspector.inspect_action,
        ActionKind.SKIP_ENTRIES: skips.skip_action,
        ActionKind.REDRIVE_DEAD_LETTERS: dead_letters.redrive_action,
        ActionKind.UPGRADE_PREVIEW: upgrades.upgrade_preview_action,
        ActionKind.UPGRADE_SHADOW: shadow.upgrade_shadow_action,
        ActionKind.UPGRADE: upgrades.upgrade_action,
        ActionKind.UPGRADE_ROLLBACK: upgrades.upgrade_rollback_action,
    }
    try:
        outcome = handlers[action.kind](action)
        status, error = ActionStatus.SUCCEEDED, ""
    except (ActionFailed, ActionRefused) as exc:
        outcome, status, error = str(exc), ActionStatus.FAILED, ""
    except Exception as exc:
        outcome, status, error = f"Unexpected error: {exc}", ActionStatus.FAILED, traceback.format_exc()
    Action.objects.filter(id=action.id).update(
        status=status, outcome=outcome[:5000], error=error, finished_at=timezone.now(), progress=""
    )
    action.refresh_from_db()
    incidents_publish(action.job_id, action_incidents(action))
    audit_record(
        None,
        verb=action.kind,
        job=action.job.name,
        target=f"action #{action.id}",
        params=action.params,
        outcome=action.status,
        message=outcome,
        user=action.requested_by,
        origin="worker" if action.requested_by else action.origin,
    )
    return action


PENDING_LIMIT = timedelta(minutes=10)  # a request no worker took by then was lost (a broker restart, no worker)


def actions_abandoned(*, older_than_seconds: int) -> int:
    """Actions left running by a worker that died, and requests no worker ever took: failed, with the reason, so a
    job is never stuck behind them and the operator can request them again."""
    now = timezone.now()
    died = Action.objects.filter(
        status=ActionStatus.RUNNING, started_at__lt=now - timedelta(seconds=older_than_seconds)
    ).update(
        status=ActionStatus.FAILED,
        finished_at=now,
        outcome="The worker running this action stopped before it finished; it is safe to request it again.",
    )
    lost = Action.objects.filter(status=ActionStatus.PENDING, requested_at__lt=now - PENDING_LIMIT).update(
        status=ActionStatus.FAILED,
        finished_at=now,
        outcome=f"No worker took this request within {PENDING_LIMIT.seconds // 60} minutes (is a Celery worker "
        "running?); nothing was done, it is safe to request it again.",
    )
    return died + lost
