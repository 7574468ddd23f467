"""Operator actions: every one is a persisted record, refused while another action on the job is in flight, executed
by a Celery worker, and safe to retry (a finished action is never executed twice)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser, User
from django.db import IntegrityError, transaction
from django.utils import timezone

from dashboard.models import ACTIVE_RUN_STATUSES, Action, ActionKind, ActionStatus, Job, Run
from dashboard.services.runs import ActionRefused


class ActionFailed(Exception):
    """The action could not be completed; the message is for the operator."""


def action_request(
    *,
    job: Job,
    kind: str,
    params: dict[str, Any] | None = None,
    requested_by: AbstractBaseUser | AnonymousUser | None = None,
    origin: str = "user",
) -> Action:
    """Record an action and queue it; refused while another action on this job is pending or running."""
    from workers.tasks import run_action

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
            transaction.on_commit(lambda: run_action.delay(action.id))
            if origin not in ("user", "api"):  # requests from people are audited where they arrive, with the address
                from dashboard.services.audit import audit_record

                audit_record(
                    None, verb=kind, job=job.name, target=f"action #{action.id}", params=params, outcome="requested",
                    origin=origin,
                )  # fmt: skip
    except IntegrityError:
        raise ActionRefused(f"{job.name} already has an action in flight: one action at a time per job.") from None
    return action


def action_progress(action: Action, text: str) -> None:
    Action.objects.filter(id=action.id).update(progress=text[:300])
    action.progress = text


def action_execute(*, action_id: int) -> Action:
    """Run a pending action to its end. A second call (a redelivered task) finds it no longer pending and returns."""
    from dashboard.services import forks, inspector, partitions, rescale, savepoints, storage

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
    from dashboard.services.audit import audit_record

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


def actions_abandoned(*, older_than_seconds: int) -> int:
    """Actions left running by a worker that died: failed, with the reason, so the operator can retry them."""
    cutoff = timezone.now() - timedelta(seconds=older_than_seconds)
    return Action.objects.filter(status=ActionStatus.RUNNING, started_at__lt=cutoff).update(
        status=ActionStatus.FAILED,
        finished_at=timezone.now(),
        outcome="The worker running this action stopped before it finished; it is safe to request it again.",
    )


def run_state_tool(
    command: str, path: Path, number: int, timeout: int = 900, spec: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Spark's reading of a checkpoint copy, in a process of its own (see workers/state_tool.py)."""
    extra = [json.dumps(spec)] if spec is not None else []
    try:
        done = subprocess.run(
            [sys.executable, "-m", "workers.state_tool", command, str(path), str(number), *extra],
            cwd=settings.BASE_DIR,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise ActionFailed(f"Spark's state reader did not finish within {timeout} s") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": done.stderr.strip().splitlines()[-1:] or "no output"}
    if done.returncode != 0 or "error" in result:
        raise ActionFailed(f"Spark could not read the state: {result.get('error')}")
    return dict(result)


def active_run(job: Job) -> Run | None:
    return job.runs.filter(status__in=ACTIVE_RUN_STATUSES).first()


def wait_until_stopped(action: Action, job: Job, timeout: float | None = None) -> None:
    """Ask the running driver to drain and stop, and wait for it (a no-op when the job is not running)."""
    from dashboard.services.runs import job_request_stop

    if active_run(job) is None:
        return
    action_progress(action, "stopping the job: the batch in flight commits first")
    job_request_stop(job=job)
    deadline = time.monotonic() + (timeout or settings.STOP_GRACE_SECONDS + 30)
    while active_run(job) is not None:
        if time.monotonic() > deadline:
            raise ActionFailed(f"{job.name} did not stop in time; nothing else was changed")
        time.sleep(0.5)
