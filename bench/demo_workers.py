"""The CPU of Spark's Python workers on a running stack (``./bin/dev``, its jobs running), per batch its jobs commit:
every ``pyspark.worker`` process (the daemons, the workers they fork, and those that ended in the window).

    STATEKEEPER_ENV=development .venv/bin/python -m bench.demo_workers [--window 90]

Reads /proc and the console's database; starts nothing and stops nothing, so it can run beside the demo stack (the
benchmarks that start their own jobs end every shared driver in the database when they finish). The processes include
standbys' and the spare's warm queries, whose batches are not counted.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")

import django  # noqa: E402

django.setup()

from bench.procs import cpu_ticks  # noqa: E402
from dashboard.models import Checkpoint  # noqa: E402


def worker_ticks() -> int:
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"pyspark.worker" in (entry / "cmdline").read_bytes():
                _, own, children = cpu_ticks(entry / "stat")
                total += own + children
        except (OSError, IndexError, ValueError):
            continue
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=float, default=90)
    args = parser.parse_args()
    ticks, batches = worker_ticks(), Checkpoint.objects.count()
    time.sleep(args.window)
    seconds = (worker_ticks() - ticks) / os.sysconf("SC_CLK_TCK")
    committed = Checkpoint.objects.count() - batches
    print("| window | batches committed | pyspark.worker CPU | a batch | cores |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {args.window:g} s | {committed} | {seconds:.2f} s | {seconds / max(1, committed):.3f} s "
          f"| {seconds / args.window:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
