"""Shared drivers: the process on this host that runs the queries of jobs set to ``driver=shared`` (workers/host.py).

A launch finds the host's serving shared driver, or starts one; the driver takes the runs assigned to it. A shared
driver that has had no run for a while ends itself; one that can no longer run a job's code as it is on disk (the
package was upgraded since it imported it) hands that run to a driver of its own and takes no new ones (draining).
"""

from __future__ import annotations

import contextlib
import os
import signal
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from dashboard.models import ACTIVE_RUN_STATUSES, DriverHost, HostStatus, Run
from dashboard.services.processes import kill_group, pid_alive, spawn_process

HOST_LAUNCH_LOCK = 0x5354_4B48  # "STKH": one launch at a time looks for (or starts) the shared driver
HOST_START_SECONDS = 120  # a shared driver that has not beaten by then never came up
# a shared driver beats every second from its main loop: one silent this long is paused or hung (all its jobs with it)
HOST_SILENT_SECONDS = 10


def host_alive(host: DriverHost) -> bool:
    return host.host == settings.HOST_ID and pid_alive(host.pid)


def host_silent(host: DriverHost) -> bool:
    """Its process is there but its main loop has not beaten for HOST_SILENT_SECONDS (SIGSTOP, a hung JVM call)."""
    last = host.heartbeat_at or host.started_at
    limit = HOST_SILENT_SECONDS if host.heartbeat_at else HOST_START_SECONDS
    return (timezone.now() - last).total_seconds() > limit


def host_for_launch() -> DriverHost:
    """The shared driver a run starts in on this host: the serving one, else a new one. Call inside the launch's
    transaction (the row lock keeps a driver that is ending itself from taking a run it will not serve)."""
    if connection.vendor == "postgresql":  # two launches at once must not start two shared drivers
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, 0)", [HOST_LAUNCH_LOCK])
    for host in DriverHost.objects.select_for_update().filter(host=settings.HOST_ID, status=HostStatus.SERVING):
        if host_alive(host) and not host_silent(host):
            return host
        if not host_alive(host):
            host_gone(host, "its process is gone")
    host = DriverHost.objects.create(host=settings.HOST_ID, cores=settings.SHARED_DRIVER_CORES)
    host.log_path = str(settings.LOG_ROOT / f"shared-driver-{host.id}.log")
    host.pid = spawn_process("workers.host_process", host.id, Path(host.log_path))
    host.save(update_fields=["log_path", "pid"])
    return host


def host_gone(host: DriverHost, why: str) -> None:
    DriverHost.objects.filter(id=host.id).exclude(status=HostStatus.GONE).update(
        status=HostStatus.GONE, ended_at=timezone.now(), message=why[:2000]
    )


def host_may_end(host_id: int, idle_since: timedelta) -> bool:
    """The shared driver asks whether it may end: it has no run in flight, none was assigned in ``idle_since``, and
    from now on it takes none (GONE, under the row lock a launch takes too)."""
    with transaction.atomic():
        host = DriverHost.objects.select_for_update().get(id=host_id)
        recent = timezone.now() - idle_since
        busy = Run.objects.filter(driver_host=host, status__in=ACTIVE_RUN_STATUSES).exists()
        if busy or Run.objects.filter(driver_host=host, requested_at__gte=recent).exists():
            return False
        host.status, host.ended_at, host.message = HostStatus.GONE, timezone.now(), "Ended: no job to run."
        host.save(update_fields=["status", "ended_at", "message"])
        return True


def hosts_supervise() -> list[str]:
    """Mark shared drivers whose process is gone; kill one that is silent (paused or hung): its jobs' leases expire
    and the supervisor restarts them, and it must not wake up beside their successors."""
    notes = []
    for host in DriverHost.objects.filter(host=settings.HOST_ID).exclude(status=HostStatus.GONE):
        if not host_alive(host):
            host_gone(host, "Its process exited.")
            notes.append(f"shared driver {host.id} gone")
        elif host_silent(host):
            kill_group(host.pid or 0)
            host_gone(host, f"Killed: its main loop was silent for over {HOST_SILENT_SECONDS} s (paused or hung).")
            notes.append(f"shared driver {host.id} killed: silent")
    return notes


def hosts_stop() -> list[str]:
    """End this host's shared drivers (SIGTERM: each stops its queries after their batches in flight, then exits)."""
    notes = []
    for host in DriverHost.objects.filter(host=settings.HOST_ID).exclude(status=HostStatus.GONE):
        if host_alive(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(host.pid or 0, signal.SIGTERM)
            notes.append(f"asked the shared driver {host.id} (pid {host.pid}) to end")
    return notes
