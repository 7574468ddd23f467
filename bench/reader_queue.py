"""A savepoint's verification in the warm state reader, alone and while the reader repartitions another copy.

    ./bin/dev &                                      # then, once it says it is running:
    STATEKEEPER_ENV=development .venv/bin/python -m bench.reader_queue [--rounds 5] [--job orders-rocksdb]

Attaches to the running console's state reader (starting it when none listens) and copies the job's checkpoint at
its newest committed batch twice per round. Each round: a verification of one copy over the reader's socket, as the
console's synchronous reads ask, alone; then a repartition of the other copy left in the reader's spool, as a
rescale's step leaves it, and the same verification asked a moment after it. Prints the verification's time alone
and asked just after the repartition, and the repartition's own time (asked to answered). The reader answers the
repartition in its lane for long requests and the verification beside it; before the lanes (one request at a time)
the verification waited for the repartition (five actions at once on the demo stack: a savepoint's verification
behind another job's rescale).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
os.environ.setdefault("STATEKEEPER_ENV", "development")  # a local measurement

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402

from dashboard.checkpoint_dir.files import copy_checkpoint, latest_committed  # noqa: E402
from dashboard.models import Job  # noqa: E402
from dashboard.services.state_reader_client import _ask, state_reader_warm, state_reader_warmed  # noqa: E402
from statekeeper.polling import wait_for  # noqa: E402


def verify(path: Path, batch: int) -> float:
    began = time.monotonic()
    answer = _ask(settings.STATE_READER_SOCKET, {"command": "verify", "path": str(path), "number": batch}, 600)
    if "error" in answer:
        raise SystemExit(f"the verification failed: {answer['error']}")
    return time.monotonic() - began


def taken(request: Path) -> bool:
    return not request.exists()


def answer_time(answer: Path, answered: list[float]) -> None:
    """When ``answer`` appears (looked for every 10 ms), into ``answered``."""
    wait_for(answer.exists, 600, 0.01, "the repartition's answer")
    answered.append(time.monotonic())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--job", default="orders-rocksdb", help="a running job on RocksDB")
    args = parser.parse_args()
    job = Job.objects.get(name=args.job)
    state_reader_warm()
    wait_for(state_reader_warmed, 300, 0.5, "the state reader to warm up")
    spool = settings.STATE_READER_SOCKET.with_suffix(".spool")
    spool.mkdir(mode=0o700, parents=True, exist_ok=True)
    alone, beside, repartitions = [], [], []
    scratch = Path(tempfile.mkdtemp(prefix="reader-queue-", dir=settings.CHECKPOINT_ROOT))
    try:
        for n in range(args.rounds):
            batch = latest_committed(job.checkpoint_location)
            checked, moved = scratch / f"verify-{n}", scratch / f"repartition-{n}"
            copy_checkpoint(job.checkpoint_location, checked, batch, batch_only=True)
            copy_checkpoint(job.checkpoint_location, moved, batch)
            alone.append(verify(checked, batch))
            request = spool / f"bench-queue-{os.getpid()}-{n}.request"
            partitions = 6 if job.state_partitions == 4 else 4
            request.with_suffix(".writing").write_text(
                json.dumps({"command": "repartition", "path": str(moved), "number": partitions})
            )
            asked = time.monotonic()
            request.with_suffix(".writing").rename(request)
            answer = request.with_suffix(".answer")
            answered: list[float] = []
            watcher = threading.Thread(target=answer_time, args=(answer, answered), daemon=True)
            watcher.start()
            wait_for(partial(taken, request), 60, 0.05, "the reader to take the repartition")
            beside.append(verify(checked, batch))
            watcher.join(600)
            repartitions.append(answered[0] - asked)
            if "error" in (found := json.loads(answer.read_text())):
                raise SystemExit(f"the repartition failed: {found['error']}")
            answer.unlink()
            print(f"  round {n + 1}: verification alone {alone[-1]:.2f} s, beside the repartition "
                  f"{beside[-1]:.2f} s; the repartition {repartitions[-1]:.2f} s; load {os.getloadavg()[0]:.1f}",
                  flush=True)  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\n{os.cpu_count()} cores; load average at the end {os.getloadavg()[0]:.1f}\n")
    print("| measure | each | median |\n|---|---|---:|")
    for label, values in (
        ("verification alone", alone),
        ("verification asked just after a repartition", beside),
        ("the repartition, asked → answered", repartitions),
    ):
        print(f"| {label} | {', '.join(f'{v:.2f}' for v in values)} | {statistics.median(values):.2f} s |")


if __name__ == "__main__":
    main()
