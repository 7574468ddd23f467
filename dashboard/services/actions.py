"""Operator actions: every one is a persisted record, refused while another action on the job is in flight, advanced
by Celery workers in resumable steps, and safe to retry (a finished action is never executed twice).

How no action waits for another task (invariant 10): an action is a sequence of steps (``action_steps``). A worker
claims the action, runs its steps while they have work to do, and lets go as soon as one has to wait: for a driver
to stop or come up, for Spark's state reader to start, for a process of its own to finish. Nothing holds a worker
slot while it waits, so the start task a restore queues, or a second upgrade on another job, always finds a worker.
Celery beat looks every second for actions whose wait is over (``actions_due``); a claim names its worker (host and
pid), so a worker killed mid-step is noticed and the step runs again (``actions_resume``).

This is the dispatcher: it sits above the modules that do each kind of action (savepoints, forks, rescale, …), which
take their errors from ``errors`` and their shared steps from ``action_steps``, never from here."""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser, User
from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from dashboard.models import IN_FLIGHT_ACTIONS, Action, ActionKind, ActionStatus, Job
from dashboard.selectors.incidents import action_incidents
from dashboard.services import (
    blue_green,
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
from dashboard.services.action_keys import Keys, declare_keys
from dashboard.services.action_steps import Done, Next, Steps, Wait, check_steps, one_step
from dashboard.services.audit import audit_record
from dashboard.services.enqueue import RESEND, RUN_ACTION, actions_send, enqueue
from dashboard.services.errors import ActionAborted, ActionFailed, ActionRefused
from dashboard.services.incidents import incidents_publish
from dashboard.services.runs import pid_alive

STEPS: dict[str, Steps] = {
    ActionKind.SAVEPOINT: savepoints.SAVEPOINT_STEPS,
    ActionKind.STOP_WITH_SAVEPOINT: savepoints.STOP_WITH_SAVEPOINT_STEPS,
    ActionKind.DISPOSE_SAVEPOINT: one_step("dispose", savepoints.dispose_action),
    ActionKind.RESTORE: forks.RESTORE_STEPS,
    ActionKind.DISCARD_CHECKPOINT: one_step("discard", forks.discard_action),
    ActionKind.ROLLBACK: forks.ROLLBACK_STEPS,
    ActionKind.RESCALE: rescale.RESCALE_STEPS,
    ActionKind.COUNT_PARTITION_ROWS: partitions.COUNT_ROWS_STEPS,
    ActionKind.CLEAN_ORPHANS: one_step("clean", storage.clean_orphans_action),
    ActionKind.INSPECT_STATE: inspector.INSPECT_STEPS,
    ActionKind.SKIP_ENTRIES: one_step("skip", skips.skip_action),
    ActionKind.REDRIVE_DEAD_LETTERS: one_step("re-drive", dead_letters.redrive_action),
    ActionKind.UPGRADE_PREVIEW: upgrades.PREVIEW_STEPS,
    ActionKind.UPGRADE_SHADOW: shadow.SHADOW_STEPS,
    ActionKind.UPGRADE: upgrades.UPGRADE_STEPS,
    ActionKind.UPGRADE_ROLLBACK: upgrades.UPGRADE_ROLLBACK_STEPS,
    ActionKind.BLUE_GREEN: blue_green.BLUE_GREEN_STEPS,
}
# What each kind's steps keep, beside its table: a key its kind does not declare fails the step that writes it.
NOTHING_KEPT = Keys()
KEYS: dict[str, Keys] = {
    ActionKind.SAVEPOINT: savepoints.SAVEPOINT_KEYS,
    ActionKind.STOP_WITH_SAVEPOINT: savepoints.SAVEPOINT_KEYS,
    ActionKind.DISPOSE_SAVEPOINT: NOTHING_KEPT,
    ActionKind.RESTORE: forks.RESTORE_KEYS,
    ActionKind.DISCARD_CHECKPOINT: NOTHING_KEPT,
    ActionKind.ROLLBACK: forks.ROLLBACK_KEYS,
    ActionKind.RESCALE: rescale.RESCALE_KEYS,
    ActionKind.COUNT_PARTITION_ROWS: partitions.COUNT_ROWS_KEYS,
    ActionKind.CLEAN_ORPHANS: NOTHING_KEPT,
    ActionKind.INSPECT_STATE: inspector.INSPECT_KEYS,
    ActionKind.SKIP_ENTRIES: NOTHING_KEPT,
    ActionKind.REDRIVE_DEAD_LETTERS: NOTHING_KEPT,
    ActionKind.UPGRADE_PREVIEW: upgrades.PREVIEW_KEYS,
    ActionKind.UPGRADE_SHADOW: shadow.SHADOW_KEYS,
    ActionKind.UPGRADE: upgrades.UPGRADE_KEYS,
    ActionKind.UPGRADE_ROLLBACK: upgrades.UPGRADE_ROLLBACK_KEYS,
    ActionKind.BLUE_GREEN: blue_green.BLUE_GREEN_KEYS,
}
if KEYS.keys() != STEPS.keys():
    raise TypeError(f"kinds with steps but no keys declared, or the reverse: {sorted(KEYS.keys() ^ STEPS.keys())}")
for _kind, _steps in STEPS.items():  # a step that may go on to a step its table lacks fails here, at start
    check_steps(_kind, _steps)
    declare_keys(_kind, KEYS[_kind])

CLAIM = timedelta(minutes=20)  # the longest a worker advances one action in one go (a copy of a large state)
SLICE_SECONDS = 120  # a worker that has advanced one action this long lets go and queues it again
MAX_RESUMES = 3  # a step whose worker died this often is not tried again: it is what kills the worker


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
            action = Action.objects.create(
                job=job, kind=kind, params=params or {}, requested_by=user, origin=origin,
                wake_at=timezone.now() + RESEND,
            )  # fmt: skip
            enqueue(RUN_ACTION, action.id)
            if origin not in ("user", "api"):  # requests from people are audited where they arrive, with the address
                audit_record(
                    None, verb=kind, job=job.name, target=f"action #{action.id}", params=params, outcome="requested",
                    origin=origin,
                )  # fmt: skip
    except IntegrityError:
        raise ActionRefused(f"{job.name} already has an action in flight: one action at a time per job.") from None
    return action


def _claimant() -> str:
    return f"{settings.HOST_ID}:{os.getpid()}"


def action_advance(*, action_id: int) -> Action:
    """Advance an action as far as it goes without waiting: claim it, run its steps until one waits or it ends, then
    let go. A visit that finds it claimed by a live worker, or finished (a redelivered task), changes nothing."""
    now = timezone.now()
    me = _claimant()
    claimed = (
        Action.objects.filter(id=action_id, status__in=IN_FLIGHT_ACTIONS)
        .filter(Q(claimed_until__isnull=True) | Q(claimed_until__lt=now))
        .update(
            status=ActionStatus.RUNNING,
            started_at=Coalesce("started_at", now),
            claimed_by=me,
            claimed_until=now + CLAIM,
        )
    )
    action = Action.objects.select_related("job", "requested_by").get(id=action_id)
    if not claimed:
        return action
    try:
        action = _advance(action)
    finally:
        Action.objects.filter(id=action_id, claimed_by=me).update(claimed_by="", claimed_until=None)
    action.claimed_by, action.claimed_until = "", None
    return action


def _phase_begin(action: Action, step: str, label: str) -> None:
    action.step = step
    action.phases = [*action.phases, {"step": step, "label": label, "started": timezone.now().isoformat()}]
    Action.objects.filter(id=action.id).update(step=step, phases=action.phases)


def _phase_end(action: Action) -> None:
    started = action.step_started_at
    if started is None or "ended" in action.phases[-1]:
        return
    ended = timezone.now()
    last = {**action.phases[-1], "ended": ended.isoformat(), "seconds": round((ended - started).total_seconds(), 2)}
    action.phases = [*action.phases[:-1], last]
    Action.objects.filter(id=action.id).update(phases=action.phases)


def _advance(action: Action) -> Action:
    steps = STEPS[action.kind]
    began = time.monotonic()
    while True:
        name = action.step or next(iter(steps))
        if name not in steps:
            return _finish(action, ActionStatus.FAILED, f"This action is at step {name!r}, which it no longer has.")
        label, step = steps[name]
        if not action.phases or action.phases[-1]["step"] != name or "ended" in action.phases[-1]:
            _phase_begin(action, name, label)
        try:
            result = step(action)
        except ActionAborted as exc:
            return _finish(action, ActionStatus.ABORTED, str(exc))
        except (ActionFailed, ActionRefused) as exc:
            return _finish(action, ActionStatus.FAILED, str(exc))
        except Exception as exc:
            return _finish(action, ActionStatus.FAILED, f"Unexpected error: {exc}", traceback.format_exc())
        if isinstance(result, Done):
            return _finish(action, ActionStatus.SUCCEEDED, result.outcome)
        if isinstance(result, Wait):
            action.progress = result.note[:300]
            action.wake_at = timezone.now() + timedelta(seconds=result.seconds)
            Action.objects.filter(id=action.id).update(progress=action.progress, wake_at=action.wake_at)
            return action
        assert isinstance(result, Next), result
        _phase_end(action)
        action.step = result.step
        Action.objects.filter(id=action.id).update(step=result.step, claimed_until=timezone.now() + CLAIM)
        if time.monotonic() - began > SLICE_SECONDS:  # let other actions have this worker; the next step is queued
            Action.objects.filter(id=action.id).update(wake_at=timezone.now())
            return action


def _finish(action: Action, status: str, outcome: str, error: str = "") -> Action:
    _phase_end(action)
    Action.objects.filter(id=action.id).update(
        status=status, outcome=outcome[:5000], error=error, finished_at=timezone.now(), progress="", wake_at=None
    )
    action.refresh_from_db()
    incidents_publish(action.job_id, action_incidents(action))
    audit_record(
        None,
        verb=action.kind,
        job=action.job.name,
        target=f"action #{action.id}",
        params={k: v for k, v in action.params.items() if k not in ("plan", "shadow", "result", "rows")},
        outcome=action.status,
        message=outcome,
        user=action.requested_by,
        origin="worker" if action.requested_by else action.origin,
    )
    return action


def action_execute(*, action_id: int, timeout: float = 900) -> Action:
    """Run an action to its end in this process: advance it, wait until it is due, advance again. For tests,
    benchmarks and commands; Celery workers advance actions a visit at a time (``action_advance``)."""
    deadline = time.monotonic() + timeout
    while True:
        action = action_advance(action_id=action_id)
        if not action.in_flight or time.monotonic() > deadline:
            return action
        due = (action.wake_at - timezone.now()).total_seconds() if action.wake_at else 0.2
        time.sleep(min(max(due, 0.05), 1.0))


def actions_due() -> list[int]:
    """Actions whose wait is over and that no worker holds: queued for a visit (Celery beat, every second)."""
    return actions_send(Action.objects.all(), due_by=timezone.now())


PENDING_LIMIT = timedelta(minutes=10)  # a request no worker took by then was lost (a broker restart, no worker)


def actions_resume() -> list[str]:
    """Actions held by a worker that died mid-step are let go, so their step runs again at once (every step is safe
    to repeat); one whose step killed its worker MAX_RESUMES times ends failed with the reason. Requests no worker
    ever took are failed after PENDING_LIMIT: a job is never stuck behind an action that nobody advances."""
    notes = []
    now = timezone.now()
    for action in Action.objects.filter(status=ActionStatus.RUNNING).exclude(claimed_by=""):
        host, _, pid = action.claimed_by.rpartition(":")
        gone = (host == settings.HOST_ID and not pid_alive(int(pid or 0))) or (
            action.claimed_until is not None and action.claimed_until < now
        )
        if not gone:
            continue
        if action.resumed >= MAX_RESUMES:
            let_go = Action.objects.filter(id=action.id, claimed_by=action.claimed_by).update(claimed_by="")
            if let_go:
                action.refresh_from_db()
                _finish(
                    action, ActionStatus.FAILED,
                    f"The worker running step {action.step or 'start'!r} stopped {action.resumed + 1} times before it "
                    "finished; the step is not tried again. What it had changed is described by its phases.",
                )  # fmt: skip
                notes.append(f"action {action.id} failed: its step kept killing the worker")
            continue
        if Action.objects.filter(id=action.id, claimed_by=action.claimed_by).update(
            claimed_by="", claimed_until=None, resumed=F("resumed") + 1, wake_at=now
        ):
            notes.append(
                f"action {action.id} resumed at step {action.step or 'start'} (its worker {action.claimed_by} is gone)"
            )
    lost = Action.objects.filter(status=ActionStatus.PENDING, requested_at__lt=now - PENDING_LIMIT).update(
        status=ActionStatus.FAILED,
        finished_at=now,
        wake_at=None,
        outcome=f"No worker took this request within {PENDING_LIMIT.seconds // 60} minutes (is a Celery worker "
        "running?); nothing was done, it is safe to request it again.",
    )
    if lost:
        notes.append(f"{lost} requests no worker took marked failed")
    return notes
