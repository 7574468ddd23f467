"""A spare's takeover of a crashed shared driver, in the spare itself.

The spare sees the serving shared driver's process exit the moment it does (``exited_within``). When it handed the
crash to a supervisor's round through the queue (the task's dispatch, then a whole round: actions, standbys, journals,
every job's recovery), the standby job's restart was requested 0.3–1.0 s after the kill on the demo stack, and each
restart's launch was one more task. The spare instead
runs the part of the round a crash needs, in the supervisor's order: the driver marked gone, its runs lost, a failed
upgrade's new version rolled back rather than restarted, the restarts requested. Then it launches those restarts
itself: each becomes a run assigned to the spare, which that launch makes the serving one. The jobs with standby on go
through the whole of it first; the others' failures are recorded once those are launched.

The supervisor's own round still follows (queued by the spare): it starts the next spare once the takeover settled,
and does the rest. Every step is one the supervisor might run at the same moment, and each is safe to run twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

from django.db import DatabaseError
from django.utils import timezone

from dashboard.models import DriverMode, Run, RunStatus
from dashboard.services.hosts import hosts_supervise
from dashboard.services.recovery import recoveries_supervise
from dashboard.services.runs import run_launch, runs_supervise
from dashboard.services.upgrade_watch import upgrades_watch

log = logging.getLogger(__name__)
RESTARTS_WITHIN = timedelta(minutes=1)  # a restart requested this recently, of a job lost in the crash, is the crash's


def crash_take_over(host_id: int, launched: Callable[[], None] = lambda: None) -> list[str]:
    """The serving shared driver ``host_id`` exited: supervise the crash and launch its jobs' restarts, those of jobs
    with standby on before the others' failures are even recorded; ``launched`` is called after each of the two
    launches (the spare's main loop takes the runs). Returns what was done, as the supervisor's notes, and how far
    into the takeover each launch came."""
    began = time.monotonic()
    notes = hosts_supervise(spares=False)  # no spare's JVM start beside the takeover's first batches (spare_wanted)
    notes += runs_supervise()
    notes += upgrades_watch()
    for standby_only, which in ((True, "jobs with standby on"), (False, "the others")):
        notes += recoveries_supervise(standby_only=standby_only)
        notes += _launch(host_id)
        launched()
        notes.append(f"{which} launched {time.monotonic() - began:.2f} s into the takeover")
    return notes


def _launch(host_id: int) -> list[str]:
    """Launch the restarts requested for the jobs lost with ``host_id`` (standby on first)."""
    notes = []
    lost = Run.objects.filter(driver_host_id=host_id, status=RunStatus.LOST).values("job_id")
    restarts = Run.objects.filter(
        status=RunStatus.PENDING,
        job_id__in=lost,
        job__driver=DriverMode.SHARED,
        requested_at__gte=timezone.now() - RESTARTS_WITHIN,
    ).order_by("-job__standby", "id")
    for run_id in restarts.values_list("id", flat=True):
        try:
            run = run_launch(run_id=run_id)  # its queued launch task finds it launched, and does nothing
        except DatabaseError as exc:  # the queued task launches it instead
            log.warning("run %s: not launched in the takeover: %s", run_id, exc)
            continue
        notes.append(f"run {run.id}: {run.status}")
    return notes
