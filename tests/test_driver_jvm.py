"""A driver's processes that die under it. Its JVM: out of heap (the JVM is told to exit on an OutOfMemoryError rather than go on
half-broken), or killed (the kernel's out-of-memory killer picks the largest process, which is the JVM). The run says
which; a shared driver ends its whole process, so that no restart lands in a process without a JVM, and each of its
runs is lost with that cause. Its query's Python source runner: the run names the Java cause, where Spark's own
message says "(no cause message)"."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from dashboard.models import DriverHost, HostStatus, Run, RunStatus
from dashboard.services.runs import job_request_start, pid_alive
from tests.conftest import send_events, wait_for
from tests.support import running_with_progress
from workers.spark.class_archive import archive_options
from workers.spark.session import lean_jvm

pytestmark = pytest.mark.django_db(transaction=True)


def test_an_out_of_memory_error_ends_the_jvm_and_is_named_from_its_log(tmp_path: Path):
    log = tmp_path / "driver.log"
    script = textwrap.dedent("""
        import os, time
        os.environ["STATEKEEPER_DRIVER_MEMORY"] = "512m"
        from workers.spark.session import build_session, jvm_death, jvm_exit_code
        spark = build_session("oom", "local[1]")
        try:
            spark._jvm.java.nio.ByteBuffer.allocate(700 * 1024 * 1024)  # more than the whole heap
        except Exception:
            pass
        for _ in range(100):
            if (code := jvm_exit_code(spark)) is not None:
                break
            time.sleep(0.1)
        with open(os.environ["RESULT"], "w") as result:
            print(f"EXIT {code}", file=result)
            print(f"DEATH {jvm_death(code, os.environ['DRIVER_LOG'], 'STATEKEEPER_DRIVER_MEMORY')}", file=result)
    """)
    result = tmp_path / "result"
    with log.open("wb") as out:  # both streams to the log, as a driver process has them (the JVM's line is stdout)
        subprocess.run(
            [sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT, timeout=180,
            env={**os.environ, "DRIVER_LOG": str(log), "RESULT": str(result)}, cwd=Path(__file__).parent.parent,
        )  # fmt: skip
    printed = result.read_text()
    assert "EXIT 3" in printed, f"the JVM exits on the error (code 3): {printed}"
    assert (
        "DEATH its JVM ran out of memory (OutOfMemoryError: Java heap space) and exited. Give it a larger "
        "STATEKEEPER_DRIVER_MEMORY." in printed
    )


def jvm_of(pid: int) -> int:
    """The Java process a driver process started for Spark (its child)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == pid and b"java" in cmdline.split(b"\0")[0]:
            return int(entry.name)
    raise AssertionError(f"no JVM under process {pid}")


@pytest.mark.chaos  # kill -9 of two JVMs, about half a minute: beyond the default suite's budget
def test_a_killed_jvm_fails_its_own_drivers_run_and_ends_the_shared_driver_with_every_run_lost(make_job, celery_worker):
    own = make_job(name="own", driver="own", parallelism=1, restart_strategy="none", trigger_interval_seconds=1)
    shared = make_job(name="shared", driver="shared", parallelism=1, restart_strategy="none",
                      trigger_interval_seconds=1, source_stream=f"{own.source_stream}-shared")  # fmt: skip
    for job in (own, shared):
        job_request_start(job=job)
    runs = {job.name: wait_for(lambda j=job: running_with_progress(j), 180, 0.5, f"{job.name} to commit")
            for job in (own, shared)}  # fmt: skip
    host = DriverHost.objects.get(id=runs["shared"].driver_host_id)
    for run in runs.values():
        os.kill(jvm_of(run.pid), signal.SIGKILL)  # as the kernel's out-of-memory killer would

    failed = wait_for(lambda: Run.objects.filter(id=runs["own"].id, status=RunStatus.FAILED).first(), 60, 0.5,
                      "the own driver's run to fail")  # fmt: skip
    assert failed.message.startswith("The driver failed: its JVM was killed (signal 9: the kernel out-of-memory"), (
        failed.message
    )
    wait_for(lambda: not pid_alive(failed.pid), 30, 0.5, "the own driver's process to end")

    lost = wait_for(lambda: Run.objects.filter(id=runs["shared"].id, status=RunStatus.LOST).first(), 60, 0.5,
                    "the shared driver's run to be lost")  # fmt: skip
    assert lost.message.startswith(f"The shared driver #{host.id} ended: its JVM was killed (signal 9"), lost.message
    host.refresh_from_db()
    assert host.status == HostStatus.GONE and not pid_alive(host.pid), "the process ended, taking no more runs"


def descendants(pid: int) -> dict[int, bytes]:
    """Every process under ``pid``, with its command line."""
    parents: dict[int, int] = {}
    lines: dict[int, bytes] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                lines[int(entry.name)] = (entry / "cmdline").read_bytes()
            except OSError:
                continue
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found[child] = lines[child]
                frontier.append(child)
    return found


def test_a_broken_gateway_waits_for_the_dying_jvms_exit_and_any_other_error_does_not():
    """A JVM killed a moment ago may still be exiting when py4j finds the gateway gone (it logs the broken connection
    and raises a bare Py4JError): the driver waits for the exit to show, so the run is the JVM's death (a shared
    driver's runs lost), not a failure of the query. A process stands in for the dying JVM."""
    from py4j.protocol import Py4JError

    from workers.spark.session import jvm_exit_after

    dying = subprocess.Popen(["sleep", "0.5"])
    spark = types.SimpleNamespace(sparkContext=types.SimpleNamespace(_gateway=types.SimpleNamespace(proc=dying)))
    began = time.monotonic()
    assert jvm_exit_after(spark, ValueError("the pipeline's own bug")) is None, "not a gateway error: no wait"
    assert time.monotonic() - began < 0.3
    assert jvm_exit_after(spark, Py4JError("An error occurred while calling o51.isActive")) == 0
    assert time.monotonic() - began >= 0.4, "waited for the exit"
    dying = subprocess.Popen(["sleep", "30"])
    spark.sparkContext._gateway.proc = dying
    try:
        assert jvm_exit_after(spark, ConnectionResetError(), seconds=0.3) is None, "still running after the wait"
    finally:
        dying.kill()
        dying.wait()


def test_a_source_runner_that_dies_fails_the_run_naming_where_it_broke(make_job, celery_worker):
    job = make_job(name="reader", driver="own", parallelism=1, restart_strategy="none", trigger_interval_seconds=1)
    job_request_start(job=job)
    run = wait_for(lambda: running_with_progress(job), 180, 0.5, "the job to commit")
    runner = wait_for(
        lambda: next((p for p, line in descendants(run.pid).items() if b"python_streaming_source_runner" in line), None),
        30, 0.5, "the query's source runner",
    )  # fmt: skip
    os.kill(runner, signal.SIGKILL)
    failed = wait_for(
        lambda: Run.objects.filter(id=run.id, status=RunStatus.FAILED).first(), 60, 0.5, "the run to fail"
    )
    assert "no cause message" not in failed.message, failed.message
    # the JVM finds the runner gone at its next read (EOF) or in the middle of one (the socket reset): either names it
    assert re.search(
        r"(EOFException: \(no message\) thrown in|SocketException: .* \(in) PythonStreamingSourceRunner\.",
        failed.message,
    ), failed.message


def test_a_java_io_cause_is_named_with_where_it_was_thrown():
    """What a run's failure says for a cause whose message names no place (a socket reset, an end of file)."""
    from workers.driver import failure_text

    class Cause:
        def __init__(self, desc: str, trace: str, cause=None) -> None:
            self._desc, self._stackTrace, self._cause = desc, trace, cause

    trace = ("\tat java.net.SocketInputStream.read(SocketInputStream.java:1)\n"
             "\tat org.apache.spark.sql.execution.python.PythonStreamingSourceRunner.readOffset(X.scala:2)\n")  # fmt: skip
    reset = Cause("java.net.SocketException: Connection reset", trace)
    error = Cause("[STREAM_FAILED] (no cause message)", "", reset)
    assert failure_text(error).splitlines()[-1] == (
        "Caused by: java.net.SocketException: Connection reset (in PythonStreamingSourceRunner.readOffset)"
    )
    eof = Cause("java.io.EOFException", trace)
    assert failure_text(Cause("x", "", eof)).splitlines()[-1] == (
        "Caused by: java.io.EOFException: (no message) thrown in PythonStreamingSourceRunner.readOffset"
    )


def test_a_rocksdb_job_in_a_driver_of_its_own_runs_a_lean_jvm_and_ends_the_python_daemons_of_its_start(
    make_job, celery_worker, redis
):
    job = make_job(name="lean", driver="own", state_backend="rocksdb", parallelism=1, trigger_interval_seconds=1)
    send_events(redis, job.source_stream, "url-counts", 50)
    job_request_start(job=job)
    run = wait_for(lambda: running_with_progress(job), 180, 0.5, "the job to commit")
    jvm = jvm_of(run.pid)
    options = (Path(f"/proc/{jvm}/cmdline").read_bytes()).split(b"\0")
    assert {b"-Xmx512m", b"-Xms128m", b"-XX:+UseSerialGC", b"-Xmn64m"} <= set(options), options
    assert b"MALLOC_ARENA_MAX=2" in Path(f"/proc/{jvm}/environ").read_bytes().split(b"\0")

    def start_daemons() -> list[bytes]:
        return [line for line in descendants(jvm).values() if b"pyspark.sql.worker." in line]

    wait_for(lambda: not start_daemons(), 60, 0.5, "the daemons of the query's start to end")
    assert any(b"workers.spark.worker_daemon\0pyspark.worker" in line for line in descendants(jvm).values()), (
        "the daemon of the pipeline's workers stays"
    )
    batch = job.checkpoints.order_by("-batch_id").values_list("batch_id", flat=True).first()
    send_events(redis, job.source_stream, "url-counts", 20, seed=8)
    wait_for(lambda: job.checkpoints.filter(batch_id__gt=batch, input_rows__gt=0).exists(), 60, 0.5,
             "a batch that read the new event")  # fmt: skip
    assert job.runs.get(id=run.id).status == RunStatus.RUNNING


def test_the_lean_jvm_is_for_state_off_the_heap_and_gives_way_to_the_operators_settings(monkeypatch):
    for name in ("STATEKEEPER_DRIVER_MEMORY", "STATEKEEPER_DRIVER_JAVA_OPTIONS", "STATEKEEPER_OWN_DRIVER_LEAN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    assert lean_jvm("memory") == {}, "a memory job's state lives on the heap: the default heap and collector"
    assert os.environ.get("MALLOC_ARENA_MAX") is None
    for backend in ("rocksdb", "rocksdb-incremental"):
        conf = lean_jvm(backend)
        assert conf["spark.driver.memory"] == "512m"
        shared_classes = archive_options().split()  # the class archive's, when it has been made
        assert [o for o in conf["spark.driver.extraJavaOptions"].split() if o not in shared_classes] == [
            "-XX:+ExitOnOutOfMemoryError", "-XX:+UseSerialGC", "-Xms128m", "-Xmn64m",
        ]  # fmt: skip
    assert os.environ["MALLOC_ARENA_MAX"] == "2"
    for name, value in (("STATEKEEPER_DRIVER_MEMORY", "2g"), ("STATEKEEPER_DRIVER_JAVA_OPTIONS", "-XX:+UseZGC"),
                        ("STATEKEEPER_OWN_DRIVER_LEAN", "false")):  # fmt: skip
        monkeypatch.setenv(name, value)
        assert lean_jvm("rocksdb") == {}, f"{name}={value} stands"
        monkeypatch.delenv(name)
