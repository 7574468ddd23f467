"""Alerts: conditions on a job, evaluated every few seconds; one open alert per job and kind, notified by webhook and
e-mail when it opens and again (all clear) when the condition has been gone for ALERT_RESOLVE_AFTER_SECONDS."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.mail import send_mail
from django.db import IntegrityError, transaction
from django.urls import reverse
from django.utils import timezone

from dashboard.models import ACTIVE_RUN_STATUSES, Alert, AlertKind, Job, Recovery, Run, RunStatus, SavepointStatus
from dashboard.records import parse_time
from dashboard.selectors.charts import recent_points
from dashboard.selectors.cluster import CORES_WAIT
from dashboard.selectors.incidents import alert_incidents
from dashboard.selectors.lag import lag_status, latest_source_lag, source_lag_growing
from dashboard.services.enqueue import DELIVER_ALERT, enqueue
from dashboard.services.incidents import incidents_publish
from dashboard.units import bytes_h

log = logging.getLogger(__name__)
LAG_ALERTS = {"WARN": AlertKind.LAG_WARN, "STALL": AlertKind.LAG_STALL, "STOP": AlertKind.LAG_STOP}
FIRING, RESOLVED = "firing", "resolved"
SOURCE_WINDOW = timedelta(seconds=30)  # source lag samples judged for a job that is not running


DROP_JUMP = 10  # a batch dropping this many times the average of the batches before it
DROP_SHARE = 0.01  # and at least this share of its input


def watermark_jump(recent: list[dict[str, Any]]) -> str | None:
    """Late rows dropped by the watermark jumped in the newest batch: late data, or an event time that moved the
    watermark forward (a producer's clock)."""
    newest, before = recent[-1], recent[:-1]
    dropped = newest.get("dropped") or 0
    usual = sum(p.get("dropped") or 0 for p in before) / len(before) if before else 0.0
    if dropped <= 0 or dropped <= DROP_JUMP * usual or dropped < DROP_SHARE * (newest.get("rows") or 0):
        return None
    share = f"{dropped / newest['rows']:.0%} of its input; " if newest.get("rows") else ""
    return (
        f"{dropped} rows dropped by the watermark in batch {newest['batch']} ({share}the batches before dropped "
        f"{usual:.1f} on average): late data, or an event time that moved the watermark ahead"
    )


def heap_pressure(run: Run, now: datetime) -> str | None:
    """The run's driver heap held nearly its maximum after a garbage collection, at a recent heartbeat."""
    share = run.heap_share
    beat = run.last_heartbeat_at
    if share is None or beat is None or (now - beat).total_seconds() > settings.LEASE_TTL_SECONDS:
        return None
    if share * 100 < settings.ALERT_DRIVER_HEAP_PERCENT:
        return None
    if run.driver_host_id:
        where = f"the shared driver #{run.driver_host_id}'s heap, which all its jobs share,"
        remedy = "a larger STATEKEEPER_SHARED_DRIVER_MEMORY, or a driver of its own for the largest job"
        victims = "every job in it"
    else:
        where = "its driver's heap"
        remedy = "a larger STATEKEEPER_DRIVER_MEMORY"
        victims = "the run"
    return (
        f"{where} held {bytes_h(run.heap_after_gc_bytes)} of {bytes_h(run.heap_max_bytes)} ({share:.0%}) after its "
        f"latest garbage collection (the limit is {settings.ALERT_DRIVER_HEAP_PERCENT}%): an OutOfMemoryError "
        f"would fail {victims}. Give it {remedy}."
    )


def job_conditions(job: Job, now: datetime) -> dict[str, tuple[str | None, int | None]]:
    """Each alert kind's condition on this job now: a message while it holds, None when it does not."""
    found: dict[str, tuple[str | None, int | None]] = {kind: (None, None) for kind in AlertKind.values}
    run = Run.objects.filter(job=job, status=RunStatus.RUNNING).order_by("-id").first()
    if run is not None and run.started_at is not None:
        # judge this run only: the commits of an earlier run say nothing about whether this one is stuck (by the run
        # that recorded them: a first batch can start a moment before the run is marked started)
        recent = recent_points(job, run=run)
        trigger = job.trigger_interval_seconds
        last_commit = parse_time(recent[-1]["t"]) if recent else run.started_at
        quiet = (now - last_commit).total_seconds()
        allowed = max(30.0, settings.ALERT_CHECKPOINT_STALL_TRIGGERS * trigger)
        # Spark commits only batches with input: an idle job is quiet, not stalled, when its source says nothing waits
        sample = latest_source_lag([job], now).get(job.id)
        idle = sample is not None and sample.lag_records == 0
        if quiet > allowed and not idle:
            since = "since the run started" if not recent else f"since batch {recent[-1]['batch']}"
            waiting = f", with {job.lag_count(sample.lag_records)} waiting" if sample is not None else ""
            message = (
                f"no checkpoint for {quiet:.0f} s {since}{waiting} (trigger {trigger:g} s; the limit is "
                f"{settings.ALERT_CHECKPOINT_STALL_TRIGGERS} triggers, at least 30 s)"
            )
            found[AlertKind.CHECKPOINT_STALL] = (message, None)
        if recent:
            status = lag_status(recent, trigger, now)
            if status.status in LAG_ALERTS:
                found[LAG_ALERTS[status.status]] = (f"lag {status.status}: {status.reason}", None)
            elif status.status == "OK" and status.drain_seconds is None and _open(job, AlertKind.LAG_WARN):
                # Burrow calls a job OK once its lag fell in the window, though its input still outruns it: the
                # warning it had stays open until the lag drains at the current rates, rather than an all-clear and
                # a new page each time the lag dips
                found[AlertKind.LAG_WARN] = (f"lag still behind: {status.reason}", None)
            found[AlertKind.WATERMARK_DROPS] = (watermark_jump(recent), None)
        found[AlertKind.DRIVER_HEAP] = (heap_pressure(run, now), None)
    elif (starting := job.runs.filter(status=RunStatus.STARTING).order_by("-id").first()) is not None:
        # on a cluster without free cores its driver says so in the run's message (workers/driver.py CoresWatch)
        waited = (now - starting.requested_at).total_seconds()
        if starting.message.startswith(CORES_WAIT) and waited > settings.ALERT_CLUSTER_WAIT_SECONDS:
            found[AlertKind.CLUSTER_WAITING] = (
                f"run #{starting.id} starting for {waited:.0f} s. {starting.message}",
                None,
            )
    elif job.runs.exists() and not job.runs.filter(status__in=ACTIVE_RUN_STATUSES).exists():
        # down (not starting or stopping either): progress events say nothing, the source does; lag that keeps
        # growing is the on-call's business. A job never started has stopped nothing: its page shows the backlog
        samples = list(job.source_lag.filter(sampled_at__gte=now - SOURCE_WINDOW).order_by("sampled_at"))
        if source_lag_growing(samples):
            newest = samples[-1]
            oldest = f", the oldest waiting {newest.lag_seconds:.0f} s" if newest.lag_seconds else ""
            found[AlertKind.LAG_STOP] = (
                f"lag STOP: {job.name} is not running and its source moves on: {job.lag_count(newest.lag_records)} "
                f"waiting{oldest} (from {samples[0].lag_records} {int((now - samples[0].sampled_at).total_seconds())} "
                "s ago)",
                None,
            )
    window = timedelta(minutes=job.failure_rate_window_minutes)
    restarts = Recovery.objects.filter(job=job, failed_at__gte=now - window).count()
    if restarts >= settings.ALERT_RESTART_LOOP_COUNT:
        last = Recovery.objects.filter(job=job).order_by("-failed_at").first()
        cause = f" Last cause: {last.cause[:300]}" if last else ""
        found[AlertKind.RESTART_LOOP] = (
            f"{restarts} restarts within {job.failure_rate_window_minutes} minutes.{cause}",
            None,
        )
    savepoint = job.savepoints.exclude(status=SavepointStatus.IN_PROGRESS).order_by("-created_at", "-id").first()
    if savepoint is not None and savepoint.status == SavepointStatus.FAILED:
        found[AlertKind.SAVEPOINT_FAILED] = (
            f"savepoint #{savepoint.id} ({savepoint.origin}) failed: {savepoint.error[:300]}",
            savepoint.id,
        )
    return found


def alerts_evaluate(
    now: datetime | None = None, deliver: Callable[[int, str], Any] | None = None
) -> list[tuple[Alert, str]]:
    """Open, update and resolve every job's alerts; returns the (alert, event) pairs to notify, already handed to
    `deliver` (by default a Celery task, once the transaction commits)."""
    now = now or timezone.now()
    deliver = deliver or _enqueue
    changes: list[tuple[Alert, str]] = []
    for job in Job.objects.all():
        for kind, (message, subject) in job_conditions(job, now).items():
            change = _apply(job, kind, message, subject, now)
            if change:
                changes.append(change)
    for alert, event in changes:
        transaction.on_commit(lambda a=alert.id, e=event: deliver(a, e))  # type: ignore[misc]
        incidents_publish(alert.job_id, alert_incidents(alert)[-1:])  # what just happened: opened or all clear
    return changes


def _open(job: Job, kind: str) -> bool:
    return Alert.objects.filter(job=job, kind=kind, resolved_at__isnull=True).exists()


def _apply(job: Job, kind: str, message: str | None, subject: int | None, now: datetime) -> tuple[Alert, str] | None:
    current = Alert.objects.filter(job=job, kind=kind, resolved_at__isnull=True).first()
    if message is not None:
        if current is None:
            try:
                with transaction.atomic():
                    alert = Alert.objects.create(
                        job=job, kind=kind, opened_at=now, message=message, latest=message, subject_id=subject
                    )
            except IntegrityError:
                return None  # another evaluator opened it a moment ago
            return alert, FIRING
        Alert.objects.filter(id=current.id).update(latest=message, clear_since=None)
        return None
    if current is None:
        return None
    if current.clear_since is None:
        Alert.objects.filter(id=current.id).update(clear_since=now)
        return None
    if (now - current.clear_since).total_seconds() < settings.ALERT_RESOLVE_AFTER_SECONDS:
        return None
    resolved = Alert.objects.filter(id=current.id, resolved_at__isnull=True).update(resolved_at=now)
    if not resolved:
        return None
    current.resolved_at = now
    return current, RESOLVED


def _enqueue(alert_id: int, event: str) -> None:
    enqueue(DELIVER_ALERT, alert_id, event)


def payload(alert: Alert, event: str) -> dict[str, Any]:
    """What a webhook receives: Alertmanager's shape, reduced to what an on-call tool needs."""
    return {
        "status": event,
        "job": alert.job.name,
        "alert": alert.kind,
        "title": alert.get_kind_display(),
        "message": alert.message,
        "latest": alert.latest,
        "opened_at": alert.opened_at.isoformat(),
        "resolved_at": alert.resolved_at.isoformat() if alert.resolved_at else None,
        "url": settings.CONSOLE_URL.rstrip("/") + reverse("dashboard:job_detail", args=[alert.job.name]),
        "id": alert.id,
    }


class DeliveryFailed(Exception):
    pass


def alert_deliver(alert_id: int, event: str) -> list[dict[str, Any]]:
    """Send one event of an alert to each channel not yet reached for it; raises DeliveryFailed (to be retried) when
    a channel fails. Every attempt is recorded on the alert."""
    alert = Alert.objects.select_related("job").get(id=alert_id)
    done = {(n["channel"], n["event"]) for n in alert.notifications if n["ok"]}
    body = payload(alert, event)
    attempts = []
    if settings.ALERT_WEBHOOK_URL and ("webhook", event) not in done:
        attempts.append(_attempt("webhook", event, lambda: _post(settings.ALERT_WEBHOOK_URL, body)))
    if settings.ALERT_EMAILS and ("email", event) not in done:
        attempts.append(_attempt("email", event, lambda: _mail(body)))
    with transaction.atomic():
        alert = Alert.objects.select_for_update().get(id=alert_id)
        alert.notifications = [*alert.notifications, *attempts]
        alert.save(update_fields=["notifications"])
    failed = [a for a in attempts if not a["ok"]]
    if failed:
        raise DeliveryFailed("; ".join(f"{a['channel']}: {a['detail']}" for a in failed))
    return attempts


def _attempt(channel: str, event: str, send: Callable[[], str]) -> dict[str, Any]:
    try:
        detail, ok = send(), True
    except Exception as exc:  # a notification channel's failure is recorded, never raised into the evaluator
        detail, ok = f"{type(exc).__name__}: {exc}"[:300], False
        log.warning("alert %s delivery by %s failed: %s", event, channel, detail)
    return {"at": timezone.now().isoformat(), "channel": channel, "event": event, "ok": ok, "detail": detail}


def _post(url: str, body: dict[str, Any]) -> str:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=5) as response:  # noqa: S310  # the operator's configured URL
        return f"HTTP {response.status}"


def _mail(body: dict[str, Any]) -> str:
    word = "FIRING" if body["status"] == FIRING else "RESOLVED"
    subject = f"[Statekeeper] {word}: {body['title']} on {body['job']}"
    lines = [
        f"{body['title']} on job {body['job']} is {body['status']}.",
        "",
        f"Opened:   {body['opened_at']}",
        f"Resolved: {body['resolved_at'] or '-'}",
        f"Cause:    {body['message']}",
        f"Latest:   {body['latest']}",
        "",
        f"Console: {body['url']}",
    ]
    sent = send_mail(subject, "\n".join(lines), settings.DEFAULT_FROM_EMAIL, settings.ALERT_EMAILS)
    return f"{sent} message to {', '.join(settings.ALERT_EMAILS)}"
