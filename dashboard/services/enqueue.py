"""Work for the Celery workers, queued by task name once the transaction that asked for it has committed.

The dashboard never imports worker code: it names the tasks, as Celery beat's schedule does (settings).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from celery import current_app
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from dashboard.models import IN_FLIGHT_ACTIONS, Action

log = logging.getLogger(__name__)

START_RUN = "workers.tasks.start_run"
RUN_ACTION = "workers.tasks.run_action"
DELIVER_ALERT = "workers.tasks.deliver_alert"
WARM_STATE_READER = "workers.tasks.warm_state_reader"
KILL_DRIVER = "workers.tasks.kill_driver"
SUPERVISE_JOBS = "workers.tasks.supervise_jobs"
TASKS = (START_RUN, RUN_ACTION, DELIVER_ALERT, WARM_STATE_READER, KILL_DRIVER, SUPERVISE_JOBS)


def enqueue(task: str, *args: Any) -> None:
    """Send ``task`` once the current transaction commits (at once outside one): a worker never sees a record that a
    rollback then removes."""
    transaction.on_commit(lambda: current_app.send_task(task, args=args))


def enqueue_at(task: str, when: datetime, *args: Any) -> None:
    """Send ``task`` to run at ``when`` (after the commit, as ``enqueue``): a wake-up at the moment something is due,
    where the beat's period would add up to a period's delay."""
    transaction.on_commit(lambda: current_app.send_task(task, args=args, eta=when))


def enqueue_ready() -> None:
    """Load now what a process' first task costs: Celery's result backend, found by scanning the installed packages'
    entry points (0.3 s). A spare's takeover queues its restarts, and must not pay it then."""
    current_app.backend  # noqa: B018  # loaded on first use


def host_queue(host: str) -> str:
    """The queue only the Celery workers of ``host`` consume (each adds its own when it starts: statekeeper/celery.py):
    work that must happen where a driver runs."""
    return f"host.{host}"


def enqueue_on(host: str, task: str, *args: Any) -> None:
    """Send ``task`` to the Celery workers of ``host`` only (after the commit, as ``enqueue``): a pid means something
    only on its own host."""
    transaction.on_commit(lambda: current_app.send_task(task, args=args, queue=host_queue(host)))


RESEND = timedelta(seconds=30)  # a queued visit of an action no worker took is sent again after this (a lost message)


def actions_send(actions: QuerySet[Action], due_by: datetime | None = None) -> list[int]:
    """Queue a visit of each action in ``actions`` that is in flight, waits (until ``due_by`` at the latest, when
    given) and no worker holds. Its wake time moves on by RESEND as it is queued, so a visit that no worker took is
    sent again, never twice at once."""
    now = timezone.now()
    waiting = actions.filter(status__in=IN_FLIGHT_ACTIONS, wake_at__isnull=False)
    if due_by is not None:
        waiting = waiting.filter(wake_at__lte=due_by)
    waiting = waiting.filter(Q(claimed_until__isnull=True) | Q(claimed_until__lt=now))
    sent = []
    for action_id, wake_at in waiting.values_list("id", "wake_at")[:200]:
        if Action.objects.filter(id=action_id, wake_at=wake_at).update(wake_at=now + RESEND):
            enqueue(RUN_ACTION, action_id)
            sent.append(action_id)
    return sent


def job_actions_wake(job_id: int) -> None:
    """Something a job's actions may wait on happened (its run ended): visit them now rather than at their wake time
    (a second or more through Celery beat, which stays the way back when this message is lost)."""
    try:
        actions_send(Action.objects.filter(job_id=job_id))
    except Exception as exc:  # noqa: BLE001 - the broker away: beat's round visits them, only later
        log.warning("could not wake job %s's actions: %s", job_id, exc)
