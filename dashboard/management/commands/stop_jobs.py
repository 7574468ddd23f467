"""Stop every running job: drain, then wait; kill drivers that outlast the wait. Standbys on this host and the
warm state reader end too."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from dashboard.models import ACTIVE_RUN_STATUSES, Run
from dashboard.services.errors import ActionRefused
from dashboard.services.hosts import hosts_stop
from dashboard.services.runs import job_request_stop, kill_group, run_holds_process
from dashboard.services.standby import standbys_stop
from dashboard.services.state_reader_client import state_reader_stop


class Command(BaseCommand):
    help = "Ask every running job to stop after its batch in flight, and wait for the drivers to exit."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--wait", type=int, default=60, help="seconds to wait for drivers to exit")

    def handle(self, *args: Any, **opts: Any) -> None:
        runs = list(Run.objects.filter(status__in=ACTIVE_RUN_STATUSES).select_related("job"))
        for run in runs:
            with contextlib.suppress(ActionRefused):
                job_request_stop(job=run.job)
        here = [r for r in runs if r.host == settings.HOST_ID]  # a pid means something only on its own host
        deadline = time.monotonic() + opts["wait"]
        while time.monotonic() < deadline and any(run_holds_process(r) for r in here):
            time.sleep(0.5)
            for run in here:
                run.refresh_from_db()
        for run in runs:
            if run not in here:
                self.stdout.write(f"{run.job.name} runs on {run.host}: asked to stop there")
            elif run.driver_host_id is not None:
                still = " (still running: the shared driver ends it on SIGTERM)" if run_holds_process(run) else ""
                self.stdout.write(f"{run.job.name} stopped{still}")
            elif run_holds_process(run):  # the stop signal: a driver stops its query on SIGTERM, then SIGKILL
                kill_group(run.pid or 0)
                self.stdout.write(f"killed the driver of {run.job.name} (pid {run.pid})")
            else:
                self.stdout.write(f"{run.job.name} stopped")
        for ended in hosts_stop():
            self.stdout.write(ended)
        for ended in standbys_stop():  # after the drivers: a standby never takes over a stopped job anyway
            self.stdout.write(ended)
        if pid := state_reader_stop():
            self.stdout.write(f"ended the state reader (pid {pid})")
