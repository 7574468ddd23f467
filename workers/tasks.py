"""Celery tasks: short, by id, each calling one service. A driver never lives inside a task."""

from __future__ import annotations

import redis
from celery import shared_task
from django.conf import settings
from django.core.mail import send_mail
from django.db import OperationalError

from dashboard.models import ACTIVE_RUN_STATUSES, Run
from dashboard.selectors.capacity import summary_text, week_review
from dashboard.services.actions import action_advance, actions_due, actions_resume
from dashboard.services.alerts import DeliveryFailed, alert_deliver, alerts_evaluate
from dashboard.services.autoscale import autoscale_run
from dashboard.services.checkpoints import journal_reconcile, progress_stream_ingest
from dashboard.services.dead_letters import dead_letters_trim
from dashboard.services.drills import drills_run
from dashboard.services.hosts import hosts_supervise
from dashboard.services.periodic import savepoints_periodic
from dashboard.services.recovery import recoveries_supervise
from dashboard.services.rollups import rollups_run
from dashboard.services.runs import run_kill_here, run_launch, runs_supervise
from dashboard.services.source_lag import source_lag_sample
from dashboard.services.standby import standbys_supervise
from dashboard.services.state_reader_client import state_reader_warm
from dashboard.services.upgrade_watch import upgrades_watch


@shared_task(time_limit=60, acks_late=True, autoretry_for=(OperationalError,), retry_backoff=1, max_retries=5)
def start_run(run_id: int) -> str:
    # acks_late is safe: run_launch does nothing for a run that is no longer pending, and the lease refuses a twin.
    run = run_launch(run_id=run_id)
    return f"run {run.id}: {run.status}"


@shared_task(time_limit=30)
def kill_driver(run_id: int) -> str:
    """Sent to this host's queue only: SIGKILL a driver that runs here."""
    return run_kill_here(run_id=run_id)


@shared_task(time_limit=30, expires=60)
def warm_state_reader() -> int:
    """Start the warm state reader on this worker's host unless it runs (the inspector page asks on opening)."""
    return state_reader_warm()


@shared_task(time_limit=30)
def ingest_progress() -> int:
    client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=10)
    lock = client.lock("statekeeper:ingest-lock", timeout=25, blocking=False)
    if not lock.acquire():
        return 0  # the previous tick is still ingesting
    try:
        return progress_stream_ingest(client=client)
    finally:
        lock.release()


# One visit to an action: its steps until one has to wait (a driver stopping, a run coming up, Spark's reader
# starting, a process of its own running), never the wait itself (invariant 10: no task waits for another task).
# Not acks_late: a worker that dies mid-step leaves the action claimed by a dead pid; the supervisor lets it go and
# the step runs again.
@shared_task(time_limit=1800, soft_time_limit=1750)
def run_action(action_id: int) -> str:
    action = action_advance(action_id=action_id)
    return f"action {action.id}: {action.status} at {action.step or 'start'}"


@shared_task(time_limit=30, expires=10)
def advance_actions() -> list[int]:
    """Queue a visit to every action whose wait is over (beat, every second)."""
    return actions_due()


@shared_task(time_limit=30)
def sample_source_lag() -> int:
    return source_lag_sample()


@shared_task(time_limit=120)
def trim_dead_letters() -> dict[str, int]:
    return dead_letters_trim()


@shared_task(time_limit=60)
def periodic_savepoints() -> list[int]:
    return savepoints_periodic()


@shared_task(time_limit=60)
def supervise_jobs() -> list[str]:
    notes = hosts_supervise()  # first: a silent shared driver is killed, and its jobs' runs are lost below
    notes += runs_supervise()
    notes += actions_resume()
    notes += upgrades_watch()  # before the restart strategy: a new version that failed is rolled back, not restarted
    notes += recoveries_supervise()
    notes += standbys_supervise()
    recent = Run.objects.filter(status__in=ACTIVE_RUN_STATUSES).select_related("job")
    for run in list(recent) + list(Run.objects.exclude(status__in=ACTIVE_RUN_STATUSES).select_related("job")[:5]):
        created = journal_reconcile(job=run.job, run_id=run.id)
        if created:
            notes.append(f"run {run.id}: {created} checkpoints recovered from the journal")
    return notes


@shared_task(time_limit=300)
def rollup_checkpoints() -> dict[str, int]:
    return rollups_run()


@shared_task(time_limit=30)
def evaluate_alerts() -> dict[str, int]:
    return {"changes": len(alerts_evaluate())}


@shared_task(time_limit=60, autoretry_for=(DeliveryFailed,), retry_backoff=5, retry_backoff_max=300, max_retries=8)
def deliver_alert(alert_id: int, event: str) -> int:
    return len(alert_deliver(alert_id, event))


@shared_task(time_limit=120)
def autoscale() -> list[str]:
    return autoscale_run()


@shared_task(time_limit=600)
def capacity_report() -> str:
    """The weekly review, e-mailed to STATEKEEPER_CAPACITY_EMAILS (or the alert addresses)."""
    recipients = settings.CAPACITY_EMAILS or settings.ALERT_EMAILS
    if not recipients:
        return "no recipients configured"
    review = week_review()
    url = settings.CONSOLE_URL.rstrip("/") + f"/capacity/?end={review.end:%Y-%m-%d}"
    subject = f"[Statekeeper] Capacity review, week to {review.end:%Y-%m-%d}: {review.totals['recommendations']} recommendations"
    send_mail(subject, summary_text(review, url), settings.DEFAULT_FROM_EMAIL, recipients)
    return f"sent to {', '.join(recipients)}"


@shared_task(time_limit=3600)
def restore_drills() -> list[str]:
    return drills_run()
