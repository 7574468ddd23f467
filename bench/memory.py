"""Where a running job's memory goes, process by process: each running job's driver process tree (the Python driver,
its JVM, the Python source runner, the Python daemon and its workers), proportional set size (PSS: shared pages
divided among their users) and resident size, in MiB, read from /proc.

    STATEKEEPER_ENV=development .venv/bin/python -m bench.memory

Run it beside ./bin/dev (the demo jobs running a few minutes). STATEKEEPER_DRIVER_MEMORY and
STATEKEEPER_DRIVER_JAVA_OPTIONS, set when bin/dev starts, size the drivers' JVMs. The processes that stand behind the
jobs are listed too: the spare shared driver (STATEKEEPER_SPARE_WARM_QUERIES says whether it runs warm queries) and
each job's own standby.
"""

from __future__ import annotations

import collections
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_ENV", "development")

import django  # noqa: E402

django.setup()

from bench.database import migrated  # noqa: E402
from bench.procs import command, process_tree, sizes  # noqa: E402

migrated()

from django.conf import settings  # noqa: E402

from dashboard.models import DriverHost, HostStatus, Run, StandbyDriver  # noqa: E402
from dashboard.services.standby import LIVE  # noqa: E402

KINDS = ("JVM", "Python driver", "Python source runner", "Python workers", "other")


def kind(pid: int) -> str:
    line = command(pid)
    if line.split(" ", 1)[0].endswith("java"):
        return "JVM"
    if any(f"workers.{name}" in line for name in ("driver_process", "host_process", "standby_process")):
        return "Python driver"
    if "python_streaming_source_runner" in line:
        return "Python source runner"
    if "pyspark" in line and ("daemon" in line or "worker" in line):
        return "Python workers"
    return "other"


def main() -> None:
    runs = Run.objects.filter(status="running").exclude(pid=None).select_related("job").order_by("job__name")
    by_process: dict[int, list[str]] = collections.defaultdict(list)  # a shared driver's process runs several jobs
    for run in runs:
        by_process[int(run.pid or 0)].append(run.job.name)
    print("PSS MiB (processes); a driver's total is its whole tree, and a shared driver's is divided among its jobs\n")
    print(f"| jobs | {' | '.join(KINDS)} | total PSS | total RSS | a job (PSS) |\n|---|{'---:|' * (len(KINDS) + 3)}")
    behind: dict[int, list[str]] = {}  # processes that stand behind jobs: no job of their own yet
    for host in DriverHost.objects.filter(status=HostStatus.SPARE).exclude(pid=None):
        warm = "warm queries on" if settings.SPARE_WARM_QUERIES else "warm queries off"
        behind[int(host.pid or 0)] = [f"(spare shared driver #{host.id}, {warm})"]
    for standby in StandbyDriver.objects.filter(status__in=LIVE).exclude(pid=None).select_related("job"):
        behind[int(standby.pid or 0)] = [f"(standby of {standby.job.name})"]
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
        print(f"| {', '.join(names)} | {' | '.join(cells)} | {total} | {rss // 1024} | {total // len(names)} |")


if __name__ == "__main__":
    main()
