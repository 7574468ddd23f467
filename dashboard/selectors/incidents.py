"""The incident timeline of a job: runs starting and ending, failures and restarts, operator actions, alerts. The
services that record these publish the same incidents to the live push as they commit (services/incidents.py)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from dashboard.models import Action, ActionKind, ActionStatus, Alert, Job, Recovery, Run, RunStatus


def incidents(job: Job, since: datetime) -> list[dict[str, Any]]:
    """The incident timeline: runs starting and ending, failures and restarts, operator actions, alerts."""
    events = []
    for run in Run.objects.filter(job=job, requested_at__gte=since - timedelta(days=1)):
        events += run_incidents(run)
    for action in Action.objects.filter(job=job, requested_at__gte=since - timedelta(days=1)):
        events += action_incidents(action)
    for recovery in Recovery.objects.filter(job=job, failed_at__gte=since):
        events += recovery_incidents(recovery)
    for alert in Alert.objects.filter(job=job, opened_at__gte=since - timedelta(days=1)):
        events += alert_incidents(alert)
    return sorted((e for e in events if e["t"] >= since.isoformat()), key=lambda e: e["t"])


def _incident(at: datetime, kind: str, text: str, key: str) -> dict[str, Any]:
    return {"t": at.isoformat(), "kind": kind, "text": text, "key": key}


def run_incidents(run: Run) -> list[dict[str, Any]]:
    events = []
    if run.started_at:
        events.append(_incident(run.started_at, "start", f"run #{run.id} started", f"run-{run.id}-start"))
    if run.ended_at:
        kind = {RunStatus.STOPPED: "stop", RunStatus.FAILED: "failure", RunStatus.LOST: "failure"}.get(
            RunStatus(run.status), "stop"
        )
        text = f"run #{run.id} {run.status}" + (f": {run.message[:120]}" if run.message else "")
        events.append(_incident(run.ended_at, kind, text, f"run-{run.id}-end"))
    return events


# reads, not changes to the job: no marker on its timeline
READ_ONLY_ACTIONS = (ActionKind.INSPECT_STATE, ActionKind.COUNT_PARTITION_ROWS)


def action_incidents(action: Action) -> list[dict[str, Any]]:
    if action.status in (ActionStatus.PENDING, ActionStatus.RUNNING) or not action.finished_at:
        return []
    if action.kind in READ_ONLY_ACTIONS:
        return []
    ok = action.status == ActionStatus.SUCCEEDED
    text = f"{action.get_kind_display()} #{action.id} {action.status}" + (
        "" if ok else f": {(action.error or action.outcome)[:120]}"
    )
    return [_incident(action.finished_at, action.kind if ok else "failure", text, f"action-{action.id}")]


def recovery_incidents(recovery: Recovery) -> list[dict[str, Any]]:
    text = f"restart #{recovery.attempt}" + (" (gave up)" if recovery.gave_up else "") + f": {recovery.cause[:120]}"
    return [_incident(recovery.failed_at, "restart", text, f"recovery-{recovery.id}")]


def alert_incidents(alert: Alert) -> list[dict[str, Any]]:
    events = [_incident(alert.opened_at, "alert", f"alert: {alert.message[:140]}", f"alert-{alert.id}-open")]
    if alert.resolved_at:
        events.append(
            _incident(alert.resolved_at, "all-clear", f"all clear: {alert.get_kind_display()}", f"alert-{alert.id}-end")
        )
    return events
