"""Work for the Celery workers, queued by task name once the transaction that asked for it has committed.

The dashboard never imports worker code: it names the tasks, as Celery beat's schedule does (settings).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from celery import current_app
from django.db import transaction

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


def host_queue(host: str) -> str:
    """The queue only the Celery workers of ``host`` consume (each adds its own when it starts: statekeeper/celery.py):
    work that must happen where a driver runs."""
    return f"host.{host}"


def enqueue_on(host: str, task: str, *args: Any) -> None:
    """Send ``task`` to the Celery workers of ``host`` only (after the commit, as ``enqueue``): a pid means something
    only on its own host."""
    transaction.on_commit(lambda: current_app.send_task(task, args=args, queue=host_queue(host)))
