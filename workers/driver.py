"""A job's driver: one process, one SparkSession, one streaming query at a time (``python -m workers.driver_process
RUN_ID`` sets Django up and calls ``main``); after an upgrade's or a rescale's stop, the job's next run in the same
process (``workers/next_run.py``).

It runs only while it holds the checkpoint lease, renews it on a heartbeat, records every committed batch, and on a
stop request lets the batch in flight finish before it stops the query.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from django.conf import settings
from django.db import DatabaseError, connection
from django.db.models import QuerySet
from django.utils import timezone

from dashboard import pipelines
from dashboard.checkpoint_dir.files import (
    closing_file,
    follow_mirror,
    handover_file,
    lineage_base,
    mark_handed_over,
    planned_batch,
)
from dashboard.failures import describe, root_cause
from dashboard.green_order import GreenOrder, OrderError
from dashboard.models import Job, Run, RunStatus
from dashboard.selectors.cluster import cluster_cores, master_ui, waiting_for_cores
from dashboard.services.checkpoints import journal_path
from dashboard.services.deploys import deploy_record
from dashboard.services.lease import lease_renew
from dashboard.services.runs import run_finish, run_started
from dashboard.services.secrets import SecretError, redact_logs, reveal
from workers import green, job_lock
from workers.next_run import RestartReady, hand_over, offer, reuse_refusal, wait_for_next_run
from workers.progress import ProgressListener, ProgressRecorder, recording_thread
from workers.sink import batch_writer
from workers.spark.cluster import driver_conf, is_cluster, probe_executors
from workers.spark.fork_server import ForkServer, start_fork_server
from workers.spark.python_daemons import end_start_daemons
from workers.spark.query import JobSpec, rejected_records, start_query
from workers.spark.session import build_session, heap_after_gc, jvm_death, jvm_exit_after, jvm_exit_code, lean_jvm
from workers.warm_query import WarmQuery

log = logging.getLogger("statekeeper.driver")
FENCED_EXIT_SECONDS = 5  # a driver that lost its lease is gone this long after it notices, whatever hangs
SPARK_STOP_SECONDS = 20  # spark.stop() gets this long before the process ends without it


def hard_exit(code: int, why: str) -> None:
    """End the process now: no interpreter shutdown (py4j and Spark threads can hold it open for good)."""
    log.log(logging.INFO if code == 0 else logging.ERROR, "exiting (%s): %s", code, why)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def heap_fields(spark: Any) -> dict[str, int]:
    """A run's heap figures for its heartbeat's update: none when the JVM cannot say (the figures stay as they were)."""
    sample = heap_after_gc(spark) if spark is not None else None
    return {"heap_after_gc_bytes": sample[0], "heap_max_bytes": sample[1]} if sample else {}


class JobLease:
    """A job's checkpoint lease as its driver holds it: renewed by ``renew`` (from a LeaseKeeper thread of the driver's
    own, or a shared driver's main loop for all its jobs). Lost (another token holds it, it expired while the process
    was paused, or the database did not answer for a whole TTL), it stops the job's query once."""

    def __init__(self, job_id: int, token: int) -> None:
        self.job_id, self.token = job_id, token
        self.queries: list[Any] = []  # what a lost lease stops, once the driver has started it
        self.lost = threading.Event()
        self.done = threading.Event()
        self.reason = ""
        self.last_ok = time.monotonic()

    def renew(self) -> bool:
        """Renew once; False when the lease is lost (the query is being stopped then)."""
        if self.lost.is_set():
            return False
        try:
            if lease_renew(job_id=self.job_id, token=self.token):
                self.last_ok = time.monotonic()
                return True
            self.reason = "this driver lost the checkpoint lease (another driver holds it, or it expired)"
        except DatabaseError as exc:
            if time.monotonic() - self.last_ok < settings.LEASE_TTL_SECONDS:
                return True
            self.reason = f"the lease could not be renewed for {settings.LEASE_TTL_SECONDS} s ({exc})"
        self.lost.set()
        threading.Thread(target=self._stop_queries, name="fenced-stop", daemon=True).start()
        return False

    def _stop_queries(self) -> None:
        for query in self.queries:
            query.stop()


class LeaseKeeper(JobLease, threading.Thread):
    """Renews the lease from a thread of its own, also while the query drains or a batch runs long. The lease lost,
    it starts a watchdog that ends the process FENCED_EXIT_SECONDS later if it is still alive."""

    def __init__(self, job_id: int, token: int, exit_when_fenced: bool = True) -> None:
        JobLease.__init__(self, job_id, token)
        threading.Thread.__init__(self, name="lease-keeper", daemon=True)
        self.exit_when_fenced = exit_when_fenced

    def run(self) -> None:
        try:
            while not self.done.wait(settings.LEASE_RENEW_SECONDS):
                if self.renew():
                    continue
                if not self.done.wait(FENCED_EXIT_SECONDS) and self.exit_when_fenced:
                    hard_exit(3, f"fenced: {self.reason}; the query did not stop in {FENCED_EXIT_SECONDS} s")
                return
        finally:
            connection.close()


class GreenJobLease(green.GreenLease, JobLease):
    """A blue/green upgrade's new version's lease in a shared driver, whose main loop renews it."""


class GreenKeeper(green.GreenLease, LeaseKeeper):
    """A blue/green upgrade's new version's lease in a driver of its own, renewed from a thread."""


def job_session(job: Job, master: str) -> Any:
    """The SparkSession a job's driver or standby runs on: ``local[parallelism]``, or a cluster on which the job's
    parallelism is its executor cores; its JVM a lean one (``lean_jvm``), as this process runs the one job."""
    return build_session(
        f"statekeeper-{job.name}",
        master,
        backend=job.state_backend,
        partitions=job.state_partitions,
        batches_retained=job.batches_retained,
        extra={
            **lean_jvm(job.state_backend),
            **pipelines.get(job.pipeline).conf,
            **driver_conf(master, job.parallelism, str(settings.BASE_DIR)),
        },
    )


def cluster_probe(spark: Any, master: str, parallelism: int) -> tuple[list[str], str]:
    """On a cluster, the hosts of the job's executors and why the job must not start there (empty when it may): its
    executors must see the checkpoint root the console writes, or they would write state where no restart, savepoint
    or inspector finds it. Nothing to probe in local mode."""
    if not is_cluster(master):
        return [], ""
    try:
        return probe_executors(spark, settings.CHECKPOINT_ROOT, parallelism)
    except Exception as exc:
        return [], f"the cluster at {master} could not run a task: {root_cause(str(exc))}"


class CoresWatch(threading.Thread):
    """While a job on a cluster waits for its executors (the master has no free cores: Spark's driver only logs
    "Initial job has not accepted any resources"), its starting run says so, with the cluster's cores and who holds
    them, where on-call looks: the job's status and page, the API, and an alert after a while."""

    EVERY = 5.0
    WHO = "the job"  # who asks for the cores, in the message

    def __init__(self, run_id: int, master: str, app_id: str, wanted: int) -> None:
        super().__init__(name="cores-watch", daemon=True)
        self.run_id, self.ui, self.app_id, self.wanted = (
            run_id,
            master_ui(master, settings.SPARK_MASTER_UI),
            app_id,
            wanted,
        )
        self.cluster = is_cluster(master)
        self.done = threading.Event()
        self.said = ""

    def run(self) -> None:
        try:
            while self.cluster and not self.done.wait(self.EVERY):
                cores = cluster_cores(self.ui)
                reason = waiting_for_cores(cores, self.app_id, self.wanted, self.WHO) if cores else ""
                if reason != self.said:
                    self._say(reason)
        finally:
            if self.said:
                self._say("")
            connection.close()

    def starting(self) -> QuerySet[Run]:
        """The runs that wait with this application."""
        return Run.objects.filter(id=self.run_id, status__in=(RunStatus.PENDING, RunStatus.STARTING))

    def _say(self, reason: str) -> None:
        self.starting().update(message=reason)
        self.said = reason
        if reason:
            log.warning("%s", reason)

    def stop(self) -> None:
        self.done.set()
        if self.is_alive():
            self.join(10)


def job_spec(job: Job, **overrides: Any) -> JobSpec:
    """What a driver runs for ``job``, as plain values; ``overrides`` replace any of them."""
    return JobSpec(**(job.run_values() | overrides))


START_GATE_SECONDS = 30.0  # a query holds its shared driver's start gate until its first commit, or this long
STOP_LOOK_SECONDS = 0.25  # how often a driver of its own looks for a stop request
CLOSING_WAIT_SECONDS = 2.0  # a spread source polls every 0.25-0.5 s: it sees a stopping driver's ask by then


class JobDriver:
    def __init__(
        self,
        spark: Any,
        run_id: int,
        keeper: JobLease | None = None,
        executor_hosts: list[str] | None = None,
        shared: bool = False,
        phase_seconds: float | None = None,
        code: pipelines.CodeVersion | None = None,
        on_phase: Callable[[float | None], None] | None = None,
        lean: bool = False,
        reusable: bool = False,
        start_gate: threading.Semaphore | None = None,
        on_first_batch: Callable[[], None] | None = None,
        forks: ForkServer | None = None,
    ) -> None:
        """``keeper``: the lease keeper the driver process started before its SparkSession (which takes longer to
        start than a lease lasts); without one (tests run the driver in a thread of theirs) the driver starts its own,
        which renews but never ends the process. ``shared``: the run is one of a shared driver's, whose main loop
        renews its lease, beats for it and sets ``stop_signal`` on a stop request, and whose threads hold no
        database connection between batches (many jobs, one connection limit). ``phase_seconds``: where in the trigger
        interval its batches start (the shared driver spreads its jobs; ``JobSpec.phase_seconds``), and ``on_phase`` is
        told the phase the query took (``start_query``). ``code``: the pipeline's code as the process loaded it, when
        it knows (a standby or shared driver, which imported it before the run); hashing it at the start costs a tenth
        of a second or more on the restart's critical path. ``lean``: the process runs this one query (a driver of its
        own, or a standby that took over), so the Python daemons Spark needs only while a query starts are ended once
        it runs (``python_daemons``). ``reusable``: a driver of its own that can run the job's next run after this one
        (``workers/next_run.py``): stopped for an upgrade or a rescale, it offers itself (``offered``). ``start_gate``:
        taken while the query starts, until its first batch is committed (or START_GATE_SECONDS): a shared driver on a
        cluster starts only a few queries at a time (``workers/host.py``). ``on_first_batch``: told once its query
        has committed a batch (a spare's takeover starts the jobs with standby on first). ``forks``: a reusable driver's
        fork server, started once its next run is expected (``RestartReady``)."""
        self.spark = spark
        self.keeper = keeper
        self.shared = shared
        self.lean = lean
        self.reusable, self.offered = reusable, False
        self.forks = forks
        self.restart_ready: RestartReady | None = None  # once its start's daemons are ended (``workers/next_run.py``)
        self.run = Run.objects.select_related("job").get(id=run_id)
        self.job = self.run.job
        self.token = int(self.run.fencing_token or 0)
        self.stop_signal = threading.Event()
        self.executor_hosts = executor_hosts or []  # where the job's executors run, on a cluster
        self.phase_seconds, self.on_phase = phase_seconds, on_phase
        self.spread = False  # its batches start at its phase (``start_query`` says, through ``_phase_taken``)
        self.code = code
        self.start_gate, self.gate_until = start_gate, 0.0  # gate_until: while it holds the gate
        self.on_first_batch = on_first_batch
        # a blue/green upgrade's new version (workers/green.py): this driver runs the job as green's run says, on its
        # fork, following the job's checkpoint until the handover
        self.green = GreenOrder.read(self.run.green) if self.run.status == RunStatus.GREEN else None
        self.on_live: Callable[[], None] | None = None  # told when green takes over (a shared driver takes the lock)
        if self.green:
            self.job = self.green.applied_to(self.job)
        self.shift = self.green.shift if self.green else 0  # green's batch numbers ahead of the job's (a rescale: 1)

    def execute(self) -> str:
        """Run the query until it is stopped or fails; returns the run's final status."""
        if not self.green and not lease_renew(job_id=self.job.id, token=self.token):
            run_finish(
                run_id=self.run.id,
                status=RunStatus.REFUSED,
                message="Refused: the lease passed to another driver before this one started.",
            )
            return RunStatus.REFUSED
        spec = job_spec(self.job, phase_seconds=self.phase_seconds)
        if self.green:  # its batches come as fast as the job committed them, then its source paces them
            spec = job_spec(
                self.job, phase_seconds=None, follow=self.green.follow,
                handover_file=str(handover_file(self.job.checkpoint_location)), follow_shift=self.shift,
                follow_mirror=str(follow_mirror(self.job.checkpoint_location)),
            )  # fmt: skip
        pipeline = pipelines.get(spec.pipeline)
        values = pipelines.parameter_values(spec.pipeline, json.loads(spec.parameters))
        try:
            revealed = reveal(values)  # for the sinks alone; the transform and the lineage digest keep the references
        except SecretError as exc:
            problems = [str(exc)]
        else:
            problems = pipelines.sink_problems(spec.pipeline, revealed)
        if problems:
            run_finish(
                run_id=self.run.id,
                status=RunStatus.FAILED,
                message=f"The job's output cannot be written: {'; '.join(problems)}"[:2000],
            )
            return RunStatus.FAILED
        code = self.code = self.code or pipelines.code_version(spec.pipeline)
        conf = {**spec.session_conf(), **pipeline.conf}
        if not self.green:
            deploy_record(run=self.run, spark_conf=conf, code=code)
        recorder = (green.GreenRecorder if self.green else ProgressRecorder)(
            job_id=self.job.id,
            run_id=self.run.id,
            checkpoint=self.job.checkpoint_location,
            journal=journal_path(job=self.job, run_id=self.run.id),
            redis_url=settings.REDIS_URL,
            stream=settings.PROGRESS_STREAM,
            live=settings.LIVE_STREAM,
        )
        listener = ProgressListener(recorder)
        listener.on_first_batch = self.on_first_batch
        rejected = None if self.green else rejected_records(self.spark, spec, pipeline)
        if rejected is not None:  # checked in the JVM: the dead letters are written after each batch
            listener.watchers.append(rejected.on_progress)
        self.spark.streams.addListener(listener)
        keeper = self.keeper or (
            self._green_keeper() if self.green else LeaseKeeper(self.job.id, self.token, exit_when_fenced=False)
        )

        def sinks(token: int) -> Callable[[Any, int], None]:
            return batch_writer(
                job_id=self.job.id, token=token, pipeline=pipeline, dead_letters=spec.dead_letter,
                redis_url=spec.redis_url, job_name=self.job.name, checkpoint=spec.checkpoint, parameters=values,
                sink_parameters=revealed, code=code.code_hash, close_connection=self.shared,
            )  # fmt: skip

        self.keeper = keeper
        writer = sinks(self.token)
        if self.green:
            assert isinstance(keeper, green.GreenLease) and isinstance(recorder, green.GreenRecorder)
            if not hasattr(keeper, "state"):
                keeper.green_setup(self.run.id)
            keeper.on_live = lambda: self._went_live(conf, code)
            recorder.green_setup(self.green.action, keeper, self.shift)
            writer = green.green_writer(
                action_id=self.green.action, job_id=self.job.id, run_id=self.run.id, pipeline=pipeline,
                lease=keeper, live=sinks, close_connection=self.shared, shift=self.shift,
                base=lineage_base(self.job.checkpoint_location),
            )  # fmt: skip
        if isinstance(keeper, LeaseKeeper) and not keeper.is_alive():
            keeper.start()
        try:
            self._gate_take()
            if rejected is not None:
                rejected.start()
            real_time_sink = pipeline.outputs(revealed)[0] if spec.real_time else None
            query = start_query(self.spark, spec, pipeline, writer, self._phase_taken, real_time_sink)
            keeper.queries.append(query)
            listener.query_id = str(query.id)
            if keeper.lost.is_set():  # lost while starting: stop before the first batch
                query.stop()
            if self.green:
                Run.objects.filter(id=self.run.id, status=RunStatus.GREEN).update(
                    started_at=timezone.now(), last_heartbeat_at=timezone.now()
                )
            else:
                run_started(run_id=self.run.id, executors=self.executor_hosts)
            return self._watch(query, keeper)
        except Exception as exc:
            if (exit_code := jvm_exit_after(self.spark, exc)) is not None:  # killed: the shared driver's runs are lost
                return self._jvm_gone(exit_code)
            trace = traceback.format_exc()
            run_finish(
                run_id=self.run.id,
                status=RunStatus.FAILED,
                message=f"The query could not start: {root_cause(trace)}"[:2000],
                error=trace,
            )
            return RunStatus.FAILED
        finally:
            self._gate_give()
            keeper.done.set()
            if jvm_exit_code(self.spark) is None:
                time.sleep(0.5)  # let the listener bus deliver the last progress event before the listener goes
                self.spark.streams.removeListener(listener)
            recording_thread().drain()  # and the last record be made before the run's end is recorded
            if rejected is not None and jvm_exit_code(self.spark) is None:
                rejected.stop()

    def _phase_taken(self, phase: float | None) -> None:
        self.spread = phase is not None
        if self.on_phase is not None:
            self.on_phase(phase)

    def _gate_take(self) -> None:
        if self.start_gate is not None:
            self.start_gate.acquire()
            self.gate_until = time.monotonic() + START_GATE_SECONDS

    def _gate_give(self) -> None:
        if self.start_gate is not None and self.gate_until:
            self.gate_until = 0.0
            self.start_gate.release()

    def _green_keeper(self) -> LeaseKeeper:
        keeper = GreenKeeper(self.job.id, 0, exit_when_fenced=False)
        keeper.green_setup(self.run.id)
        return keeper

    def _went_live(self, conf: dict[str, str], code: pipelines.CodeVersion) -> None:
        """Green took over: the handover file for its source (the console wrote it too, unless it died first), the
        deploy it runs recorded as the job's, and what the process does for a driver of the job (its lock)."""
        if isinstance(after := getattr(self.keeper, "after", None), int):
            mark_handed_over(self.job.checkpoint_location, after)
        self.run.refresh_from_db()
        deploy_record(run=self.run, spark_conf=conf, code=code)
        if self.on_live is not None:
            self.on_live()

    def _jvm_gone(self, code: int) -> str:
        """Spark's JVM ended under the query. A driver of its own says why and fails the run (its restart strategy
        decides what next); in a shared driver the main loop ends the process, and the supervisor finds each of its
        runs lost with the shared driver's cause."""
        death = jvm_death(code, self.run.log_path, "STATEKEEPER_DRIVER_MEMORY")
        if self.shared:
            log.error("run %s: %s", self.run.id, death)
            return RunStatus.LOST
        run_finish(run_id=self.run.id, status=RunStatus.FAILED, message=f"The driver failed: {death}")
        return RunStatus.FAILED

    def _watch(self, query: Any, keeper: JobLease) -> str:
        # a driver of its own looks for a stop request every STOP_LOOK_SECONDS (an action that stops the job waits no
        # longer for it) and beats every LEASE_RENEW; a shared driver's main loop sets ``stop_signal`` at once
        look = settings.LEASE_RENEW_SECONDS if self.shared else STOP_LOOK_SECONDS
        beat_due = 0.0
        while True:
            self.stop_signal.wait(look if query.isActive else 0)
            # fenced: someone else may own the checkpoint now (the keeper stopped the query), or the query failed
            # because the lease is gone (the sink refused the stale token before the keeper noticed)
            if keeper.lost.is_set() or (not query.isActive and not keeper.renew()):
                run_finish(run_id=self.run.id, status=RunStatus.FAILED, message=f"Stopped: {keeper.reason} (fenced).")
                return RunStatus.FAILED
            if not query.isActive:
                error = query.exception()
                trace = failure_text(error) if error else ""
                message = (
                    describe(trace, planned_batch(self.job.checkpoint_location)) if error else "The query stopped."
                )
                if error and self.job.reads_kafka and self.job.source_stream not in message:
                    message += f" (reading Kafka topic {self.job.source_stream} on {self.job.source_path})"
                run_finish(run_id=self.run.id, status=RunStatus.FAILED, message=message[:2000], error=trace)
                return RunStatus.FAILED
            stop_at = None
            # asked of the JVM (a progress's JSON) only while a first commit is awaited
            committed = bool(self.gate_until or self.lean) and last_batch(query) is not None
            if self.gate_until and (committed or time.monotonic() > self.gate_until):
                self._gate_give()
            if self.lean and committed:
                self.lean = False  # once: the query has started, and its first batch is committed
                try:
                    end_start_daemons(self.spark)
                except Exception as exc:  # a Spark whose internals moved: the daemons idle on, nothing breaks
                    log.warning("the Python daemons of the query's start were left running: %s", exc)
                else:
                    self.restart_ready = RestartReady(self.spark, self.run, self.forks) if self.reusable else None
            if self.restart_ready is not None:
                self.restart_ready.look()
            if not self.shared:
                if time.monotonic() >= beat_due:
                    beat_due = time.monotonic() + settings.LEASE_RENEW_SECONDS
                    Run.objects.filter(id=self.run.id).update(
                        last_heartbeat_at=timezone.now(), **heap_fields(self.spark)
                    )
                stop_at = Run.objects.values_list("stop_requested_at", flat=True).get(id=self.run.id)
            if stop_at or self.stop_signal.is_set():
                if self.restart_ready is not None:  # an upgrade that took its preview's plan stops the job at once
                    self.restart_ready.look(now=True)
                message = self._drain_and_stop(query)
                self.offered = self.reusable and offer(self.run.id, self.job.id)
                run_finish(run_id=self.run.id, status=RunStatus.STOPPED, message=message)
                return RunStatus.STOPPED

    def _drain_and_stop(self, query: Any) -> str:
        """Wait for the batch in flight to commit, then stop before the next one gets far; what was done, for the run.

        A query that keeps up is between batches most of the time and stops there. One that is always behind its
        trigger starts its next batch as the last commits, so it is seen between batches only by chance: it stops as
        soon as the batch that was in flight at the request has committed, interrupting the next in its planning (the
        next run replays it from the offsets log, and the sink keeps each batch once)."""

        in_flight = last_batch(query)
        deadline = time.monotonic() + settings.STOP_GRACE_SECONDS
        if self.spread and not query.status.get("isTriggerActive"):
            self._last_batch_now()
        while query.status.get("isTriggerActive") and last_batch(query) == in_flight:
            if time.monotonic() >= deadline:
                query.stop()
                return (
                    f"Stopped on request: the batch in flight had not committed after {settings.STOP_GRACE_SECONDS} s, "
                    "so it was interrupted; the next run replays it."
                )
            time.sleep(0.05)
        query.stop()
        return "Stopped on request after the batch in flight committed."

    def _last_batch_now(self) -> None:
        """A spread query between batches: its source admits what has arrived since its last batch now rather than at
        the job's next phase (``closing_file``), so the stop comes right after a commit and the next run (an upgrade's,
        a rescale's) has only the time of its own start to catch up. Returns once the source has seen the ask (a batch
        is then being planned, or there was nothing new), or after CLOSING_WAIT_SECONDS."""
        closing = closing_file(Path(self.job.checkpoint_location))
        closing.write_text("")
        until = time.monotonic() + CLOSING_WAIT_SECONDS
        while closing.exists() and time.monotonic() < until:
            time.sleep(0.02)
        closing.unlink(missing_ok=True)


def failure_text(error: Any) -> str:
    """A failed query's exception as text with its Java causes, which PySpark keeps apart from its message: Spark's
    "[STREAM_FAILED] ... (no cause message)" says nothing of what failed, its innermost cause does (``root_cause``
    reads the "Caused by:" lines). A cause without a message is named by where it was thrown."""
    text = f"{error}\n{getattr(error, '_stackTrace', '') or ''}"
    cause, depth = getattr(error, "_cause", None), 0
    while cause is not None and depth < 8:
        if getattr(cause, "_origin", None) is not None:  # a class PySpark knows: its message alone in _desc
            name, message = type(cause).__name__, str(getattr(cause, "_desc", "") or "")
        else:  # any other: the Java exception's toString(), "class: message"
            name, _, message = str(getattr(cause, "_desc", None) or cause).partition(": ")
        frames = re.findall(r"^\s*at ([\w.$]+)\.([\w$<>]+)\(", str(getattr(cause, "_stackTrace", "") or ""), re.M)
        ours = next((f for f in frames if not f[0].startswith(("java.", "jdk.", "sun.", "scala."))), None)
        where = f"{ours[0].rsplit('.', 1)[-1]}.{ours[1]}" if ours else ""
        if not message:
            message = f"(no message) thrown in {where}" if where else ""
        elif where and name.strip().startswith(("java.io.", "java.net.")):  # "Connection reset" alone says not where
            message = f"{message.splitlines()[0]} (in {where})"
        text += f"\nCaused by: {name.strip()}{': ' + message.splitlines()[0] if message else ''}"
        cause, depth = getattr(cause, "_cause", None), depth + 1
    return text


def last_batch(query: Any) -> int | None:
    """The id of the query's last committed batch in this run, None before its first."""
    progress = query.lastProgress
    return None if progress is None else progress.batchId


def spark_stop(spark: Any) -> None:
    """Stop Spark, or end the process if that hangs: a driver whose run ended must not linger."""
    if jvm_exit_code(spark) is not None:
        return  # nothing to stop, and each call would wait on a gateway that is gone
    watchdog = threading.Timer(SPARK_STOP_SECONDS, hard_exit, (1, "spark.stop() did not return"))
    watchdog.daemon = True
    watchdog.start()
    spark.stop()
    watchdog.cancel()


def main(argv: list[str]) -> int:
    redact_logs()  # a secret revealed for the sinks is masked in whatever the driver logs
    run_id = int(argv[1])
    run = Run.objects.select_related("job").get(id=run_id)
    job = run.job
    log.info("driver for %s run %s (pid %s, token %s)", job.name, run_id, os.getpid(), run.fencing_token)
    is_green = run.status == RunStatus.GREEN
    held: list[Any] = []
    if is_green:  # no lease, nor lock, before the handover; the keeper starts with the query (JobDriver.execute)
        try:
            job = GreenOrder.read(run.green).applied_to(job)  # its Spark session is the new version's
        except OrderError as exc:
            run_finish(run_id=run_id, status=RunStatus.FAILED, message=f"Green's order cannot be read: {exc}")
            return 1
        green_keeper = GreenKeeper(job.id, 0)
        green_keeper.green_setup(run_id)
        keeper: LeaseKeeper = green_keeper
    else:
        keeper = LeaseKeeper(job.id, int(run.fencing_token or 0))  # renewing from now on: the JVM takes seconds
        keeper.start()
        try:  # held until the process ends: a standby waiting on it learns of this process's death at once
            held.append(job_lock.hold(job.id))
        except (TimeoutError, psycopg.Error) as exc:
            run_finish(run_id=run_id, status=RunStatus.FAILED, message=f"The driver lock could not be taken: {exc}")
            return 1
    master = settings.SPARK_MASTER or f"local[{job.task_slots}]"
    # its path in the JVM's environment from the start, the server itself started when a restart in this process is
    # expected (``RestartReady``): the query's Python processes start without their imports' time then
    forks = None if is_green or not settings.OWN_DRIVER_FORKS else start_fork_server(master, start=False)
    try:
        spark = job_session(job, master)
    except Exception as exc:
        run_finish(
            run_id=run_id, status=RunStatus.FAILED, message=f"Spark did not start: {exc}", error=traceback.format_exc()
        )
        return 1
    watch = CoresWatch(run_id, master, spark.sparkContext.applicationId, job.parallelism)
    watch.start()
    try:
        hosts, refusal = cluster_probe(spark, master, job.parallelism)
    finally:
        watch.stop()
    if refusal:
        run_finish(run_id=run_id, status=RunStatus.FAILED, message=f"Refused: {refusal}")
        spark_stop(spark)
        return 1
    if is_green and GreenOrder.read(run.green).boot and not _green_booted(spark, job, run):
        spark_stop(spark)  # aborted before its fork was made, or never told
        return 0
    driver = JobDriver(
        spark, run_id, keeper=keeper, executor_hosts=hosts, lean=True, reusable=not is_green, forks=forks
    )
    if is_green:  # once it took over, the job's lock, after the fenced driver let go of it
        driver.on_live = lambda: threading.Thread(
            target=lambda: held.append(job_lock.hold(job.id, within_seconds=300, grace_seconds=60)),
            name="green-lock", daemon=True,
        ).start()  # fmt: skip
    ending = threading.Event()  # SIGTERM: the run in hand stops; a driver waiting for the next run ends
    current = [driver]

    def on_term(*_: Any) -> None:
        current[0].stop_signal.set()
        ending.set()

    signal.signal(signal.SIGTERM, on_term)
    status = driver.execute()
    log.info("run %s ended: %s", run_id, status)
    while driver.offered:  # a SIGTERM meanwhile: the wait takes the offer back and ends
        _let_go(held)  # a new driver, if the restart goes to one, takes the job's lock at once
        next_id = wait_for_next_run(run_id, job.id, ending)
        if next_id is None:
            break
        ran, ran_backend, run_id = driver.code, job.state_backend, next_id
        job = Job.objects.get(id=job.id)
        why, code = reuse_refusal(job.pipeline, job.state_backend, ran, ran_backend)
        if why:
            hand_over(run_id, why)
            break
        driver = current[0] = JobDriver(
            spark, run_id, executor_hosts=hosts, code=code, lean=True, reusable=True, forks=forks
        )
        status = _run_next(spark, driver, master, held)
        log.info("run %s ended: %s", run_id, status)
    spark_stop(spark)
    _let_go(held)
    if forks is not None:
        forks.close()
    return 0 if status == RunStatus.STOPPED else 1


def _green_booted(spark: Any, job: Job, run: Run) -> bool:
    """Green's driver of its own, started before the savepoint it forks from: the new version's query warmed up on
    generated events first (a first query in a new JVM took 40 s for its first batch on a busy host, which green then
    had to catch up on), then the wait for the fork (``green.wait_for_fork``). Whether to run green. ``job`` is
    green's (``GreenOrder.applied_to``)."""
    warm = None
    try:
        warm = WarmQuery(spark, job, f"green-{run.id}")
        warm.start()
    except Exception as exc:  # green runs all the same, its first batch cold
        log.warning("green run %s: the warm-up failed (%s); green's first batch runs cold", run.id, exc)
    try:
        return green.wait_for_fork(run.id, job.id)
    finally:
        if warm is not None:
            try:
                warm.stop()
            except Exception as exc:
                log.warning("green run %s: its warm query did not stop cleanly: %s", run.id, exc)


def _run_next(spark: Any, driver: JobDriver, master: str, held: list[Any]) -> str:
    """The job's next run in this process (``workers/next_run.py``): its lock and lease taken as a new driver's are,
    the job's current Spark settings applied to the session (a rescale's state partitions), then its query."""
    job = driver.job
    log.info(
        "driver for %s run %s (pid %s, token %s): the same process", job.name, driver.run.id, os.getpid(), driver.token
    )
    try:
        held.append(job_lock.hold(job.id))
    except (TimeoutError, psycopg.Error) as exc:
        run_finish(run_id=driver.run.id, status=RunStatus.FAILED, message=f"The driver lock could not be taken: {exc}")
        return RunStatus.FAILED
    driver.keeper = LeaseKeeper(job.id, driver.token)
    driver.keeper.start()
    job_session(job, master)
    return driver.execute()


def _let_go(held: list[Any]) -> None:
    for lock in held:
        if lock is not None:
            lock.close()
    held.clear()
