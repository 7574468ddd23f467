"""A blue/green upgrade's new version ("green") in its driver (dashboard/services/blue_green.py starts and hands
over).

Green is a query beside the job's ("blue"), on a fork of blue's checkpoint, with the new pipeline, parameters or state
partitions. Its source follows blue's checkpoint (``BatchFollower``): each green batch reads exactly the offsets of
blue's batch of that number, once blue has committed it. Until the handover green holds no lease and writes no sink:
its results are compared with what blue wrote for the same batch (``GreenBatch``: rows added, removed, changed).

The handover is one transaction of the console's: the lease's token moves to green's run (blue is fenced from then on:
every sink refuses its token), the job's checkpoint directory becomes green's fork, and the run records ``handover``,
the last batch blue had committed. Green's batches after it go to the job's sinks with the new token. A batch blue had
in flight at the handover is the same batch number for green: the sinks see another lineage (another code, or
another offsets file) and replace blue's output of it with green's, as they do after a restore.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError, connection, transaction
from django.utils import timezone
from pyspark.sql import DataFrame
from statekeeper_sdk import Pipeline, Rejected

from dashboard.engine.sinks import Fenced
from dashboard.green_order import report, reported, reports_checked
from dashboard.models import GreenBatch, ResultRow, ResultUndo, Run, RunStatus
from dashboard.records import is_commit
from dashboard.services.enqueue import job_actions_wake
from workers.progress import ProgressRecorder
from workers.sink import CHUNK, _storable, output_rows, persisted, results_rows

log = logging.getLogger("statekeeper.green")
SAMPLES = 5  # rows that differ kept per batch, to show


BOOT_WAIT_SECONDS = 1800  # green's driver of its own, up before its fork, waits this long for the upgrade's word


def wait_for_fork(run_id: int, job_id: int) -> bool:
    """Green's driver of its own, started before the savepoint its fork is made from (the console's ``_boot``): say
    its Spark is up (``green["up"]``, and wake the upgrade's step), then wait for the word to start (``green["go"]``,
    with the fork and what it runs): True then; False when the run is no longer green (aborted) or no word came in
    BOOT_WAIT_SECONDS (the run is then failed with the reason)."""
    if Run.objects.filter(id=run_id, status=RunStatus.GREEN).exists():
        report(run_id, up=timezone.now().isoformat())
    else:
        return False
    job_actions_wake(job_id)
    log.info("green run %s: Spark is up; waiting for the fork to start on", run_id)
    deadline = time.monotonic() + BOOT_WAIT_SECONDS
    while time.monotonic() < deadline:
        row = Run.objects.filter(id=run_id).values_list("status", "green").first()
        if row is None or row[0] != RunStatus.GREEN:
            return False
        if reported(row[1] or {}, "go"):
            return True
        time.sleep(0.1)
    Run.objects.filter(id=run_id, status=RunStatus.GREEN).update(
        status=RunStatus.FAILED, ended_at=timezone.now(),
        message=f"Green's driver was up and waited {BOOT_WAIT_SECONDS} s for its fork; the upgrade never said.",
    )  # fmt: skip
    return False


def is_the_jobs(state: tuple[str, int, int | None], batch_id: int) -> bool:
    """Whether green's batch ``batch_id`` goes to the job's sinks: green has taken over (running, with a token),
    after an earlier batch."""
    status, token, after = state
    return status == RunStatus.RUNNING and bool(token) and after is not None and batch_id > after


class GreenState:
    """What green's run says now: still beside blue, handed over (with the token and the batch it took over after),
    or ended (aborted). Read from the database once per batch and once per lease renewal."""

    def __init__(self, run_id: int) -> None:
        self.run_id = run_id
        self.sink_problems: list[str] = []  # as last noted on the run (a new green run starts with none)

    def read(self) -> tuple[str, int, int | None]:
        return self._parsed(Run.objects.filter(id=self.run_id).values_list("status", "fencing_token", "green").first())

    @staticmethod
    def _parsed(row: tuple[str, int | None, dict[str, Any] | None] | None) -> tuple[str, int, int | None]:
        """Green's status, the token the handover gave it (0 before) and the batch it took over after (None)."""
        if row is None:
            return "gone", 0, None
        status, token, green = row
        after = (green or {}).get("handover")
        return str(status), int(token or 0), int(after) if after is not None else None

    def decide(self, batch_id: int) -> tuple[str, int, int | None]:
        """What green's batch ``batch_id`` is, read as its writer begins: the job's (handed over after an earlier
        batch, ``is_the_jobs``) or a shadow. A shadow is recorded on the run (``green["shadowing"]``) under its row's
        lock, which the handover takes too: either the handover came first, and the batch is the job's, or it sees
        the shadow and takes over after that batch (``dashboard.services.blue_green.handover_point``)."""
        with transaction.atomic():
            row = (
                Run.objects.select_for_update().filter(id=self.run_id)
                .values_list("status", "fencing_token", "green").first()
            )  # fmt: skip
            status, token, after = state = self._parsed(row)
            green = (row[2] if row else None) or {}
            shadow = status in (RunStatus.GREEN, RunStatus.RUNNING) and not is_the_jobs(state, batch_id)
            if shadow and batch_id > (reported(green, "shadowing") or -1):
                Run.objects.filter(id=self.run_id).update(green={**green, **reports_checked(shadowing=batch_id)})
        return state

    def note_sinks(self, problems: list[str]) -> None:
        """The job's sinks that the new version could not write at its last try (empty: it could), on the run for
        the upgrade's steps: no handover while there is one (dashboard/services/blue_green.py: ``_follow``)."""
        if problems == self.sink_problems:  # this process alone notes them: no change, no write
            return
        report(self.run_id, sink_problems=problems)
        self.sink_problems = problems


class GreenLease:
    """No lease until the handover, then the token the handover gave green's run, renewed as any driver's. A run
    that stops being green without a handover (an abort, a failure) stops the query. Mixed into the driver's lease
    classes (``workers.driver.GreenJobLease``, ``GreenKeeper``), which renew it."""

    token: int
    reason: str
    lost: threading.Event

    def green_setup(self, run_id: int) -> None:
        """Before the lease is renewed: green's run to read, and what to do once it takes over (the driver sets
        ``on_live`` when its query starts)."""
        self.state = GreenState(run_id)
        self.live = threading.Event()
        self.after: int | None = None
        self.on_live: Callable[[], None] = lambda: None

    def go_live(self, token: int, after: int | None) -> None:
        if self.live.is_set():
            return
        self.token, self.after = token, after
        self.live.set()
        log.info("green run %s: handed over after batch %s, token %s", self.state.run_id, after, token)
        try:
            self.on_live()
        except Exception:
            log.exception("green run %s: what follows the handover failed", self.state.run_id)

    def renew(self) -> bool:
        if self.live.is_set() or self.lost.is_set():
            return bool(super().renew())  # type: ignore[misc]
        try:
            status, token, after = self.state.read()
        except DatabaseError:
            return True
        if status == RunStatus.RUNNING and token:
            self.go_live(token, after)
            return bool(super().renew())  # type: ignore[misc]
        if status == RunStatus.GREEN:
            return True
        self.reason = f"the blue/green upgrade ended its new version before a handover (run {status})"
        self.lost.set()
        threading.Thread(target=self._stop_queries, name="green-stop", daemon=True).start()  # type: ignore[attr-defined]
        return False


def blue_output(job_id: int, batch_id: int) -> dict[tuple[str, str], Any]:
    """What blue's batch ``batch_id`` wrote to the results table: the rows it last wrote, and, for a key a later batch
    changed again, the value that batch found (``ResultUndo``: the value before the later batch, written by this one)."""
    out = {(kind, key): value for kind, key, value in
           ResultRow.objects.filter(job_id=job_id, batch_id=batch_id).values_list("kind", "key", "value")}  # fmt: skip
    later = ResultUndo.objects.filter(job_id=job_id, prior_batch=batch_id, batch_id__gt=batch_id).order_by("-batch_id")
    for kind, key, value in later.values_list("kind", "key", "value"):
        out[(kind, key)] = value  # the earliest later batch's record comes last, and wins
    return out


def diff(blue: dict[tuple[str, str], Any], green: dict[tuple[str, str], Any]) -> dict[str, Any]:
    counts = {"added": 0, "removed": 0, "changed": 0, "same": 0}
    samples: list[dict[str, Any]] = []
    for key in sorted(blue.keys() | green.keys()):
        if key not in blue:
            what = "added"
        elif key not in green:
            what = "removed"
        else:
            what = "same" if blue[key] == green[key] else "changed"
        counts[what] += 1
        if what != "same" and len(samples) < SAMPLES:
            samples.append({"change": what, "kind": key[0], "key": key[1][:200],
                            "before": blue.get(key), "after": green.get(key)})  # fmt: skip
    return counts | {"samples": samples}


def green_writer(
    *, action_id: int, job_id: int, run_id: int, pipeline: Pipeline, lease: GreenLease,
    live: Callable[[int], Callable[[DataFrame, int], None]], close_connection: bool, shift: int = 0, base: int = 0,
) -> Callable[[DataFrame, int], None]:  # fmt: skip
    """Green's foreachBatch: until the handover each batch is compared with blue's (the shadow), after it each batch
    goes to the job's sinks through ``live(token)``, the writer any driver of the job uses. ``shift``: how far green's
    batch numbers run ahead of blue's (1 after a rescale's repartition); ``base``: the sinks' number of green's batch
    0 (its checkpoint's lineage), so that green's batch n is compared with what blue wrote as the sinks' base + n, and
    recorded (``GreenBatch``) under blue's number for it, n - shift."""
    writers: dict[int, Callable[[DataFrame, int], None]] = {}
    probes: list[Any] = []  # the job's sinks as the new version would write them, bound to its parameters

    def write(frame: DataFrame, batch_id: int) -> None:
        try:
            status, token, after = state = lease.state.decide(batch_id)
            if is_the_jobs(state, batch_id):
                lease.go_live(token, after)
                if token not in writers:
                    writers[token] = live(token)
                writers[token](frame, batch_id)
            elif status == RunStatus.GREEN or status == RunStatus.RUNNING:
                shadow(frame, batch_id)
            else:
                raise Fenced(f"green run {run_id} is {status}: not running batch {batch_id}")
        finally:
            if close_connection:
                connection.close()

    def shadow(frame: DataFrame, batch_id: int) -> None:
        # the new version's sinks tried at each batch, without writing: a target it cannot write (a new table's grants,
        # a directory it may not create) holds the handover back, and is found before the job's output moves to it
        if not probes:
            probes.append(live(0).sinks)  # type: ignore[attr-defined]
        lease.state.note_sinks(probes[0].probe())
        rejected: list[Rejected] = []
        with persisted(frame):
            at_once = frame.count() <= CHUNK
            green = _storable(batch_id, results_rows(pipeline, output_rows(frame, at_once)), rejected)
        values = {key: json.loads(text) for key, text in green.items()}
        found = diff(blue_output(job_id, base + batch_id), values)
        GreenBatch.objects.update_or_create(
            action_id=action_id, batch_id=batch_id - shift,
            defaults={"output_rows": len(values), "added": found["added"], "removed": found["removed"],
                      "changed": found["changed"], "same": found["same"], "samples": found["samples"]},
        )  # fmt: skip

    return write


class GreenRecorder(ProgressRecorder):
    """Green's progress: before the handover its batches are blue's, already in the job's history, so they only
    complete their ``GreenBatch`` (duration, input rows); after it they are the job's, recorded as any run's."""

    def green_setup(self, action_id: int, lease: GreenLease, shift: int = 0) -> None:
        self.action_id, self.lease, self.shift = action_id, lease, shift

    def on_progress(self, progress: dict[str, Any]) -> dict[str, Any] | None:
        batch = progress.get("batchId")
        after = self.lease.after
        if self.lease.live.is_set() and after is not None and isinstance(batch, int) and batch > after:
            return super().on_progress(progress)
        if isinstance(batch, int):
            durations = progress.get("durationMs") or {}
            GreenBatch.objects.filter(action_id=self.action_id, batch_id=batch - self.shift).update(
                duration_ms=int(durations.get("triggerExecution") or 0),
                input_rows=int(progress.get("numInputRows") or 0),
            )
            if is_commit(progress):  # the handover's moment may be now: green has committed what blue had but one
                job_actions_wake(self.job_id)
        return None
