from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from django.conf import settings
from django.db import connection

from dashboard.engine.samples import sample_events
from dashboard.pipelines import get as get_pipeline
from statekeeper.chromium import CHROMIUM_ARGS, CHROMIUM_PATH
from statekeeper.polling import wait_for
from statekeeper.processes import celery_worker_command, web_command

__all__ = ["wait_for"]  # tests import it from here


@pytest.fixture(scope="session", autouse=True)
def _test_settings() -> None:
    """The suite flushes its Redis database: it must never run on the console's own settings."""
    assert settings.SETTINGS_MODULE == "statekeeper.settings_test", (
        f"tests run with {settings.SETTINGS_MODULE}: unset DJANGO_SETTINGS_MODULE (pyproject.toml names the test settings)"
    )


@pytest.fixture(scope="session", autouse=True)
def _close_other_connections(django_db_setup: Any, django_db_blocker: Any) -> Iterator[None]:
    """Spark's callback threads and the live server open connections of their own; close them so the test
    database can be dropped at the end. Only on a test database: a console running beside (bin/dev, a benchmark)
    keeps its connections."""
    yield
    if not str(connection.settings_dict["NAME"]).startswith("test"):
        return  # no test of this run used the database, so none was made: nothing to close, nothing to connect to
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() AND current_database() LIKE 'test%%'"
            )


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One SparkSession for the whole test session: starting one costs seconds."""
    from workers.spark.session import build_session

    logging.getLogger("py4j").setLevel(logging.WARNING)
    session = build_session("statekeeper-tests", "local[2]", partitions=2)
    yield session
    session.stop()


@pytest.fixture
def spark_settings_kept(spark: Any) -> Iterator[Any]:
    """The shared session's SQL settings put back as they were after the test: a query it starts on the session sets
    its job's and pipeline's there (RocksDB's, Avro-encoded state), which would fail the memory jobs of the tests
    after (each driver process has a session of its own)."""
    before = dict(spark.conf.getAll)
    yield spark
    after = spark.conf.getAll
    for key in after.keys() - before.keys():
        spark.conf.unset(key)
    for key, value in before.items():
        if after.get(key) != value:
            spark.conf.set(key, value)


@pytest.fixture
def kit_spark(spark: Any) -> Any:
    """The shared session as a team's test kit would find it: without the raw local file system a memory job's
    settings leave in the session's SQL settings (RocksDB cannot copy its files through it)."""
    from workers.spark.session import RAW_LOCAL_FILES

    for key in RAW_LOCAL_FILES:
        spark.conf.unset(key)
    return spark


@pytest.fixture
def redis() -> Iterator[Any]:
    client = redis_lib.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture(autouse=True)
def checkpoint_root(settings: Any, tmp_path: Path) -> Path:
    settings.CHECKPOINT_ROOT = (tmp_path / "checkpoints").resolve()
    settings.LOG_ROOT = (tmp_path / "logs").resolve()
    settings.CHECKPOINT_ROOT.mkdir()
    return settings.CHECKPOINT_ROOT


@pytest.fixture
def stream_name() -> str:
    return f"test:events:{uuid.uuid4().hex[:8]}"


def send_events(client: Any, stream: str, pipeline: str, count: int, seed: int = 7, malformed: list[str] = ()) -> int:
    """Write ``count`` valid events (and the given malformed payloads, spread among them) to a stream."""
    make = sample_events(get_pipeline(pipeline), random.Random(seed))
    pipe = client.pipeline(transaction=False)
    bad = list(malformed)
    step = max(1, count // (len(bad) + 1))
    for i in range(count):
        pipe.xadd(stream, {"v": make(int(time.time() * 1000))})
        if bad and i % step == step - 1:
            pipe.xadd(stream, {"v": bad.pop()})
    for payload in bad:
        pipe.xadd(stream, {"v": payload})
    pipe.execute()
    return count


@pytest.fixture
def team_database() -> Iterator[str]:
    """A database of a team's own, on the console's PostgreSQL server but apart from its database: the DSN."""
    from urllib.parse import urlparse

    import psycopg

    server = urlparse(os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/statekeeper"))
    name = f"team_{uuid.uuid4().hex[:8]}"
    admin = server._replace(scheme="postgresql", path="/postgres").geturl()
    with psycopg.connect(admin, autocommit=True) as db:
        db.execute(f"CREATE DATABASE {name}")
    yield server._replace(scheme="postgresql", path=f"/{name}").geturl()
    with psycopg.connect(admin, autocommit=True) as db:
        db.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def make_job(db: Any, stream_name: str) -> Callable[..., Any]:
    from dashboard.models import Job

    def make(**overrides: Any) -> Job:
        fields = {
            "name": f"job-{uuid.uuid4().hex[:6]}",
            "pipeline": "url-counts",
            "source_stream": stream_name,
            "state_backend": "memory",
            "trigger_interval_seconds": 0.5,
            "state_partitions": 2,
            "parallelism": 2,
            "max_records_per_batch": 1000,
        }
        fields.update(overrides)
        return Job.objects.create(**fields)

    return make


class DriverThread:
    """A job's driver run in this process on the shared SparkSession: the same code a driver process runs."""

    def __init__(self, spark: Any, job: Any, **options: Any) -> None:
        """``options``: ``JobDriver``'s own (a start gate, a phase)."""
        from dashboard.models import Run
        from dashboard.services.lease import lease_acquire

        token = lease_acquire(job_id=job.id)
        assert token is not None, "the lease should be free"
        self.run = Run.objects.create(job=job, status="starting", fencing_token=token)
        from workers.driver import JobDriver

        self.driver = JobDriver(spark, self.run.id, **options)
        self.status: str | None = None
        self.thread = threading.Thread(target=self._go, daemon=True)
        self.thread.start()

    def _go(self) -> None:
        from django.db import connection

        try:
            self.status = self.driver.execute()
        finally:
            connection.close()

    def stop(self, timeout: float = 90) -> str | None:
        from dashboard.services.runs import job_request_stop

        job_request_stop(job=self.run.job)
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the driver did not stop"
        return self.status


def read_through(job: Any, redis: Any, count: int) -> bool:
    """True once the job's checkpoints, in the directory it runs on now, have read the first ``count`` stream entries
    (ingesting what is buffered). Only that directory: after a restore, the old one's batches read as far already."""
    from dashboard.models import Checkpoint, Job
    from dashboard.services.checkpoints import progress_stream_ingest

    progress_stream_ingest(client=redis)
    fork = Job.objects.values_list("checkpoint_dir", flat=True).get(id=job.id)
    latest = Checkpoint.objects.filter(job=job, location=fork).order_by("-batch_id").first()
    return latest is not None and latest.end_offset["n"] >= count


def run_through(driver: DriverThread, redis: Any, count: int, timeout: float = 180) -> str | None:
    """Let a started driver read ``count`` entries, stop it gracefully, and ingest every checkpoint it made."""
    from dashboard.services.checkpoints import progress_stream_ingest

    job = driver.run.job
    wait_for(lambda: read_through(job, redis, count), timeout, what=f"{job.name} to read {count} entries")
    status = driver.stop()
    progress_stream_ingest(client=redis)
    return status


@pytest.fixture
def start_driver(spark: Any) -> Iterator[Callable[[Any], DriverThread]]:
    started: list[DriverThread] = []

    def start(job: Any) -> DriverThread:
        driver = DriverThread(spark, job)
        started.append(driver)
        return driver

    yield start
    for driver in started:
        if driver.thread.is_alive():
            driver.driver.stop_signal.set()
            driver.thread.join(60)


@pytest.fixture(scope="session", autouse=True)
def _clean_tmp_checkpoints() -> Iterator[None]:
    yield
    shutil.rmtree("/tmp/statekeeper-tests", ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _end_the_state_reader() -> Iterator[None]:
    """One warm state reader serves the whole session (its socket is keyed by the checkout and the test Redis
    database); it ends with the session."""
    from dashboard.services.state_reader_client import state_reader_stop

    yield
    state_reader_stop()


def start_celery_worker(
    checkpoint_root: Path, log_path: Path, extra_env: dict[str, str] | None = None, beat: bool = True
) -> subprocess.Popen:
    """A real Celery worker (with beat unless ``beat`` is False), on the test database, the test Redis database and
    this test's checkpoint root (and ``extra_env``: the Spark master its drivers use, its host's identity)."""
    command = celery_worker_command(log_path.with_suffix(".beat") if beat else None)
    return start_console_process(command, checkpoint_root, log_path, extra_env)


def start_console_process(
    command: list[str], checkpoint_root: Path, log_path: Path, extra_env: dict[str, str] | None = None
) -> subprocess.Popen:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "statekeeper.settings_test",
        "STATEKEEPER_TEST_PROCESS": "1",
        "STATEKEEPER_CHECKPOINT_ROOT": str(checkpoint_root),
        "REDIS_URL": settings.REDIS_URL,
        **(extra_env or {}),
    }
    with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_process_group(proc: subprocess.Popen, grace: float = 30) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


class CeleryWorkers:
    """The test's Celery worker processes: ``kill()`` the current one with SIGKILL, ``start()`` a replacement."""

    def __init__(
        self, checkpoint_root: Path, log_path: Path, extra_env: dict[str, str] | None = None, beat: bool = True
    ) -> None:
        self.checkpoint_root, self.log_path, self.extra_env, self.beat = checkpoint_root, log_path, extra_env, beat
        self.processes: list[subprocess.Popen] = []
        # tasks queued by earlier tests (their jobs are gone) must not reach this worker
        redis_lib.Redis.from_url(settings.CELERY_BROKER_URL).flushdb()
        self.start()

    def start(self) -> subprocess.Popen:
        self.processes.append(start_celery_worker(self.checkpoint_root, self.log_path, self.extra_env, self.beat))
        return self.processes[-1]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.processes[-1].pid, signal.SIGKILL)


@pytest.fixture
def celery_worker(checkpoint_root: Path, tmp_path: Path) -> Iterator[CeleryWorkers]:
    workers = CeleryWorkers(checkpoint_root, tmp_path / "worker.log")
    yield workers
    end_workers_and_their_processes(workers)


def end_workers_and_their_processes(workers: CeleryWorkers) -> None:
    """The test's Celery workers, then every driver and standby they started (by their process groups)."""
    from dashboard.models import DriverHost, Run, StandbyDriver

    for worker in workers.processes:
        stop_process_group(worker)
    for run in Run.objects.exclude(pid=None):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
    for standby in StandbyDriver.objects.exclude(pid=None):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(standby.pid, signal.SIGKILL)
    for host in DriverHost.objects.exclude(pid=None):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(host.pid, signal.SIGKILL)


@pytest.fixture
def asgi_server(checkpoint_root: Path, tmp_path: Path) -> Iterator[str]:
    """The console under uvicorn (ASGI, as bin/dev runs it), on the test database: server-sent events need ASGI."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "statekeeper.settings_test",
        "STATEKEEPER_TEST_PROCESS": "1",
        "STATEKEEPER_CHECKPOINT_ROOT": str(checkpoint_root),
        "REDIS_URL": settings.REDIS_URL,
    }
    with open(tmp_path / "web.log", "ab") as log:
        server = subprocess.Popen(
            web_command(port),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
        return False

    wait_for(answers, 30, 0.2, "uvicorn to listen")
    yield url
    stop_process_group(server, 10)


def grant(user: Any, role: str) -> Any:
    """Give a user one of the console's roles (viewer, operator, admin): a Django group of that name."""
    from django.contrib.auth.models import Group

    user.groups.add(Group.objects.get_or_create(name=role)[0])
    return user


@pytest.fixture
def as_role(client: Any, django_user_model: Any) -> Callable[..., Any]:
    """The test client, logged in as a new user with one of the console's roles."""

    def login(role: str, name: str | None = None) -> Any:
        user = django_user_model.objects.create_user(name or role, password="pw-for-tests")
        if role != "viewer":
            grant(user, role)
        client.force_login(user)
        return client

    return login


@pytest.fixture
def browser_login(django_user_model: Any, monkeypatch: Any) -> Iterator[Callable[[str, str], Any]]:
    """Debian's chromium, logged in to the console at a base URL as a new user; call it once per test."""
    playwright = pytest.importorskip("playwright.sync_api")
    # Playwright's sync API runs an event loop on this thread; the test's own ORM calls are still synchronous.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM_PATH, args=CHROMIUM_ARGS)

        def login(base_url: str, username: str, role: str = "operator") -> Any:
            grant(django_user_model.objects.create_user(username, password="pw-for-tests"), role)
            tab = browser.new_page(viewport={"width": 1400, "height": 1200})
            tab.goto(f"{base_url}/login/?next=/")
            tab.fill("#id_username", username)
            tab.fill("#id_password", "pw-for-tests")
            tab.click("button[type=submit]")
            tab.wait_for_url(f"{base_url}/")
            return tab

        yield login
        browser.close()
