"""The shared driver: one process, one JVM, one SparkContext, running the streaming queries of every job set to
``driver=shared`` on this host (``python -m workers.host_process HOST_ID``). As a Flink session cluster runs several
jobs, it saves each small job a JVM and a Python driver (see the README's "Shared driver" for the trade-offs).

Each job keeps what makes it a job of its own: its run, its lease and fencing token (renewed here, one job at a time),
its lock (on one connection for all of them), its checkpoint, its sinks and its actions (its standby is the spare
shared driver: dashboard/services/hosts.py). Each query runs
in a SparkSession of its own (its SQL settings: state backend, partitions) and in a fair-scheduler pool of its own,
so a busy job cannot starve the others of task slots. One job's failure ends that job's run only.

A spare (dashboard/services/hosts.py) runs the same loop with no run assigned, its Spark started, and watches the
serving shared driver's process. Meanwhile it runs a warm query (workers/warm_query.py) for each pipeline and state
backend the serving one runs with standby on, as a job's own standby does, and stops them when it starts serving.

The main loop, every POLL_SECONDS: beat, take the runs assigned here, pass on stop requests, and every LEASE_RENEW
seconds renew every job's lease and beat for their runs. It ends the process when it has had no job for IDLE_SECONDS,
and on SIGTERM stops every query after its batch in flight.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError, connection
from django.db.models import QuerySet, Value
from django.db.models.functions import Concat
from django.utils import timezone

from dashboard import pipelines
from dashboard.failures import root_cause
from dashboard.green_order import GreenOrder
from dashboard.models import BESIDE_THE_JOB, IN_FLIGHT_ACTIONS, Action, DriverHost, HostStatus, Job, Run, RunStatus
from dashboard.selectors.cluster import SHARED_APP
from dashboard.services.enqueue import SUPERVISE_JOBS, enqueue_on, enqueue_ready
from dashboard.services.errors import ActionRefused
from dashboard.services.hosts import host_gone, host_may_end, shared_master, spare_jobs, spare_retire, spare_warms
from dashboard.services.processes import exited_within
from dashboard.services.runs import (
    job_request_start,
    pid_alive,
    respawn_in_own_driver,
    respawn_in_shared_driver,
    run_finish,
)
from dashboard.services.secrets import redact_logs
from dashboard.services.takeover import crash_take_over
from workers import job_lock
from workers.driver import CoresWatch, GreenJobLease, JobDriver, JobLease, cluster_probe, heap_fields, spark_stop
from workers.spark.cluster import driver_conf, is_cluster
from workers.spark.fork_server import start_fork_server
from workers.spark.query import spread_poll
from workers.spark.session import TRIGGER_BEHIND, build_session, jvm_death, jvm_exit_code, quiet
from workers.warm_query import KEEP_WARM_SECONDS, WarmQuery

log = logging.getLogger("statekeeper.host")
POLL_SECONDS = 0.25
# A spare on a cluster holds no executor while it waits: its application asks for one when it has tasks (the runs it
# takes over; it probes nothing at its start) and gives it back after a minute without any, so that the cluster's
# cores are not held twice for the same jobs. Once it serves, its jobs' batches keep the executor.
SPARE_ON_CLUSTER = {
    "spark.dynamicAllocation.enabled": "true",
    "spark.dynamicAllocation.shuffleTracking.enabled": "true",  # no external shuffle service
    "spark.dynamicAllocation.initialExecutors": "0",
    "spark.dynamicAllocation.minExecutors": "0",
    "spark.dynamicAllocation.maxExecutors": "1",
    "spark.dynamicAllocation.executorIdleTimeout": "60s",
}
IDLE_SECONDS = 120.0  # no job for this long: the process ends (a launch starts a new one)
CODE_CHECK_SECONDS = 10.0  # how often a spare compares the code it imported with the code on disk
# A spare's takeover of a crashed shared driver starts the jobs with standby on first, and the crash's other jobs once
# those have committed a batch here, or STANDBY_FIRST_SECONDS after the takeover began, whichever is sooner: started all
# at once on 2 cores, each replaying its batch in flight and the backlog of the crash, the demo stack's four queries
# made the standby job's first batch take 4-9 s (docs/benchmarks.md). Runs this spare takes within TAKEOVER_SECONDS of
# its takeover are the crash's.
STANDBY_FIRST_SECONDS = 8.0
TAKEOVER_SECONDS = 30.0


class HostCoresWatch(CoresWatch):
    """While a shared driver on a cluster waits for its executor, every run assigned to it says why (``CoresWatch``)."""

    WHO = "the shared driver"

    def __init__(self, host_id: int, master: str, app_id: str, wanted: int) -> None:
        super().__init__(0, master, app_id, wanted)
        self.host_id = host_id

    def starting(self) -> QuerySet[Run]:
        return Run.objects.filter(driver_host_id=self.host_id, status__in=(RunStatus.PENDING, RunStatus.STARTING))


class SharedDriver:
    def __init__(self, host_id: int) -> None:
        self.host = DriverHost.objects.get(id=host_id)
        self.locks = job_lock.LockSet()
        self.drivers: dict[int, JobDriver] = {}  # run id -> its driver, while its thread runs
        self.leases: dict[int, JobLease] = {}
        self.threads: dict[int, threading.Thread] = {}
        self.ending = threading.Event()
        self.spark: Any = None
        self.ready = threading.Event()  # Spark is up (or failed: ``failure`` says why)
        self.failure = ""
        self.loaded: dict[str, pipelines.CodeVersion] = {}  # pipeline -> the code this process imported
        self.phases: dict[int, tuple[float, float]] = {}  # run id -> its trigger interval and phase (seconds)
        self.phase_lock = threading.Lock()
        self.seen_gone: set[int] = set()  # serving shared drivers whose death this spare took over
        self.gone_lock = threading.Lock()
        self.wake = threading.Event()  # the main loop's next tick now: a takeover assigned runs here
        self.took_over_at: float | None = None  # when this spare began serving (monotonic)
        self.standby_first: set[int] = set()  # a takeover's runs of jobs with standby on, until each has committed
        self.spare = self.host.status == HostStatus.SPARE  # until a launch makes it the serving one (never back)
        self.spare_over = threading.Event()  # set once it serves, or ends: its warm queries stop
        self.warming: threading.Thread | None = None
        # a spare's watch of the serving shared driver (``_wait_serving``)
        self.watching: threading.Thread | None = None
        self.started_in = 0.0  # seconds its Spark took to start
        self.executor_hosts: list[str] = []  # on a cluster, the hosts of its executors
        # on a cluster, once it drains: why its jobs move to the next shared driver, and the runs stopped to move them
        self.moving_why = ""
        self.moved: set[int] = set()
        # On a cluster the Python processes of a query's start (its source's lookup, its stream reader) are Spark's
        # own, each a new interpreter importing PySpark: there is no fork server there (its script's path would be
        # handed to the executors too). Ten started at once on 2 busy cores outlasted Spark's wait for them to connect
        # back, so there its queries start as many at a time as it has cores (``JobDriver.start_gate``).
        self.cluster = is_cluster(shared_master(self.host))
        self.starts = threading.BoundedSemaphore(max(1, self.host.cores)) if self.cluster else None

    def start(self) -> None:
        """Start Spark (seconds: a JVM) while the main loop already renews the leases of the runs assigned here."""
        began = time.monotonic()
        try:
            self._start_spark()
            self.started_in = time.monotonic() - began
            DriverHost.objects.filter(id=self.host.id, status=HostStatus.SPARE).update(
                message=f"Warm: its Spark started in {self.started_in:.1f} s." + self._no_warm_queries()
            )
        except Exception as exc:
            log.exception("Spark did not start")
            self.failure = f"the shared driver's Spark did not start: {root_cause(str(exc))}"
            host_gone(self.host, self.failure)  # at once: no launch may pick it now
            self.ending.set()
        finally:
            self.ready.set()
            connection.close()

    @staticmethod
    def _no_warm_queries() -> str:
        if settings.SPARK_MASTER:
            return " No warm queries on a cluster: it holds no executor until it serves."
        return "" if settings.SPARE_WARM_QUERIES else " No warm queries (STATEKEEPER_SPARE_WARM_QUERIES is off)."

    def _start_spark(self) -> None:
        master = shared_master(self.host)
        waiting_spare = self.spare and self.cluster
        self.spark = build_session(
            f"{SHARED_APP}{self.host.id}",
            master,
            extra={
                "spark.driver.memory": settings.SHARED_DRIVER_MEMORY,
                "spark.scheduler.mode": "FAIR",
                # a query that will not stop (a fenced one) gives up its thread after this long
                "spark.sql.streaming.stopTimeout": str(settings.STOP_GRACE_SECONDS * 1000),
                # on a cluster: one executor holding the driver's cores, shared by every job here
                **driver_conf(master, self.host.cores, str(settings.BASE_DIR)),
                **(SPARE_ON_CLUSTER if waiting_spare else {}),
            },
        )
        if settings.SHARED_DRIVER_SPREAD:  # each batch of a spread job is longer than its trigger's poll
            quiet(self.spark, (TRIGGER_BEHIND,))
        if not waiting_spare:  # a spare's probe would wait for the cores the serving one holds
            watch = HostCoresWatch(self.host.id, master, self.spark.sparkContext.applicationId, self.host.cores)
            watch.start()
            try:
                self.executor_hosts, refusal = cluster_probe(self.spark, master, self.host.cores)
            finally:
                watch.stop()
            if refusal:
                raise RuntimeError(refusal)
        self.loaded = {name: pipelines.code_version(name) for name in pipelines.names()}

    def serve(self) -> None:
        last_leases, idle_since = 0.0, time.monotonic()
        if self.spare:
            self.warming = threading.Thread(target=self._warm_spare, name="spare-warm-up", daemon=True)
            self.warming.start()
            self.watching = threading.Thread(target=self._wait_serving, name="serving-watch", daemon=True)
            self.watching.start()
        code_checked = time.monotonic()
        while not self.ending.is_set():
            if self.ready.is_set() and (code := jvm_exit_code(self.spark)) is not None:
                self._jvm_gone(code)
            DriverHost.objects.filter(id=self.host.id).update(heartbeat_at=timezone.now())
            self._watch_serving()
            if self.spare and self.ready.is_set() and time.monotonic() - code_checked >= CODE_CHECK_SECONDS:
                code_checked = time.monotonic()
                if self.retire_if_stale():
                    break
            self._take_new()
            if self.moving_why:
                self._move_all()
            self._reap()
            self._pass_stops()
            if time.monotonic() - last_leases >= settings.LEASE_RENEW_SECONDS:
                self._renew()
                last_leases = time.monotonic()
            try:
                self.locks.check()
            except Exception as exc:
                log.warning("the lock connection could not be opened again: %s", exc)
            if self.threads:
                idle_since = time.monotonic()
            elif self.moving_why and host_may_end(
                self.host.id, timedelta(0), "Ended: its jobs moved to the next shared driver."
            ):
                log.info("every job moved to the next shared driver: ending, its cores freed for it")
                return
            elif time.monotonic() - idle_since > IDLE_SECONDS and host_may_end(
                self.host.id, timedelta(seconds=IDLE_SECONDS)
            ):
                log.info("no job for %.0f s: ending", IDLE_SECONDS)
                return
            self.wake.wait(POLL_SECONDS)
            self.wake.clear()
        self._stop_all()

    def _watch_serving(self) -> None:
        """A spare: whether it serves now; and, should the watch thread (``_wait_serving``) have missed it, whether the
        serving shared driver's process is gone."""
        if self.spare:  # a serving shared driver, which this one never becomes again, asks nothing here
            self.spare = DriverHost.objects.filter(id=self.host.id, status=HostStatus.SPARE).exists()
            if not self.spare:
                self.took_over_at = self.took_over_at or time.monotonic()
        if not self.spare:
            self.spare_over.set()
            return
        if self.watching is not None and self.watching.is_alive():  # it takes the crash over, this loop free to run it
            return
        serving = DriverHost.objects.filter(host=settings.HOST_ID, status=HostStatus.SERVING)
        for host_id, pid in serving.values_list("id", "pid"):
            if not pid_alive(pid):
                self._serving_gone(host_id, pid)

    def _wait_serving(self) -> None:
        """A spare's watch thread: wait on the serving shared driver's process, woken the moment it exits (rather than
        at the main loop's next tick), and take the crash over then."""
        try:
            enqueue_ready()
            while not self.spare_over.is_set() and not self.ending.is_set():
                serving = DriverHost.objects.filter(host=settings.HOST_ID, status=HostStatus.SERVING)
                found = serving.exclude(id__in=list(self.seen_gone)).values_list("id", "pid").first()
                if found is None:
                    self.spare_over.wait(1.0)
                elif exited_within(found[1], 2.0):
                    self._serving_gone(*found)
        except Exception:  # the main loop's tick still finds the crash
            log.exception("the watch of the serving shared driver stopped")
        finally:
            connection.close()

    def _serving_gone(self, host_id: int, pid: int | None) -> None:
        """The serving shared driver's process is gone: take the crash over here at once (``crash_take_over``: its
        jobs lost, their restarts requested and assigned to this spare, standby on first), then wake the main loop to
        take those runs. The supervisor's round is queued too: it does the rest, the next spare once this one settled."""
        with self.gone_lock:
            if host_id in self.seen_gone:
                return
            self.seen_gone.add(host_id)
            self.took_over_at = time.monotonic()  # the runs it takes from now on are the crash's (``_in_takeover``)
        log.info("the serving shared driver %s (pid %s) is gone: taking over", host_id, pid)
        try:
            log.info("takeover: %s", "; ".join(crash_take_over(host_id, launched=self.wake.set)))
        except Exception:  # the supervisor's round does it instead, a moment later
            log.exception("the takeover of shared driver %s did not complete here", host_id)
        finally:
            self.wake.set()
            try:
                enqueue_on(settings.HOST_ID, SUPERVISE_JOBS)
            except Exception as exc:  # the beat's round comes within seconds
                log.warning("the supervisor's round was not queued: %s", exc)

    def _warm_spare(self) -> None:
        """A spare: a warm query for each pipeline and state backend the serving shared driver runs with standby on
        (``spare_warms``: looked at again every few seconds), each kept warm every KEEP_WARM_SECONDS, until this
        process serves or ends. The takeover's first batches then find their code loaded and compiled, their Python
        workers started. Its queries run in a scheduler pool of their own, and stop beside the first runs it serves."""
        self.ready.wait()
        warm: dict[tuple[str, str], WarmQuery] = {}
        kept = time.monotonic()
        self.spark.sparkContext.setLocalProperty("spark.scheduler.pool", "warm-up")
        try:
            while not self.failure and not self.spare_over.is_set():
                try:
                    wanted = spare_warms()
                except DatabaseError as exc:
                    log.warning("the jobs to keep warm could not be read: %s", exc)
                    wanted = []
                for job in wanted:
                    key = (job.pipeline, job.state_backend)
                    if key in warm or self.refusal(job.pipeline) or self.spare_over.is_set():
                        continue
                    warm[key] = WarmQuery(self.spark.newSession(), job, f"spare-{self.host.id}-{len(warm)}")
                    began = time.monotonic()
                    try:
                        warm[key].start()
                        log.info("warm query for %s (%s) ready in %.1f s", *key, time.monotonic() - began)
                    except Exception:  # not warm for it, and not tried again: a takeover runs it cold
                        log.exception("the warm query for %s (%s) failed", *key)
                        continue
                    ready = ", ".join(f"{name} ({backend})" for (name, backend), q in warm.items() if q.query)
                    DriverHost.objects.filter(id=self.host.id, status=HostStatus.SPARE).update(
                        message=f"Warm: its Spark started in {self.started_in:.1f} s; warm for {ready}."
                    )
                if time.monotonic() - kept > KEEP_WARM_SECONDS:
                    for query in warm.values():
                        query.keep_warm()
                    kept = time.monotonic()
                connection.close()
                self.spare_over.wait(5)
        except Exception:
            log.exception("the spare's warm-up stopped")
        finally:
            for query in warm.values():
                try:
                    query.stop()
                except Exception as exc:
                    log.warning("a warm query did not stop cleanly: %s", exc)
            connection.close()

    def _take_new(self) -> None:
        waiting = Run.objects.filter(
            driver_host_id=self.host.id, status__in=(RunStatus.STARTING, RunStatus.GREEN), released_at=None
        )
        for run_id, job_id, token, status in waiting.exclude(id__in=list(self.threads)).values_list(
            "id", "job_id", "fencing_token", "status"
        ):
            # renewed from now on; a blue/green upgrade's new version holds none until its handover
            if (
                self._in_takeover()
                and status != RunStatus.GREEN
                and Job.objects.filter(id=job_id, standby=True).exists()
            ):
                self.standby_first.add(run_id)  # before any other run's thread asks whether it may start
            if status == RunStatus.GREEN:
                green = GreenJobLease(job_id, 0)
                green.green_setup(run_id)
                self.leases[run_id] = green
            else:
                self.leases[run_id] = JobLease(job_id, int(token or 0))
            thread = threading.Thread(target=self._run_job, args=(run_id,), name=f"run-{run_id}", daemon=True)
            self.threads[run_id] = thread
            thread.start()

    def _reap(self) -> None:
        for run_id, thread in list(self.threads.items()):
            if not thread.is_alive():
                del self.threads[run_id]

    def _running(self) -> list[int]:
        return [run_id for run_id, lease in self.leases.items() if not lease.lost.is_set()]

    def _renew(self) -> None:
        """Every job's lease and its run's heartbeat."""
        for lease in list(self.leases.values()):
            if not lease.done.is_set():
                lease.renew()
        if not (running := self._running()):
            return
        try:
            # one JVM for all its jobs: each run carries the shared heap's figures
            Run.objects.filter(id__in=running).update(last_heartbeat_at=timezone.now(), **heap_fields(self.spark))
        except DatabaseError as exc:
            log.warning("heartbeat not recorded: %s", exc)

    def _pass_stops(self) -> None:
        """A stop request passed to its run's driver at the next turn of the main loop (an action that stops a job
        waits no longer for it than POLL_SECONDS), in one query for every job here."""
        if not (running := self._running()):
            return
        try:
            asked = Run.objects.filter(id__in=running, stop_requested_at__isnull=False).values_list("id", flat=True)
            for run_id in asked:
                if (driver := self.drivers.get(run_id)) is not None:
                    driver.stop_signal.set()
        except DatabaseError as exc:
            log.warning("stop requests not read: %s", exc)

    def _jvm_gone(self, code: int) -> None:
        """Spark's JVM ended under every job here (out of heap, or killed): record why and end the whole process
        group at once, as a kill -9 of it would. The supervisor finds each run lost, with this cause, and restarts it
        under its strategy (in the spare, if there is one); a process left with no JVM would take restarts it cannot
        run."""
        death = jvm_death(code, self.host.log_path, "STATEKEEPER_SHARED_DRIVER_MEMORY")
        log.error("ending: %s", death)
        host_gone(self.host, f"Ended: {death}")
        if os.getpgrp() == os.getpid():  # its own group (spawned so): its fork server and workers go with it
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(1)

    def retire_if_stale(self) -> bool:
        """A spare that could not run a job it stands behind (its pipeline's code changed on disk, or was installed
        after this process started) ends, as a job's own standby does: the supervisor starts a new spare that imports
        the code now on disk, where a takeover would otherwise hand every such job to a driver of its own."""
        try:
            pipelines_behind = sorted({job.pipeline for job in spare_jobs()})  # each hashed once, however many jobs
            stale = next((why for pipeline in pipelines_behind if (why := self.refusal(pipeline))), "")
            if not stale or not spare_retire(self.host.id, f"Ended: {stale}; a new spare imports it."):
                return False
        except DatabaseError as exc:
            log.warning("the spare's code check could not be made: %s", exc)
            return False
        log.info("spare ending: %s", stale)
        self.spare = False
        self.spare_over.set()
        return True

    def refusal(self, pipeline: str) -> str:
        """Why this process cannot run the pipeline's code as it is on disk now (empty when it can)."""
        if pipeline not in self.loaded:
            return f"the pipeline {pipeline!r} was not installed when the shared driver started"
        try:
            now = pipelines.code_version(pipeline).code_hash
        except Exception as exc:
            return f"its code could not be read ({exc})"
        return (
            ""
            if now == self.loaded[pipeline].code_hash
            else f"{pipelines.whose_code(pipeline, self.loaded[pipeline])} changed since the shared driver loaded it"
        )

    def _hand_over(self, run: Run, why: str) -> None:
        """Take no new runs (a launch starts a new shared driver), and start the run elsewhere: in local mode in a
        driver of its own, while the jobs here run on; on a cluster in the next shared driver, every job here after it
        (``_move_all``). There this driver's application holds its executor's cores until its last job leaves, and a
        driver of its own, or the next shared driver, would wait for them as long."""
        moving = (
            " On a cluster its jobs move to the next shared driver, which needs the cores this one's application holds."
        )
        DriverHost.objects.filter(id=self.host.id, status=HostStatus.SERVING).update(
            status=HostStatus.DRAINING, message=f"Draining: {why}.{moving if self.cluster else ''}"
        )  # once: it serves no more
        if not self.cluster:
            pid = respawn_in_own_driver(run)
            log.info("run %s handed to a driver of its own (pid %s): %s", run.id, pid, why)
            return
        self.moving_why = self.moving_why or why
        host = respawn_in_shared_driver(run)
        log.info("run %s handed to the shared driver %s: %s", run.id, host.id, why)

    def _move_all(self) -> None:
        """On a cluster, once draining: ask each query here to stop after its batch in flight; ``_run_job`` starts
        its job again once its run has ended, in the next shared driver. A blue/green upgrade's new version, a run
        someone asked to stop, and a job with an action in flight (which stops and starts it itself) are left be."""
        drivers = {run_id: d for run_id, d in list(self.drivers.items()) if run_id not in self.moved and not d.green}
        if not drivers:
            return
        busy = Action.objects.filter(status__in=IN_FLIGHT_ACTIONS).values("job_id")
        movable = Run.objects.filter(id__in=drivers, stop_requested_at=None).exclude(job_id__in=busy)
        for run_id in movable.values_list("id", flat=True):
            self.moved.add(run_id)
            drivers[run_id].stop_signal.set()
            log.info("run %s: stopping after its batch in flight, to start in the next shared driver", run_id)

    def _start_moved(self, job: Job, run_id: int) -> None:
        """The job of a run stopped for the move (``_move_all``) starts again: a launch finds the next shared driver."""
        note = f" Moved to the next shared driver: {self.moving_why} (on a cluster the jobs move together)."
        try:
            if Run.objects.filter(id=run_id, status=RunStatus.STOPPED).update(message=Concat("message", Value(note))):
                started = job_request_start(job=job)
                log.info("run %s: job %s starts again as run %s", run_id, job.name, started.id)
        except ActionRefused as exc:  # started by someone else meanwhile, archived: nothing to do here
            log.info("run %s: job %s not started again here: %s", run_id, job.name, exc)
        except DatabaseError as exc:
            log.error("run %s: job %s could not be started again (start it by hand): %s", run_id, job.name, exc)

    def _run_job(self, run_id: int) -> None:
        run = Run.objects.select_related("job").get(id=run_id)
        job = run.job
        lease = self.leases[run_id]
        locked = handed = False
        locked_green = threading.Event()
        try:
            self.ready.wait()
            if self.failure:
                raise RuntimeError(self.failure)
            is_green = run.status == RunStatus.GREEN
            ran = GreenOrder.read(run.green).pipeline if is_green else job.pipeline
            if is_green and (why := self.refusal(ran)):
                raise RuntimeError(f"{why}; a blue/green upgrade's new version needs the code loaded")
            if why := self.moving_why or self.refusal(job.pipeline):
                self._hand_over(run, why)
                handed = True
                return
            if not is_green:  # green takes the job's lock once it took over (``green_locks``)
                self.locks.take(job.id)
                locked = True
            session = self.spark.newSession()
            self.spark.sparkContext.setLocalProperty("spark.scheduler.pool", f"job-{job.id}")
            phase = self.take_phase(run_id, job.trigger_interval_seconds) if settings.SHARED_DRIVER_SPREAD else None
            driver = JobDriver(
                session, run_id, keeper=lease, shared=True, phase_seconds=phase, executor_hosts=self.executor_hosts, code=self.loaded[ran],
                on_phase=lambda used: self.phase_used(run_id, job.trigger_interval_seconds, used), start_gate=self.starts,
                on_first_batch=lambda: self.standby_first.discard(run_id),
            )  # fmt: skip
            if is_green:
                driver.on_live = lambda: threading.Thread(
                    target=self._green_lock, args=(job.id, locked_green), name=f"green-lock-{run_id}", daemon=True
                ).start()  # fmt: skip
            self.drivers[run_id] = driver
            if self.ending.is_set():
                driver.stop_signal.set()
            if not is_green and run_id not in self.standby_first and self._in_takeover():
                self._standby_jobs_first(run_id, driver.stop_signal)
            log.info("run %s of %s: %s", run_id, job.name, driver.execute())
        except Exception as exc:
            log.exception("run %s of %s failed in the shared driver", run_id, job.name)
            run_finish(
                run_id=run_id,
                status=RunStatus.FAILED,
                message=f"The shared driver could not run it: {root_cause(str(exc))}"[:2000],
                error=traceback.format_exc(),
            )
        finally:
            lease.done.set()
            self.standby_first.discard(run_id)  # ended before its first batch: the others wait for it no more
            self.phases.pop(run_id, None)
            self.leases.pop(run_id, None)
            self.drivers.pop(run_id, None)
            if not handed:  # this process is done with the run, however it ended (a handed-over run is not ours)
                Run.objects.filter(id=run_id).update(released_at=timezone.now())
            if locked or locked_green.is_set():
                self.locks.let_go(job.id)  # after the run's end is recorded: a standby reads it as a death
            if run_id in self.moved:
                self._start_moved(job, run_id)
            connection.close()

    def _in_takeover(self) -> bool:
        return self.took_over_at is not None and time.monotonic() - self.took_over_at < TAKEOVER_SECONDS

    def _standby_jobs_first(self, run_id: int, stop: threading.Event) -> None:
        """A takeover's run of a job without standby: wait while a job with standby on has not committed here yet (its
        run here, or its lost run about to restart here), STANDBY_FIRST_SECONDS from the takeover at the most."""
        assert self.took_over_at is not None
        deadline = self.took_over_at + STANDBY_FIRST_SECONDS
        began = time.monotonic()
        while time.monotonic() < deadline and not stop.is_set() and not self.ending.is_set():
            if not self.standby_first and not self._standby_job_restarting():
                break
            stop.wait(0.1)
        if (waited := time.monotonic() - began) >= 0.1:
            log.info("run %s: started %.1f s after the jobs with standby on", run_id, waited)

    def _standby_job_restarting(self) -> bool:
        """Whether a job with standby on is lost in the crash and not yet restarted here (its run not yet taken)."""
        since = timezone.now() - timedelta(seconds=TAKEOVER_SECONDS)
        lost = Run.objects.filter(job__standby=True, job__archived_at=None, job__failed_reason="")
        restarting = lost.filter(status=RunStatus.LOST, ended_at__gte=since) | lost.filter(
            status__in=(RunStatus.PENDING, RunStatus.STARTING), driver_host_id=self.host.id
        ).exclude(id__in=list(self.threads))
        # the job's newest run is the one that counts (a blue/green's new version beside it is not the job's): a lost
        # run already restarted is not waited for
        return any(
            not Run.objects.filter(job_id=job_id, id__gt=last_id).exclude(BESIDE_THE_JOB).exists()
            for job_id, last_id in restarting.values_list("job_id", "id")
        )

    def _green_lock(self, job_id: int, locked: threading.Event) -> None:
        """A blue/green upgrade's new version took over: the job's lock, once the fenced run let go of it (here, when
        its thread ends; in a driver of its own, when its process does)."""
        deadline = time.monotonic() + 300
        while job_id in self.locks.held and time.monotonic() < deadline and not self.ending.is_set():
            time.sleep(0.2)
        try:
            self.locks.take(job_id, within_seconds=300, grace_seconds=60)
            locked.set()
        except Exception as exc:
            log.warning("job %s: the new version did not take the job's lock: %s", job_id, exc)

    def take_phase(self, run_id: int, trigger: float) -> float:
        """The phase for a new run's batches: the poll tick farthest from those of this process' other runs with the
        same interval, so that their batches start apart rather than on one tick (``spread_trigger``)."""
        with self.phase_lock:
            taken = [phase for interval, phase in self.phases.values() if interval == trigger]
            self.phases[run_id] = (trigger, spread_phase(trigger, taken))
            return self.phases[run_id][1]

    def phase_used(self, run_id: int, trigger: float, used: float | None) -> None:
        """The phase the run's query took: a query that is not spread (``spread_trigger``) starts its batches on Spark's
        tick, the interval's multiples, whatever phase it was given, and the runs after it keep away from that."""
        with self.phase_lock:
            if run_id in self.phases:
                self.phases[run_id] = (trigger, 0.0 if used is None else used)
        if used is None:
            log.info("run %s: batches on Spark's tick, not spread (its plan runs batches without new data)", run_id)
        else:
            log.info("run %s: batches spread, %.2f s into each %g s interval", run_id, used, trigger)

    def end(self) -> None:
        """SIGTERM: stop every query after its batch in flight, and end; the main loop woken to do it now."""
        self.ending.set()
        self.wake.set()

    def _stop_all(self) -> None:
        self.spare_over.set()
        for driver in list(self.drivers.values()):
            driver.stop_signal.set()
        deadline = time.monotonic() + settings.STOP_GRACE_SECONDS
        for thread in [*self.threads.values(), *filter(None, [self.warming])]:
            thread.join(max(0.1, deadline - time.monotonic()))


def phase_gap(a: float, b: float, interval: float) -> float:
    """How far apart two phases of ``interval`` are, around it."""
    gap = abs(a - b) % interval
    return min(gap, interval - gap)


def spread_phase(trigger: float, taken: list[float]) -> float:
    """The poll tick of ``trigger`` seconds for one more run beside runs at the ``taken`` phases: the least taken tick,
    and of those the one farthest (around the interval) from the others; the earliest of equals."""
    poll = spread_poll(trigger)
    ticks = [i * poll for i in range(max(1, int(trigger / poll + 1e-9)))]

    def crowding(tick: float) -> tuple[int, float]:
        near = sum(1 for p in taken if phase_gap(tick, p, trigger) < poll / 2)
        return near, round(sum(1 / (phase_gap(tick, p, trigger) + poll) for p in taken), 9)

    return min(ticks, key=crowding)


def main(argv: list[str]) -> int:
    redact_logs()  # a secret revealed for the sinks is masked in whatever the driver logs
    host = SharedDriver(int(argv[1]))
    master = shared_master(host.host)
    log.info("shared driver %s (pid %s, %s)", host.host.id, os.getpid(), master)
    signal.signal(signal.SIGTERM, lambda *_: host.end())
    # each query's source runner (a Python process Spark starts per query) forked ready, as a standby's (fork_server.py)
    start_fork_server(master)
    threading.Thread(target=host.start, name="spark-start", daemon=True).start()
    host.serve()
    host_gone(host.host, host.failure or "Ended on request.")
    if host.spark is not None:
        spark_stop(host.spark)
    return 1 if host.failure else 0
