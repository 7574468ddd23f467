"""Where a running job's memory goes, process by process: each running job's driver process tree (the Python driver,
its JVM, the Python source runner, the Python daemon and its workers), proportional set size (PSS: shared pages
divided among their users) and resident size, in MiB, read from /proc.

    STATEKEEPER_ENV=development .venv/bin/python -m bench.memory

Run it beside ./bin/dev (the demo jobs running a few minutes). STATEKEEPER_DRIVER_MEMORY and
STATEKEEPER_DRIVER_JAVA_OPTIONS, set when bin/dev starts, size the drivers' JVMs; STATEKEEPER_OWN_DRIVER_LEAN=false
gives a RocksDB job's own driver the default JVM rather than a lean one. The processes that stand behind the jobs are
listed too: the spare shared driver (STATEKEEPER_SPARE_WARM_QUERIES says whether it runs warm queries) and each job's
own standby. Each job's batches (median and p90 of those that read events, its run's first minute left out) say what
the sizes cost it.
"""

from __future__ import annotations

import collections
import os
import statistics
from datetime import timedelta

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_ENV", "development")

import django  # noqa: E402

django.setup()

from bench.database import migrated  # noqa: E402
from bench.figures import pct  # noqa: E402
from bench.procs import command, process_tree, sizes  # noqa: E402
from workers.spark.python_daemons import START_ONLY  # noqa: E402

migrated()

from django.conf import settings  # noqa: E402

from dashboard.models import Checkpoint, DriverHost, HostStatus, Run, StandbyDriver  # noqa: E402
from dashboard.services.standby import LIVE  # noqa: E402

KINDS = ("JVM", "Python driver", "Python source runner", "Python workers", "Python start daemons", "other")


def kind(pid: int) -> str:
    line = command(pid)
    if line.split(" ", 1)[0].endswith("java"):
        return "JVM"
    if any(f"workers.{name}" in line for name in ("driver_process", "host_process", "standby_process")):
        return "Python driver"
    if "python_streaming_source_runner" in line:
        return "Python source runner"
    if any(module in line for module in START_ONLY):  # idle once the query runs; a driver of its own ends them
        return "Python start daemons"
    if "pyspark" in line and ("daemon" in line or "worker" in line):
        return "Python workers"
    return "other"


def batch_durations(run: Run) -> str:
    """The median and p90 of the run's batches that read events, its first minute left out (the JVM warming up)."""
    if run.started_at is None:
        return ""
    values = [
        float(ms)
        for ms in Checkpoint.objects.filter(
            job=run.job, committed_at__gte=run.started_at + timedelta(seconds=60), input_rows__gt=0
        ).values_list("duration_ms", flat=True)
    ]
    if not values:
        return ""
    return f"{statistics.median(values):,.0f} / {pct(values, 0.9):,.0f} ms ({len(values)})"


def main() -> None:
    runs = Run.objects.filter(status="running").exclude(pid=None).select_related("job").order_by("job__name")
    by_process: dict[int, list[str]] = collections.defaultdict(list)  # a shared driver's process runs several jobs
    for run in runs:
        by_process[int(run.pid or 0)].append(run.job.name)
    print("PSS MiB (processes); a driver's total is its whole tree, and a shared driver's is divided among its jobs\n")
    print(f"| jobs | {' | '.join(KINDS)} | total PSS | total RSS | a job (PSS) | batch median / p90 |\n"
          f"|---|{'---:|' * (len(KINDS) + 4)}")  # fmt: skip
    behind: dict[int, list[str]] = {}  # processes that stand behind jobs: no job of their own yet
    for host in DriverHost.objects.filter(status=HostStatus.SPARE).exclude(pid=None):
        warm = "warm queries on" if settings.SPARE_WARM_QUERIES else "warm queries off"
        behind[int(host.pid or 0)] = [f"(spare shared driver #{host.id}, {warm})"]
    for standby in StandbyDriver.objects.filter(status__in=LIVE).exclude(pid=None).select_related("job"):
        behind[int(standby.pid or 0)] = [f"(standby of {standby.job.name})"]
    durations = {run.job.name: batch_durations(run) for run in runs}
    for root, names in [*by_process.items(), *behind.items()]:
        pss: collections.Counter[str] = collections.Counter()
        count: collections.Counter[str] = collections.Counter()
        rss = 0
        for pid in process_tree(root):
            try:
                p, r = sizes(pid)
                k = kind(pid)
            except OSError:
                continue  # ended meanwhile
            pss[k] += p
            count[k] += 1
            rss += r
        cells = [f"{pss[k] // 1024} ({count[k]})" if count[k] else "–" for k in KINDS]
        total = sum(pss.values()) // 1024
        batches = " · ".join(durations[name] for name in names if durations.get(name))
        print(f"| {', '.join(names)} | {' | '.join(cells)} | {total} | {rss // 1024} | {total // len(names)} "
              f"| {batches or '–'} |")  # fmt: skip


if __name__ == "__main__":
    main()
