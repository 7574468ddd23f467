"""A driver of its own whose run an upgrade or a rescale stopped waits for the job's next run, and runs it in the same
process: its JVM is up, its code loaded and compiled, its Python workers started. A new driver's start (20 s or more
on a busy host: the JVM, then a first batch that loads everything) leaves the action's critical path; what remains is
the new query's start in a warm JVM, as in a shared driver.

The protocol, all through the database: the driver marks its ended run released (the checkpoint is let go: actions
that wait for the job's drivers to end go on) and ``reusable_until`` a deadline. A launch before then claims it
(``dashboard.services.runs._claim_waiting_driver``: the deadline cleared and the new run given this process's pid,
in one transaction), and the driver, which polls for a run with its pid, runs it. At the deadline the driver clears
the deadline itself, unless a launch claimed it a moment before: then the run is there on its next look.

While the run still runs, the driver gets ready for the restart as soon as an action that will restart the job is in
flight (``RestartReady``): it starts again the Python daemons of a query's start that it ended after the run's first
batch (``workers/spark/python_daemons.py``), and its fork server (``workers/spark/fork_server.py``), so that the
next query's source runner and planner start ready with their imports."""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone

from dashboard import pipelines
from dashboard.models import ACTIVE_RUN_STATUSES, Action, ActionKind, ActionStatus, Run, RunStatus
from dashboard.services.runs import respawn_in_own_driver, restart_expected
from dashboard.services.upgrades import PLAN_KEPT_SECONDS
from workers.spark.fork_server import ForkServer
from workers.spark.python_daemons import end_start_daemons, start_daemons_again
from workers.spark.session import lean_jvm

log = logging.getLogger(__name__)
POLL_SECONDS = 0.1
LOOK_SECONDS = 1.0  # how often it asks whether the restart is still to come


def offer(run_id: int, job_id: int) -> bool:
    """Called as run ``run_id`` of a driver of its own stops on request, its query stopped, before its end is
    recorded (no launch of the job's next run can come before that): when an action restarts the job, the run is
    marked released and this driver offered to the next run until DRIVER_REUSE_SECONDS from now. Whether it was."""
    if not restart_expected(job_id):
        return False
    now = timezone.now()
    Run.objects.filter(id=run_id).update(
        released_at=now, reusable_until=now + timedelta(seconds=settings.DRIVER_REUSE_SECONDS)
    )
    log.info("run %s stopped for a restart: this driver waits up to %s s for the next run", run_id,
             settings.DRIVER_REUSE_SECONDS)  # fmt: skip
    return True


def wait_for_next_run(run_id: int, job_id: int, ending: threading.Event) -> int | None:
    """After ``offer``: the id of the job's next run once a launch has given it to this process, or None (the restart
    went elsewhere or will not come, DRIVER_REUSE_SECONDS passed, or ``ending``)."""
    deadline = time.monotonic() + settings.DRIVER_REUSE_SECONDS
    looked = time.monotonic()
    mine = Run.objects.filter(job_id=job_id, id__gt=run_id, pid=os.getpid(), host=settings.HOST_ID, driver_host=None)
    while True:
        assigned = mine.order_by("id").values_list("id", "status").first()
        if assigned is not None:
            return assigned[0] if assigned[1] in ACTIVE_RUN_STATUSES else None
        over = ending.is_set() or time.monotonic() >= deadline
        if not over and time.monotonic() - looked >= LOOK_SECONDS:
            looked = time.monotonic()
            over = _restart_gone(run_id, job_id)
        # over, unless a launch claimed this driver a moment ago: then its run is there on the next look
        if over and Run.objects.filter(id=run_id, reusable_until__isnull=False).update(reusable_until=None):
            return None
        ending.wait(POLL_SECONDS)


def _restart_gone(run_id: int, job_id: int) -> bool:
    """The restart will not come here: a later run of the job went to another driver, or no action restarts the job
    any more and no start of it waits for a launch."""
    later = Run.objects.filter(job_id=job_id, id__gt=run_id)
    if later.exclude(status=RunStatus.PENDING).exclude(pid=os.getpid()).exists():
        return True
    return not later.filter(status=RunStatus.PENDING).exists() and not restart_expected(job_id)


# how long after an upgrade preview a driver of its own expects the upgrade: as long as the preview's plan stands for
# it, since such an upgrade stops the job at once (no re-run first), before a look between batches would see it
PREVIEW_HINT_SECONDS = PLAN_KEPT_SECONDS


class RestartReady:
    """Looked at by a driver of its own, between its query's batches, once it has ended the Python daemons of its
    query's start: while an action that will restart the job is in flight (an upgrade, its rollback, a rescale), or
    an upgrade was previewed lately, they are started again beside the query, so that the next run, in this process,
    starts its query without waiting for them (about 2 s of an upgrade's output gap on the demo stack:
    docs/benchmarks.md). Should the action end without stopping the run (refused, or failed before its stop), or no
    upgrade follow the preview, they are ended again.

    ``forks``: the driver's fork server, its path in the JVM's environment since the driver started but the server
    not started until a restart is expected (about 70 MiB idle; once the next query's source runner is its child they
    share their imports, about 5 MiB (PSS) more than a runner of its own: docs/benchmarks.md). Started here, it stays for
    the next run's query, whose processes it forked; if the restart does not come it is closed again while idle.
    ``look`` is called from the driver's main thread, which the server's life is tied to."""

    def __init__(self, spark: Any, run: Run, forks: ForkServer | None = None) -> None:
        self.spark, self.job_id, self.since = spark, run.job_id, run.requested_at
        self.forks, self.forks_started = forks, False
        self.looked = 0.0
        self.starting: threading.Thread | None = None

    def look(self, now: bool = False) -> None:
        """``now``: at once, not LOOK_SECONDS after the last look (a stop request has come: if it is a restart's,
        what is started now is ready sooner than at the next run's start)."""
        if not now and time.monotonic() - self.looked < LOOK_SECONDS:
            return
        self.looked = time.monotonic()
        # not the action that started this run, which stays in flight until that run's first batch
        expected = restart_expected(self.job_id, after=self.since) or self._previewed()
        if expected and self.forks is not None and not self.forks_started:
            self.forks_started = self.forks.start()  # not when it runs already: this run's query started with it
            if self.forks_started:
                log.info("a restart is coming: the fork server started for the next query's Python processes")
        if expected and self.starting is None:
            self.starting = threading.Thread(target=self._start, name="start-daemons", daemon=True)
            self.starting.start()
        elif not expected and self.forks_started and self.forks is not None and self.forks.idle():
            self.forks_started = False
            self.forks.close()
            log.info("no restart came: the fork server is closed again")
        if not expected and self.starting is not None and not self.starting.is_alive():
            self.starting = None
            try:
                end_start_daemons(self.spark)
            except Exception as exc:  # as at the first batch: they idle on, nothing breaks
                log.warning("the Python daemons of the query's start were left running: %s", exc)

    def _previewed(self) -> bool:
        """An upgrade preview answered within PREVIEW_HINT_SECONDS: on the Deploys tab the upgrade follows its
        preview, and then stops the job at once (its plan is the preview's). Not while the preview runs: its verdict
        is what the operator waits for then, and the daemons' start would share the cores."""
        return Action.objects.filter(
            job_id=self.job_id, kind=ActionKind.UPGRADE_PREVIEW, status=ActionStatus.SUCCEEDED,
            requested_at__gt=self.since, finished_at__gt=timezone.now() - timedelta(seconds=PREVIEW_HINT_SECONDS),
        ).exists()  # fmt: skip

    def _start(self) -> None:
        started = time.monotonic()
        try:
            start_daemons_again(self.spark)
        except Exception as exc:  # only time is lost: the next run's start starts them
            log.warning("the Python daemons of a query's start were not started before the restart: %s",
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)  # fmt: skip
            return
        log.info("a restart is coming: the Python daemons of a query's start are up again (%.1f s)",
                 time.monotonic() - started)  # fmt: skip


def reuse_refusal(
    pipeline: str, backend: str, ran: pipelines.CodeVersion | None, ran_backend: str
) -> tuple[str, pipelines.CodeVersion | None]:
    """Why this process cannot run the job's next run, with the ``pipeline`` and state ``backend`` it has, after a run
    of code ``ran`` on ``ran_backend`` (empty when it can), and the code it would run."""
    try:
        code = pipelines.code_version(pipeline)
    except Exception as exc:  # not installed when this process started, or unreadable now
        return f"the pipeline {pipeline!r} could not be loaded here ({exc})", None
    if ran is None or code.package != ran.package or code.code_hash != ran.code_hash:
        return f"{pipelines.whose_code(pipeline, code)} is not the code this driver loaded", None
    if lean_jvm(backend) != lean_jvm(ran_backend):
        return f"the state backend {backend!r} runs with other JVM settings than {ran_backend!r}", None
    return "", code


def hand_over(run_id: int, why: str) -> None:
    """The run goes to a new driver process of its own (this one ends)."""
    pid = respawn_in_own_driver(Run.objects.select_related("job").get(id=run_id))
    log.info("run %s handed to a new driver (pid %s): %s", run_id, pid, why)
