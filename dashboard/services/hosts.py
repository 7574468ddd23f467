"""Shared drivers: the process on this host that runs the queries of jobs set to ``driver=shared`` (workers/host.py).

A launch finds the host's serving shared driver, or starts one; the driver takes the runs assigned to it. A shared
driver that has had no run for a while ends itself; one that can no longer run a job's code as it is on disk (the
package was upgraded since it imported it) hands that run to a driver of its own and takes no new ones (draining).

The standby of the jobs in a shared driver is a **spare**: one more shared driver, its JVM started, that runs nothing
until a launch finds no serving one (the serving one died) and makes it the serving one. The supervisor keeps one
while a serving shared driver runs a job with standby on, and ends it when none has for a while: one warm process for
all the host's shared jobs, where a job of its own has a standby of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from dashboard.models import ACTIVE_RUN_STATUSES, DriverHost, HostStatus, Job, Run
from dashboard.services.processes import kill_group, pid_alive, spawn_process

HOST_LAUNCH_LOCK = 0x5354_4B48  # "STKH": one launch at a time looks for (or starts) the shared driver
HOST_START_SECONDS = 120  # a shared driver that has not beaten by then never came up
# a shared driver beats every second from its main loop: one silent this long is paused or hung (all its jobs with it)
HOST_SILENT_SECONDS = 10
SPARE_SETTLE = timedelta(seconds=30)  # as a standby of a job's own (dashboard/services/standby.py)


def shared_master(host: DriverHost) -> str:
    """The Spark master a shared driver runs on: ``local[cores]``, or the console's cluster (STATEKEEPER_SPARK_MASTER),
    where it is one application holding ``cores`` of the cluster's cores, and its jobs share that application's
    executors as they share the task slots of ``local[cores]``."""
    return settings.SPARK_MASTER or f"local[{host.cores}]"


def shared_master_label(host: DriverHost) -> str:
    """A run's Spark master as its job page shows it, when its query runs in the shared driver ``host``."""
    return f"{shared_master(host)} (shared driver {host.id})"


def host_alive(host: DriverHost) -> bool:
    return host.host == settings.HOST_ID and pid_alive(host.pid)


def host_silent(host: DriverHost) -> bool:
    """Its process is there but its main loop has not beaten for HOST_SILENT_SECONDS (SIGSTOP, a hung JVM call)."""
    last = host.heartbeat_at or host.started_at
    limit = HOST_SILENT_SECONDS if host.heartbeat_at else HOST_START_SECONDS
    return (timezone.now() - last).total_seconds() > limit


def launch_lock() -> None:
    """One at a time on this deployment: a launch looking for (or starting) the shared driver, the supervisor starting
    or ending the spare, a spare ending itself. Held to the end of the caller's transaction; nothing on SQLite."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, 0)", [HOST_LAUNCH_LOCK])


def host_for_launch() -> DriverHost:
    """The shared driver a run starts in on this host: the serving one, else a new one. Call inside the launch's
    transaction (the row lock keeps a driver that is ending itself from taking a run it will not serve)."""
    launch_lock()  # two launches at once must not start two shared drivers
    for host in DriverHost.objects.select_for_update().filter(host=settings.HOST_ID, status=HostStatus.SERVING):
        if host_alive(host) and not host_silent(host):
            return host
        if not host_alive(host):
            host_gone(host, "its process is gone")
    for host in DriverHost.objects.select_for_update().filter(host=settings.HOST_ID, status=HostStatus.SPARE):
        if host_alive(host) and not host_silent(host):
            host.status, host.message = (
                HostStatus.SERVING,
                f"Serving since {timezone.now():%H:%M:%S} UTC: was the spare.",
            )
            host.save(update_fields=["status", "message"])
            return host
        if not host_alive(host):
            host_gone(host, "its process is gone")
    return _host_spawn(HostStatus.SERVING)


def _host_spawn(status: str) -> DriverHost:
    host = DriverHost.objects.create(host=settings.HOST_ID, cores=settings.SHARED_DRIVER_CORES, status=status)
    host.log_path = str(settings.LOG_ROOT / f"shared-driver-{host.id}.log")
    host.pid = spawn_process("workers.host_process", host.id, Path(host.log_path))
    host.save(update_fields=["log_path", "pid"])
    return host


def spare_wanted() -> bool:
    """A serving shared driver on this host runs a job with standby on, and every run there has settled (committed a
    batch, or run SPARE_SETTLE): a spare's JVM start must not share the cores with a takeover's first batches."""
    active = Run.objects.filter(
        driver_host__host=settings.HOST_ID, driver_host__status=HostStatus.SERVING, status__in=ACTIVE_RUN_STATUSES
    )
    settled = Q(checkpoints__isnull=False) | Q(started_at__lte=timezone.now() - SPARE_SETTLE)
    return active.filter(job__standby=True).exists() and not active.exclude(settled).exists()


def spare_ready() -> bool:
    """This host has a spare that the next launch would make the serving shared driver: its process alive and beating
    (``host_for_launch`` takes no other)."""
    spares = DriverHost.objects.filter(host=settings.HOST_ID, status=HostStatus.SPARE)
    return any(host_alive(spare) and not host_silent(spare) for spare in spares)


def _serving_jobs() -> QuerySet[Job]:
    """The jobs a serving shared driver of this host runs."""
    running = Run.objects.filter(
        driver_host__host=settings.HOST_ID, driver_host__status=HostStatus.SERVING, status__in=ACTIVE_RUN_STATUSES
    )
    return Job.objects.filter(id__in=running.values("job_id"))


def spare_jobs() -> list[Job]:
    """The jobs a spare stands behind: those with standby on that a serving shared driver of this host runs."""
    return list(_serving_jobs().filter(standby=True).order_by("id"))


def spare_warms() -> list[Job]:
    """What a spare keeps warm: one job for each pipeline and state backend that a serving shared driver of this host
    runs, those of jobs with standby on first (a warm query's code is its pipeline's and its backend's, not its job's).
    Every job in the serving driver, not only those with standby on: its crash takes them all down, and each restarts
    in the spare, whose first batch for a pipeline it has not warmed starts its Python workers and compiles its code
    (seconds on a busy host). None when STATEKEEPER_SPARE_WARM_QUERIES is off, or on a cluster: the spare keeps only
    its Spark started (on a cluster, a warm query's batches would hold the cores the serving driver's jobs run on)."""
    if not settings.SPARE_WARM_QUERIES or settings.SPARK_MASTER:
        return []
    first: dict[tuple[str, str], Job] = {}
    for job in _serving_jobs().order_by("-standby", "id"):
        first.setdefault((job.pipeline, job.state_backend), job)
    return list(first.values())


def spare_retire(host_id: int, why: str) -> bool:
    """A spare that could not run the code its jobs now have ends itself (``why``), as a job's own standby does, and
    the supervisor starts a new one that imports it. Under the launch lock: False when a launch has just made it the
    serving one (it serves, and hands such a run to a driver of its own)."""
    with transaction.atomic():
        launch_lock()
        ended = DriverHost.objects.filter(id=host_id, status=HostStatus.SPARE).update(
            status=HostStatus.GONE, ended_at=timezone.now(), message=why[:2000]
        )
    return bool(ended)


def spare_idle() -> bool:
    """No job with standby on has had a run in a shared driver of this host for STANDBY_IDLE_SECONDS: the spare may
    end. (Not merely none running now: the runs of a shared driver that just died are lost, and their restarts are
    what the spare is for.)"""
    recent = timezone.now() - timedelta(seconds=settings.STANDBY_IDLE_SECONDS)
    return (
        not Run.objects.filter(driver_host__host=settings.HOST_ID, job__standby=True)
        .filter(Q(status__in=ACTIVE_RUN_STATUSES) | Q(ended_at__gte=recent))
        .exists()
    )


def spare_supervise() -> list[str]:
    """Start the spare when one is wanted and there is none; end it when it has been idle (``spare_idle``)."""
    with transaction.atomic():
        launch_lock()  # not beside a launch that may be making the spare the serving one
        spares = list(DriverHost.objects.filter(host=settings.HOST_ID, status=HostStatus.SPARE))
        if not spares and spare_wanted():
            spare = _host_spawn(HostStatus.SPARE)
            return [f"spare shared driver {spare.id} starting (pid {spare.pid})"]
        if not spares or not spare_idle():
            return []
        for spare in spares:
            if host_alive(spare):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(spare.pid or 0, signal.SIGTERM)
            host_gone(
                spare, f"Ended: no job with standby on ran in a shared driver for {settings.STANDBY_IDLE_SECONDS} s."
            )
        return [f"spare shared driver {spare.id} ended: idle" for spare in spares]


def host_gone(host: DriverHost, why: str) -> None:
    DriverHost.objects.filter(id=host.id).exclude(status=HostStatus.GONE).update(
        status=HostStatus.GONE, ended_at=timezone.now(), message=why[:2000]
    )


def host_may_end(host_id: int, idle_since: timedelta, why: str = "Ended: no job to run.") -> bool:
    """The shared driver asks whether it may end: it has no run in flight, none was assigned in ``idle_since``, and
    from now on it takes none (GONE, under the row lock a launch takes too; ``why`` its message)."""
    with transaction.atomic():
        host = DriverHost.objects.select_for_update().get(id=host_id)
        if host.status == HostStatus.SPARE:  # the supervisor ends it when it is no longer wanted
            return False
        recent = timezone.now() - idle_since
        busy = Run.objects.filter(driver_host=host, status__in=ACTIVE_RUN_STATUSES).exists()
        if busy or Run.objects.filter(driver_host=host, requested_at__gte=recent).exists():
            return False
        host.status, host.ended_at, host.message = HostStatus.GONE, timezone.now(), why
        host.save(update_fields=["status", "ended_at", "message"])
        return True


def hosts_supervise(*, spares: bool = True) -> list[str]:
    """Mark shared drivers whose process is gone; kill one that is silent (paused or hung): its jobs' leases expire
    and the supervisor restarts them, and it must not wake up beside their successors. ``spares``: then start or end
    the spare (``spare_supervise``)."""
    notes = []
    for host in DriverHost.objects.filter(host=settings.HOST_ID).exclude(status=HostStatus.GONE):
        if not host_alive(host):
            host_gone(host, "Its process exited.")
            notes.append(f"shared driver {host.id} gone")
        elif host_silent(host):
            kill_group(host.pid or 0)
            host_gone(host, f"Killed: its main loop was silent for over {HOST_SILENT_SECONDS} s (paused or hung).")
            notes.append(f"shared driver {host.id} killed: silent")
    return notes + (spare_supervise() if spares else [])


def hosts_stop() -> list[str]:
    """End this host's shared drivers (SIGTERM: each stops its queries after their batches in flight, then exits)."""
    notes = []
    for host in DriverHost.objects.filter(host=settings.HOST_ID).exclude(status=HostStatus.GONE):
        if host_alive(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(host.pid or 0, signal.SIGTERM)
            notes.append(f"asked the shared driver {host.id} (pid {host.pid}) to end")
    return notes
