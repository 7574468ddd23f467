"""Spark's state reader kept warm: one JVM that answers the read-only state commands (verify, partition-rows,
inspect) over a Unix socket, so that a savepoint is verified and an inspector page answers in seconds, not in the
ten to fifteen a new JVM costs.

    python -m workers.spark.state_reader SOCKET IDLE_SECONDS

A JSON line {"command", "path", "number", "spec"} in, the state tool's JSON line out, one at a time; or the same
request left as a file in the spool beside the socket, answered into a file there, after which the asking action's
visit is sent (how an action step asks without holding its worker, see ``serve_spool`` and ``wake``). The spool is
answered in two lanes: the long requests (a plan, a migration, a repartition) one at a time on a thread of their
own, the short ones (a verification, a count, an inspector page) and the socket's beside them (``serve_lane``). An
upgrade's plan, a state migration and the repartition of a copy the console made are answered too (each in a session
of its own); when the pipeline's module changed on disk since the reader imported it, the answer is {"stale": …} and
the reader ends. Each request builds new readers on the path it names (Spark's ``statestore`` source caches nothing
between reads), so a damaged copy is caught as a new process would catch it; verification never asks the job's own
driver. The reader holds ``SOCKET.lock`` for its life (one started beside it waits LOCK_WAIT for it, then exits) with
its pid in it, warms Spark's state sources up on a scratch checkpoint while it listens, then plans the pipelines the
console names once each ({"command": "status"} says when the first is over, and how each pipeline's plan went), makes
the socket readable by its user only, and exits after IDLE_SECONDS without a request or after MAX_REQUESTS.
No Django here.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import random
import shutil
import signal
import socketserver
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from statekeeper_sdk._runtime.compatibility import describe

from dashboard.checkpoint_dir.files import committed_batches, copy_checkpoint, latest_committed
from dashboard.services.processes import remove_left_by_the_gone
from workers.spark.fork_server import ForkServer
from workers.spark.query import JobSpec, start_query
from workers.spark.state_tool import READER_COMMANDS, StaleCode, answer, load_pipeline, plan, session

SESSION_APART = ("plan", "migrate", "repartition")  # the commands that run a query: each in a session of its own
MAX_REQUESTS = 1000  # a fresh JVM now and then bounds whatever a long life would accumulate
LINE_LIMIT = 1 << 20
LOCK_WAIT = 30.0  # a reader started beside a live one waits this long, then leaves the socket to it
# Set by the console (``state_reader_warm``): the references of the pipelines to plan once while warming up, in order,
# separated by spaces, and how many seconds that may take at most (0: none is planned).
WARM_PIPELINES = "STATEKEEPER_WARM_PIPELINES"
WARM_PIPELINES_SECONDS = "STATEKEEPER_WARM_PIPELINES_SECONDS"


def scratch(where: Path, use: str) -> Path:
    """A new scratch directory under ``where`` for this reader's warm-up, named with its pid so that a later reader can
    tell one a killed reader left (``sweep_scratch``)."""
    return Path(tempfile.mkdtemp(prefix=f"{use}-{os.getpid()}-", dir=where))


def sweep_scratch(where: Path) -> list[Path]:
    """Remove the warm-up scratch directories under ``where`` whose reader is gone (a reader killed or stopped mid
    warm-up leaves its scratch checkpoint; the directory is shared by the host's readers, so only a gone reader's go);
    the ones removed."""
    return remove_left_by_the_gone(where, "warm-*")


def serve(path: Path, idle_seconds: float) -> int:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = open(path.with_suffix(".lock"), "a+")  # noqa: SIM115 - held for the process's life
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            # held for an instant by the console's probe for a live reader, for a moment by a killed reader whose
            # threads are still exiting, for good by a live reader
            if time.monotonic() > deadline:
                print(f"another state reader holds {lock.name}; this one ends", flush=True)
                return 0
            time.sleep(0.05)
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    # An upgrade's plan starts a query: Spark starts a Python process for the stream reader and another for a
    # transformWithState query's planning, each importing PySpark and PyArrow first (about a second of a plan's two
    # or three); a fork server that has done those imports hands them out ready (see fork_server.py).
    reclaim(spool_of(path))
    for left in sweep_scratch(path.parent):
        print(f"removed {left}: a warm-up's scratch directory whose reader is gone", flush=True)
    forks = ForkServer()
    os.environ.update(forks.env)
    # the two lanes' Spark jobs share the one core by turns (FAIR between the pools), not the earlier job's tasks first
    spark = session({"spark.scheduler.mode": "FAIR"})
    warm = threading.Event()
    warmed: dict[str, str] = {}  # pipeline reference -> how its warm-up plan went
    closing = threading.Event()  # a pipeline's code changed on disk, or MAX_REQUESTS served: no lane takes another
    served = reading = 0
    last = time.monotonic()
    counting = threading.Lock()  # the lanes' threads both count

    def read(request: dict[str, Any], on_verdict: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        nonlocal served, reading, last
        with counting:
            reading += 1
        try:
            return _read(request, on_verdict)
        finally:
            with counting:
                served, reading, last = served + 1, reading - 1, time.monotonic()
                if served >= MAX_REQUESTS:
                    closing.set()

    def _read(request: dict[str, Any], on_verdict: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
        try:
            command = request["command"]
            if command not in READER_COMMANDS:
                raise ValueError(f"the state reader does not answer {command!r}: it runs in a process of its own")
            # a plan runs the pipeline's query: in a session of its own, so its Spark settings stay with it
            where = spark.newSession() if command in SESSION_APART else spark
            result = answer(
                where, command, str(request["path"]), int(request["number"]), request.get("spec", {}), on_verdict
            )
        except StaleCode as exc:  # its Python workers hold the old code too: a new reader starts afresh
            result = {"stale": str(exc)}
            closing.set()
        except Exception as exc:
            result = {"error": describe(exc)}
        return dict(result)

    def idle() -> bool:
        """No request for idle_seconds, and none being read (a long one may take longer than that)."""
        with counting:
            return reading == 0 and time.monotonic() - last >= idle_seconds

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            line = self.rfile.readline(LINE_LIMIT)
            try:
                request = json.loads(line)
            except ValueError as exc:
                request = {"command": "", "error": describe(exc)}
            if request.get("command") == "status":  # how a caller knows the warm-up is over
                status = {"warm": warm.is_set(), "served": served, "pipelines": dict(warmed)}
                self.wfile.write(json.dumps(status).encode() + b"\n")
                return
            result = {"error": request["error"]} if "error" in request else read(request)
            self.wfile.write(json.dumps(result).encode() + b"\n")

    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a dead reader's socket: the lock says no reader lives
    old_mask = os.umask(0o177)
    try:
        server = socketserver.UnixStreamServer(str(path), Handler)
    finally:
        os.umask(old_mask)
    server.timeout = 0.1  # how often the spool is looked at between socket requests: a spooled request waits no longer
    threading.Thread(target=warm_up_quietly, args=(spark, path.parent, warm, warmed), daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # ended by the console: remove the socket on the way out
    print(f"state reader listening on {path} (pid {os.getpid()}), warming up", flush=True)

    def long_requests() -> None:  # Spark shares its one core between this lane's jobs and the other's (FAIR)
        spark.sparkContext.setLocalProperty("spark.scheduler.pool", "long")
        serve_lane(spool_of(path), read, LONG, closing)

    long_lane = threading.Thread(target=long_requests, name="long requests", daemon=True)
    long_lane.start()
    try:
        while not closing.is_set() and not idle():
            server.handle_request()
            if not closing.is_set():
                serve_spool(spool_of(path), read, SHORT)
        closing.set()
        long_lane.join()  # the long request being read is answered first
    finally:
        server.server_close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with contextlib.suppress(Exception):  # its JVM may have gone with it (the console ends the process group)
            spark.stop()
        forks.close()
    print(f"state reader on {path} ends after {served} request(s)", flush=True)
    return 0


def spool_of(socket_path: Path) -> Path:
    """Where a console step leaves a request it does not wait for, and finds the answer on a later visit: one spool
    per reader (a checkout and its Redis database, as the socket's name), never shared with another deployment's on
    the same machine, whose actions are numbered from 1 as well (dashboard/services/state_reader_client.py ``_spool_file``)."""
    return socket_path.with_suffix(".spool")


ANSWER_KEPT_SECONDS = 86400  # an answer no step came back for (its action ended otherwise) is removed after this


def reclaim(spool: Path) -> None:
    """At start: a request a dead reader had claimed is waiting again (one reader lives at a time, under the lock), and
    answers nobody came back for are removed."""
    if not spool.is_dir():
        return
    for taken in spool.glob("*.taken"):
        with contextlib.suppress(FileNotFoundError):
            taken.rename(taken.with_suffix(".request"))
    for left in (*spool.glob("*.answer"), *spool.glob("*.verdict"), *spool.glob("*.partial"), *spool.glob("*.writing")):
        with contextlib.suppress(FileNotFoundError):
            if time.time() - left.stat().st_mtime > ANSWER_KEPT_SECONDS:
                left.unlink()


# What takes Spark tens of seconds on a busy host: a re-run batch, a migration, a repartition. A verification, a state
# count or an inspector page takes one or two. They are answered in two lanes, each oldest first: a short request is
# not answered after a long one asked before it, nor while one is being read (five actions at once on the demo stack:
# a savepoint's verification waited behind two rescales' repartitions and two upgrades' re-runs, docs/benchmarks.md).
LONG_COMMANDS = frozenset({"plan", "migrate", "repartition"})
SHORT, LONG = "short", "long"
SPOOL_LOOK = 0.1  # seconds between a lane's looks at the spool when nothing waits for it


def lane_of(request_file: Path) -> str:
    """The lane that answers a waiting request: the long one for a plan, a migration or a repartition, else the
    short one; a request that cannot be read is answered (with its error) in the short one."""
    try:
        command = json.loads(request_file.read_text()).get("command")
    except (OSError, ValueError, AttributeError):
        command = None
    return LONG if command in LONG_COMMANDS else SHORT


def _waiting(spool: Path) -> list[tuple[str, Path]]:
    """The requests waiting in ``spool``, each with its lane, in the order they are answered: short before long, then
    oldest first (each file read once)."""
    found = []
    for request_file in spool.glob("*.request"):
        try:
            mtime = request_file.stat().st_mtime
        except FileNotFoundError:  # withdrawn, or taken by the other lane
            continue
        found.append((lane_of(request_file), mtime, request_file))
    found.sort(key=lambda each: (each[0] == LONG, each[1]))
    return [(lane, request_file) for lane, _, request_file in found]


def serve_spool(spool: Path, read: Any, lane: str | None = None) -> bool:
    """Answer the request of ``lane`` (``SHORT`` or ``LONG``; None: either) waiting in the spool whose turn it is (``_waiting``),
    if any: ``NAME.request`` is claimed by a rename to ``NAME.taken`` (two lanes never take the same one), and the
    answer written to ``NAME.answer`` whole (a temporary file renamed). A reader killed mid-request leaves
    ``NAME.taken``, which the console's step hands back or reads in a process of its own. A plan's verdict at
    planning, before its batch has run, is written to ``NAME.verdict`` the same way, and its visit sent."""
    try:
        waiting = _waiting(spool)
    except FileNotFoundError:
        return False
    for request_lane, request_file in waiting:
        if lane is not None and request_lane != lane:
            continue
        taken = request_file.with_suffix(".taken")
        try:
            request_file.rename(taken)
        except FileNotFoundError:  # withdrawn by the console between the look and the claim
            continue
        request: Any = None  # a request that cannot be read is answered with its error, and wakes no one
        try:
            request = json.loads(taken.read_text())
        except (OSError, ValueError) as exc:
            result: dict[str, Any] = {"error": f"the request could not be read: {describe(exc)}"}
        else:

            def verdict(early: dict[str, Any], taken: Path = taken, request: dict[str, Any] = request) -> None:
                writing = taken.with_suffix(".partial")
                writing.write_text(json.dumps(early))
                writing.rename(taken.with_suffix(".verdict"))
                if isinstance(request, dict) and isinstance(request.get("wake"), dict):
                    wake(request["wake"])

            result = read(request, verdict)
        partial = taken.with_suffix(".partial")
        partial.write_text(json.dumps(result))
        partial.rename(taken.with_suffix(".answer"))
        taken.unlink(missing_ok=True)
        if isinstance(request, dict) and isinstance(request.get("wake"), dict):
            wake(request["wake"])
        return True
    return False


def serve_lane(spool: Path, read: Any, lane: str, closing: threading.Event) -> None:
    """Answer ``lane``'s spooled requests one at a time until ``closing`` is set (the one being read is answered
    first)."""
    while not closing.is_set():
        if not serve_spool(spool, read, lane):
            closing.wait(SPOOL_LOOK)


WAKE_TIMEOUT = 2.0  # seconds to reach the broker: a broker away delays the next request by this much at most


@functools.cache
def _broker(url: str) -> Any:
    """The Celery app that sends wake-ups to ``url``, made at the first one."""
    from celery import Celery

    app = Celery("statekeeper-state-reader", broker=url)
    app.conf.broker_connection_retry = False
    app.conf.broker_transport_options = {"socket_timeout": WAKE_TIMEOUT, "socket_connect_timeout": WAKE_TIMEOUT}
    return app


def wake(order: dict[str, Any]) -> None:
    """Send the Celery task a spooled request names (``{"task", "args"}``: its action's visit) once its answer is
    written, so the step reads it at once rather than when its wait ends at Celery beat's next round (a second or two;
    that stays the way back when this message is lost). The broker is the console's (CELERY_BROKER_URL, which the
    console sets when it starts the reader)."""
    url = os.environ.get("CELERY_BROKER_URL", "")
    if not url or not order.get("task"):
        return
    try:
        _broker(url).send_task(str(order["task"]), args=list(order.get("args") or []), retry=False)
    except Exception as exc:  # the step still finds the answer on its next visit
        print(f"could not wake {order.get('task')} {order.get('args')}: {describe(exc)}", flush=True)


def warm_up_quietly(spark: Any, where: Path, done: threading.Event, warmed: dict[str, str]) -> None:
    """Warm up beside the requests (a request that comes first is read cold, as without a warm-up), in a session of
    its own: the settings a request's read sets (the checkpoint format) are per session. Then plan each pipeline the
    console named (``warm_pipelines``), its outcome kept in ``warmed``."""
    began = time.monotonic()
    try:
        warm_up(spark.newSession(), where)
        print(f"state reader warm after {time.monotonic() - began:.1f} s", flush=True)
    except Exception as exc:  # a cold reader still answers, only slower
        print(f"state reader warm-up failed: {describe(exc)}", flush=True)
    finally:
        done.set()
    references = os.environ.get(WARM_PIPELINES, "").split()
    budget = float(os.environ.get(WARM_PIPELINES_SECONDS) or 0)
    if references and budget > 0:
        warm_pipelines(spark, where, references, budget, warmed)


def warm_pipelines(spark: Any, where: Path, references: list[str], budget: float, warmed: dict[str, str]) -> None:
    """Plan each pipeline once as an upgrade's preview plans it, within ``budget`` seconds, recording each outcome in
    ``warmed``. In the reader's JVM a pipeline's first plan costs seconds more than its next (its Python modules and
    UDFs, its operators' code generation, its state schemas): the previews' p95 on the demo stack was those first
    plans (2.9-3.2 s against 1.0-2.2 s). Each pipeline: one batch of its sample events from a scratch Redis stream
    into a scratch checkpoint, then ``plan`` of a copy of that checkpoint at its newest commit, a preview's own path.
    The copy matters: a pipeline that runs batches without data (a watermark, a processing-time clock) leaves a batch
    half-way in the checkpoint its query ran in. Nothing when the console gave no Redis (REDIS_URL)."""
    url = os.environ.get("REDIS_URL", "")
    if not url:
        return
    deadline = time.monotonic() + budget
    for reference in references:
        if time.monotonic() > deadline:
            warmed[reference] = f"not planned: the warm-up's {budget:g} s were spent"
            continue
        began = time.monotonic()
        place = scratch(where, "warm-pipeline")
        try:
            pipeline = load_pipeline(reference)
            spec = _batch_on_scratch_stream(spark.newSession(), url, pipeline, place / "checkpoint")
            newest = latest_committed(place / "checkpoint")
            copy_checkpoint(place / "checkpoint", place / "copy", newest, replay=True)
            request = asdict(spec) | {"reference": reference, "parameters": {}, "timeout": 120}
            planned = plan(spark.newSession(), str(place / "copy"), newest, request)
            if "replay_error" in planned:
                raise RuntimeError(str(planned["replay_error"])[:500])
            warmed[reference] = f"planned in {time.monotonic() - began:.1f} s"
        except StaleCode:  # its code changed on disk: the first request that plans it ends this reader
            warmed[reference] = "not planned: its code changed on disk"
        except Exception as exc:  # a preview of it plans cold, as without the warm-up
            warmed[reference] = f"failed: {describe(exc)}"
        finally:
            shutil.rmtree(place, ignore_errors=True)
        print(f"state reader warm-up of {reference}: {warmed[reference]}", flush=True)


def _batch_on_scratch_stream(
    spark: Any, url: str, pipeline: Any, checkpoint: Path, backend: str = "rocksdb"
) -> JobSpec:
    """One committed batch of ``pipeline`` on twenty of its sample events, read from a scratch Redis stream (removed
    after) into ``checkpoint``, on ``backend``; the query's spec, which a plan on that checkpoint takes."""
    import redis

    from dashboard.engine.samples import sample_events

    client = redis.Redis.from_url(url, socket_timeout=10)
    stream = f"statekeeper:warmup:state-reader-{os.getpid()}-{checkpoint.parent.name}"
    make, now = sample_events(pipeline, random.Random(0)), int(time.time() * 1000)
    spec = JobSpec(
        job_id=0, name=f"state-reader-warm-up-{os.getpid()}-{checkpoint.parent.name}", pipeline=pipeline.name,
        stream=stream, redis_url=url, backend=backend, trigger_seconds=0.5, partitions=2, parallelism=1,
        checkpoint=str(checkpoint), batches_retained=10, max_records=1000, dead_letter=f"{stream}:dead",
    )  # fmt: skip
    try:
        for _ in range(20):  # a new checkpoint reads the stream from its beginning
            client.xadd(stream, {"v": make(now)})

        def run(frame: Any, _: int) -> None:  # the batch's stateful operators run only when its output is read
            frame.count()

        query = start_query(spark, spec, pipeline, run)
        deadline = time.monotonic() + 120
        try:
            while not committed_batches(checkpoint) and query.isActive and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            query.stop()
        if not committed_batches(checkpoint):
            failure = query.exception()
            raise RuntimeError(f"{pipeline.name} committed no batch" + (f": {describe(failure)}" if failure else ""))
    finally:
        client.delete(stream, f"{stream}:dead")
    return spec


def warm_up(spark: Any, where: Path) -> None:
    """A stateful query on a few rows into a scratch checkpoint, then the console's reads of it: in a new JVM the
    first read through Spark's state sources costs about ten seconds (class loading, code generation), which the
    first inspection would otherwise pay."""
    place = scratch(where, "warm-up")
    try:
        (place / "in").mkdir()
        (place / "in" / "rows.json").write_text("".join(f'{{"k": "k{i % 5}"}}\n' for i in range(20)))
        checkpoint = str(place / "checkpoint")
        query = (
            spark.readStream.schema("k string").json(str(place / "in")).groupBy("k").count()
            .writeStream.format("noop").outputMode("update").option("checkpointLocation", checkpoint)
            .trigger(availableNow=True).start()
        )  # fmt: skip
        if not query.awaitTermination(120):
            query.stop()
        for command, spec in (("verify", {}), ("partition-rows", {}), ("inspect", {"mode": "keys"})):
            answer(spark, command, checkpoint, 0, spec)
        # and transformWithState's path (its planning, its Python workers, its state schema files), which an
        # upgrade's plan of such a pipeline takes: a first one costs seconds more than the next in a new JVM
        query = (
            spark.readStream.schema("k string").json(str(place / "in")).groupBy("k")
            .transformWithState(WarmUpCount(), "k string, n bigint", "Update", "None")
            .writeStream.format("noop").outputMode("update").option("checkpointLocation", str(place / "tws"))
            .trigger(availableNow=True).start()
        )  # fmt: skip
        if not query.awaitTermination(120):
            query.stop()
        answer(spark, "verify", str(place / "tws"), 0, {})
        warm_source(spark.newSession(), place / "source")
    finally:
        shutil.rmtree(place, ignore_errors=True)


def warm_source(spark: Any, checkpoint: Path) -> None:
    """One batch of a job's query as an upgrade's plan runs one: events read from a Redis stream by the Python source
    (its reader's Python worker, the source's own modules), a stateful count, the plan's Python sink. In a new JVM a
    first such batch took 3.6 s against 0.4 s for the next, and the first plan after the reader started paid it
    (9-12 s against 3-4 s on a busy 2-core host). The shipped url-counts pipeline on a scratch stream, removed after;
    nothing when the console gave no Redis (REDIS_URL)."""
    url = os.environ.get("REDIS_URL", "")
    if not url:
        return
    from workers.spark.pipelines.url_counts import PIPELINE

    _batch_on_scratch_stream(spark, url, PIPELINE, checkpoint, backend="memory")


class WarmUpCount(StatefulProcessor):
    """Rows per key in a ValueState: the smallest transformWithState processor, for the warm-up."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.getValueState("count", "n bigint")

    def handleInputRows(self, key: Any, rows: Iterator[Row], timerValues: Any) -> Iterator[Row]:
        n = (self.count.get() or (0,))[0] + sum(1 for _ in rows)
        self.count.update((n,))
        yield Row(k=key[0], n=n)

    def close(self) -> None:
        pass


if __name__ == "__main__":
    sys.exit(serve(Path(sys.argv[1]), float(sys.argv[2])))
