"""A Spark JVM's start with the class archive against without, paired round by round (workers/spark/class_archive.py).

    .venv/bin/python -m bench.jvm_start [--rounds 5]

Each round starts a driver's SparkSession (``build_session``, local[1], RocksDB settings, as a driver of its own) in a
new process twice, once with ``STATEKEEPER_CLASS_ARCHIVE=off`` and once on, in turn, and times the session's start
and its first job (a count of ten rows: the first use of the scheduler, the executor and code generation), and reads
the JVM's memory (RSS and PSS, from /proc) after it. The archive must have been made (bin/dev or bin/test make it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ONE = """
import json, os, sys, time
from workers.spark.session import build_session
began = time.monotonic()
spark = build_session("bench-jvm-start", "local[1]", backend="rocksdb")
up = time.monotonic()
spark.range(10).count()
done = time.monotonic()
pid = spark.sparkContext._gateway.proc.pid
with open(f"/proc/{pid}/smaps_rollup") as f:
    fields = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split(":")[0] in ("Rss", "Pss")}
print(json.dumps({"session": up - began, "first_job": done - up, "rss": fields["Rss"] / 1024, "pss": fields["Pss"] / 1024}))
spark.stop()
"""


def once(archive: str) -> dict[str, float]:
    env = {**os.environ, "STATEKEEPER_CLASS_ARCHIVE": archive}
    done = subprocess.run([sys.executable, "-c", ONE], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the JVM did not start ({archive}): {done.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def main() -> None:
    from workers.spark.class_archive import archive_options, archive_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not archive_options():
        raise SystemExit(
            f"no class archive at {archive_path()}: make it first (python -m workers.spark.make_class_archive)"
        )
    rows: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for n in range(args.rounds):
        for archive in ("off", "on"):
            rows[archive].append(once(archive))
        print(f"round {n + 1}: " + "; ".join(f"{a} {rows[a][-1]['session']:.1f} + {rows[a][-1]['first_job']:.1f} s"
                                              for a in rows), flush=True)  # fmt: skip
    load = os.getloadavg()[0]
    print(f"\n{os.cpu_count()} cores, load average {load:.1f} at the end; medians of {args.rounds} rounds\n")
    print("| a driver's JVM (local[1]) | without the archive | with it | ratio |\n|---|---:|---:|---:|")
    for key, label, unit in (("session", "SparkSession started", "s"), ("first_job", "its first job", "s"),
                             ("rss", "JVM RSS after it", "MiB"), ("pss", "JVM PSS after it (alone)", "MiB")):  # fmt: skip
        off = statistics.median(r[key] for r in rows["off"])
        on = statistics.median(r[key] for r in rows["on"])
        print(f"| {label} | {off:.1f} {unit} | {on:.1f} {unit} | {on / off:.2f} |")
    both = [r["session"] + r["first_job"] for r in rows["on"]], [r["session"] + r["first_job"] for r in rows["off"]]
    print(
        f"| **start to its first job** | **{statistics.median(both[1]):.1f} s** | **{statistics.median(both[0]):.1f} s**"
        f" | {statistics.median(both[0]) / statistics.median(both[1]):.2f} |"
    )


if __name__ == "__main__":
    main()
