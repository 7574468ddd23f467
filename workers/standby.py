"""A warm standby driver: start Spark, start the job's own transform on a scratch input, then wait on the running
driver's lock and take over the moment that driver's process dies (dashboard/services/standby.py decides whether it
may).

The warm-up is what a cold restart pays on the critical path: the JVM and SparkSession, the Python workers, the data
source's planning, Spark's code generation for this pipeline's plan, the sink's handling of a batch (cached, counted
and read back: ``rehearse``), and the code that restarts a query on an existing checkpoint (the warm query is started
twice, three times for a rocksdb-incremental job). Two things would go cold while it waits, and
are kept warm. Spark ends a Python worker that has been idle for 60 s, and its successor pays a second or two in the
first batch to fork new ones and import into them again (a transformWithState pipeline has workers of its own kind),
so the warm-up's query keeps running and gets a few events every KEEP_WARM_SECONDS. And Spark starts a new Python
process for the data source's stream reader at each query start (half a second of imports), so a local standby keeps
a fork server (workers/spark/fork_server.py) that has done them."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from typing import Any

from django.conf import settings
from django.db import IntegrityError
from django.utils import timezone

from dashboard import pipelines
from dashboard.models import RunStatus, StandbyDriver, StandbyStatus
from dashboard.services.processes import children_by_parent
from dashboard.services.runs import pid_alive
from dashboard.services.secrets import redact_logs
from dashboard.services.standby import LIVE, standby_end, standby_takeover
from workers import job_lock
from workers.driver import JobDriver, LeaseKeeper, job_session, spark_stop
from workers.spark.fork_server import start_fork_server
from workers.warm_query import KEEP_WARM_SECONDS, WarmQuery

log = logging.getLogger(__name__)
WAIT_SLICE_SECONDS = 2.0  # how long one wait on the lock lasts before the standby looks at the job again


def process_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants (the standby's Python, its JVM and Python workers)."""
    children = children_by_parent()
    total, todo = 0, [pid]
    page = os.sysconf("SC_PAGE_SIZE")
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/statm") as statm:
                total += int(statm.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
        todo += children.get(current, [])
    return total


def _master(standby: StandbyDriver) -> str:
    return str(standby.built_for.get("spark_master") or f"local[{standby.job.parallelism}]")


def _session(standby: StandbyDriver) -> Any:
    job = standby.job
    return job_session(job, _master(standby))


def _holder_alive(standby: StandbyDriver) -> bool:
    """The running driver is on this host and its process lives: the lock was free for another reason (a driver
    from before the lock existed, a cut database connection), so there is nothing to take over; the lease decides."""
    run = standby.job.runs.filter(status=RunStatus.RUNNING).order_by("-id").first()
    return bool(run and run.host == settings.HOST_ID and pid_alive(run.pid))


def code_changed(standby: StandbyDriver, loaded: pipelines.CodeVersion | None) -> bool:
    """The pipeline's code on disk is no longer the code this standby imported (``loaded``): a new standby must import
    it, or a takeover would run the old code."""
    if loaded is None:
        return False
    try:
        return pipelines.code_version(standby.job.pipeline).code_hash != loaded.code_hash
    except Exception:  # unreadable now (an install in progress): the takeover's deploy still names what it runs
        return False


def wait_for_death(
    standby: StandbyDriver, conn: Any, keep_warm: Any = None, loaded: pipelines.CodeVersion | None = None
) -> int | None:
    """Wait on the job's lock until this standby takes over (the run id) or is no longer wanted (None); call
    ``keep_warm`` every KEEP_WARM_SECONDS meanwhile, and end when the pipeline's code on disk is no longer ``loaded``."""
    job = standby.job
    idle_since = time.monotonic()
    measured, warmed = 0.0, time.monotonic()
    while True:
        if keep_warm is not None and time.monotonic() - warmed > KEEP_WARM_SECONDS:
            keep_warm()
            warmed = time.monotonic()
        standby.refresh_from_db()
        job.refresh_from_db()
        if standby.status not in LIVE or not job.standby:
            return None
        if time.monotonic() - measured > 10:
            StandbyDriver.objects.filter(id=standby.id).update(rss_bytes=process_rss(os.getpid()))
            measured = time.monotonic()
            if code_changed(standby, loaded):
                whose = pipelines.whose_code(job.pipeline, loaded) if loaded else "the pipeline's code"
                standby_end(standby, f"{whose[0].upper()}{whose[1:]} changed on disk since this standby imported it.")
                return None
        latest = job.own_runs.order_by("-id").values_list("status", flat=True).first()
        if latest == RunStatus.RUNNING:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > settings.STANDBY_IDLE_SECONDS:
            standby_end(standby, f"The job was not running for {settings.STANDBY_IDLE_SECONDS} s.")
            return None
        if latest not in (RunStatus.RUNNING, RunStatus.LOST):  # a lost run may still be the standby's to take over
            time.sleep(0.5)
            continue
        if not job_lock.wait(conn, job.id, WAIT_SLICE_SECONDS):
            if not job.lease_is_held():  # the holder outlived its lease (paused, or out of reach): end its session
                job_lock.evict(conn, job.id)
            continue
        got = time.monotonic()
        if _holder_alive(standby):
            job_lock.release(conn, job.id)
            time.sleep(1)
            continue
        try:
            run = standby_takeover(standby_id=standby.id, lock_wait_ms=(time.monotonic() - got) * 1000)
        except IntegrityError:  # the supervisor recorded the same recovery a moment ago: look again
            run = None
        if run is not None:
            return run.id
        job_lock.release(conn, job.id)  # nothing to take over: a driver starting the ordinary way needs the lock
        time.sleep(1)


def main(argv: list[str]) -> int:
    redact_logs()  # a secret revealed for the sinks is masked in whatever the driver logs
    standby = StandbyDriver.objects.select_related("job").get(id=int(argv[1]))
    log.info("standby %s for %s (pid %s)", standby.id, standby.job.name, os.getpid())
    began = time.monotonic()
    server = start_fork_server(_master(standby))
    warm: WarmQuery | None = None
    try:
        spark = _session(standby)
        warm = WarmQuery(spark, standby.job, f"standby-{standby.id}")
        warm.start()
        loaded = pipelines.code_version(standby.job.pipeline)  # what a takeover's deploy records
    except Exception as exc:
        log.exception("warm-up failed")
        if warm is not None:
            with contextlib.suppress(Exception):
                warm.stop()
        standby_end(standby, f"Warm-up failed: {exc}"[:2000])
        return 1
    StandbyDriver.objects.filter(id=standby.id, status=StandbyStatus.WARMING).update(
        status=StandbyStatus.READY,
        ready_at=timezone.now(),
        warmup_seconds=time.monotonic() - began,
        rss_bytes=process_rss(os.getpid()),
    )
    log.info("standby %s ready after %.1f s", standby.id, time.monotonic() - began)
    conn = job_lock.lock_connection()  # held open: once taken over, the lock is this process's for its life
    if server is not None and not server.ready(0):
        log.warning("standby %s: the fork server is not answering; query starts will run a new Python", standby.id)
    try:
        run_id = wait_for_death(standby, conn, warm.keep_warm, loaded)
    except BaseException:
        warm.stop()
        raise
    if run_id is None:
        warm.stop()
        standby_end(standby, standby.message or "No longer wanted.")
        return 0
    # the warm query ends beside the job's start, not before it: its stop waits for its batch in flight
    threading.Thread(target=warm.stop, name="warm-query-stop", daemon=True).start()
    log.info("standby %s took over as run %s", standby.id, run_id)
    standby.job.refresh_from_db()
    _session(standby)  # the job's current SQL settings (state partitions may have changed since the warm-up)
    from dashboard.models import Run

    keeper = LeaseKeeper(standby.job_id, int(Run.objects.get(id=run_id).fencing_token or 0))
    keeper.start()
    driver = JobDriver(spark, run_id, keeper=keeper, code=loaded, lean=True)
    signal.signal(signal.SIGTERM, lambda *_: driver.stop_signal.set())
    status = driver.execute()
    StandbyDriver.objects.filter(id=standby.id).update(status=StandbyStatus.ENDED, ended_at=timezone.now())
    log.info("run %s ended: %s", run_id, status)
    spark_stop(spark)
    return 0 if status == RunStatus.STOPPED else 1
