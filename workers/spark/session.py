"""The one place a SparkSession is built, for drivers, tests and benchmarks alike."""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

from py4j.protocol import Py4JError, Py4JJavaError, Py4JNetworkError
from pyspark.sql import SparkSession

from workers.spark import testing_stand_in
from workers.spark.class_archive import archive_options
from workers.spark.quiet_files import QUIET_LOCAL, QUIET_RAW_LOCAL, quiet_files_conf
from workers.spark.worker_daemon import MODULE as WORKER_DAEMON

HDFS_PROVIDER = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


# Loggers that warn once per record in normal operation: transformWithState's state server logs a WARN line for every
# get() of a key that has no value yet (every new key), which costs more than the get itself.
QUIET = ("org.apache.spark.sql.execution.python.streaming.TransformWithStateInPySparkStateServer",)
# Warns of each batch longer than its trigger interval: every batch of a spread job (``spread_trigger``), whose trigger
# is a poll of 250 ms or more.
TRIGGER_BEHIND = "org.apache.spark.sql.execution.streaming.runtime.ProcessingTimeExecutor"


# SQL settings fixed when the SparkContext starts: an existing session keeps them
STATIC = {"spark.sql.ui.retainedExecutions"}


def state_maintenance_conf() -> dict[str, str]:
    """How often the JVM's state store maintenance runs, from STATEKEEPER_STATE_MAINTENANCE_SECONDS (10).

    A run that starts on a checkpoint loads each partition's state from its newest snapshot on disk and replays every
    change file (rocksdb-incremental) or delta file (memory) written after it. Both backends write a snapshot every
    ten batches (Spark's minDeltasForSnapshot) but put it on the checkpoint only when maintenance runs: every 60 s by
    Spark's default, so a takeover or restart replayed up to 60 s of batches on every partition in its first batch
    (about 5 ms a file; 30 files on each of four partitions is 0.6 s). At 10 s, a first batch replays at most about
    ten batches and ten seconds' worth. The price: maintenance (snapshot uploads, the removal of old files, which
    lists each partition's checkpoint directory) runs six times as often, and writes every snapshot rather than the
    newest of each minute."""
    raw = os.environ.get("STATEKEEPER_STATE_MAINTENANCE_SECONDS", "10")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 1 <= seconds <= 3600:  # NaN included; under a second, maintenance would run without a pause
        raise ValueError(f"STATEKEEPER_STATE_MAINTENANCE_SECONDS must be seconds from 1 to 3600, not {raw!r}")
    return {"spark.sql.streaming.stateStore.maintenanceInterval": f"{round(seconds * 1000)}ms"}


def backend_conf(backend: str) -> dict[str, str]:
    """Spark settings for a Statekeeper state backend: memory, rocksdb or rocksdb-incremental."""
    if backend == "memory":
        return {
            "spark.sql.streaming.stateStore.providerClass": HDFS_PROVIDER,
            "spark.sql.streaming.stateStore.checkpointFormatVersion": "1",
        }
    if backend in ("rocksdb", "rocksdb-incremental"):
        return {
            "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
            # format version 2: each commit records the id of the state file every partition wrote, so files a fenced
            # driver (or an aborted attempt) wrote for the same version are never read. A new checkpoint gets it; an
            # existing one keeps the format it was started with. The memory (HDFS) store refuses it.
            "spark.sql.streaming.stateStore.checkpointFormatVersion": "2",
            "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": str(
                backend == "rocksdb-incremental"
            ).lower(),
        }
    raise ValueError(f"unknown state backend {backend!r}")


# Spark's checkpoint manager through Hadoop's FileSystem API: its rename is the file system's own. The default one goes
# through Hadoop's FileContext, whose rename on the local disk forks `readlink` for its source and its target.
FILE_SYSTEM_MANAGER = {
    "spark.sql.streaming.checkpointFileManagerClass": (
        "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
    ),
}
# The memory backend's checkpoint on the local disk, written without forking (see ``local_files_conf``)
RAW_LOCAL_FILES = {
    **FILE_SYSTEM_MANAGER,
    "fs.file.impl": "org.apache.hadoop.fs.RawLocalFileSystem",
    "fs.file.impl.disable.cache": "true",
}


def local_files_conf(backend: str, checkpoint: str) -> dict[str, str]:
    """A session's settings for writing a checkpoint on the local disk with fewer forks.

    Without Hadoop's native library (the wheel has none), Hadoop's local file system forks a process for every
    permission it sets and every symlink check of a rename: `chmod` and `readlink`, about 35 a second from a shared
    driver's JVM with ten jobs, each adding 10 to 100 ms to a WAL, commit or state file write, more on a busy host.
    These settings go in the session's SQL settings, which its Hadoop configuration copies: the process's other jobs
    keep theirs.

    - Every backend: Spark's file-system checkpoint manager, whose rename does not check for symlinks (no `readlink`),
      and checks that its target is absent before it rather than atomically (one driver per checkpoint is the job
      lock's and the fencing token's guarantee, not the rename's).
    - Memory: also Hadoop's raw local file system: no `.crc` side files, so no `chmod` of one beside each file.
      RocksDB's file manager needs the checksummed local file system (it copies state files to its working directory
      through ``FileSystem.getLocal``), so a RocksDB job keeps it.
    - A session built with the quiet local file system (``workers/spark/quiet_files.py``) forks no `chmod` at all:
      ``quiet_raw_local`` puts its raw class in place of Hadoop's for the memory backend."""
    if "://" in checkpoint and not checkpoint.startswith("file:"):
        return {}
    if backend == "memory":
        return dict(RAW_LOCAL_FILES)
    return dict(FILE_SYSTEM_MANAGER)


def quiet_raw_local(spark: SparkSession, conf: dict[str, str]) -> dict[str, str]:
    """``conf`` with the quiet raw local file system in place of Hadoop's, when ``spark``'s JVM has it."""
    if conf.get("fs.file.impl") != RAW_LOCAL_FILES["fs.file.impl"]:
        return conf
    if spark.sparkContext.getConf().get("spark.hadoop.fs.file.impl", "") != QUIET_LOCAL:
        return conf
    return {**conf, "fs.file.impl": QUIET_RAW_LOCAL}


def jars() -> dict[str, str]:
    """More jars for the driver and executors (e.g. Spark's Kafka connector), from STATEKEEPER_SPARK_JARS."""
    listed = os.environ.get("STATEKEEPER_SPARK_JARS", "").strip()
    return {"spark.jars": listed} if listed else {}


# an OutOfMemoryError ends the driver's JVM at once (exit code 3), where it would leave it running half-broken (a
# thread of Spark's gone, a query failed with the heap still full, the jobs beside it next): the driver reports why
# and the restart strategy brings the job back, in a shared driver's case all of its jobs, in the spare
EXIT_ON_OOM = "-XX:+ExitOnOutOfMemoryError"
OOM_EXIT_CODE = 3


def driver_java_options(more: str = "") -> dict[str, str]:
    """Options for the driver's JVM: EXIT_ON_OOM, the class archive's (``class_archive``: when it has been made), and
    more (e.g. its garbage collector): ``more``, else STATEKEEPER_DRIVER_JAVA_OPTIONS."""
    given = more or os.environ.get("STATEKEEPER_DRIVER_JAVA_OPTIONS", "").strip()
    return {"spark.driver.extraJavaOptions": " ".join(f"{EXIT_ON_OOM} {archive_options()} {given}".split())}


def _jvm_process(spark: SparkSession | None) -> Any:
    """The JVM process this process started for Spark (a subprocess.Popen), None when there is none."""
    return getattr(getattr(getattr(spark, "sparkContext", None), "_gateway", None), "proc", None)


def jvm_exit_code(spark: SparkSession | None) -> int | None:
    """The exit code of the JVM this process started for Spark, None while it runs (or when there is none)."""
    process = _jvm_process(spark)
    return None if process is None else process.poll()


def jvm_exit_after(spark: SparkSession | None, error: BaseException, seconds: float = 3.0) -> int | None:
    """The JVM's exit code, when ``error`` came from py4j finding the JVM's end of the gateway gone: a JVM killed a
    moment ago may still be exiting (unmapping a large heap takes a while), so this waits up to ``seconds`` for its
    exit to show. None at once for any other error, or when the JVM still runs after the wait. py4j logs the broken
    connection and raises a bare ``Py4JError`` ("An error occurred while calling o51.isActive"), chained to nothing;
    a ``Py4JJavaError`` is an exception the JVM threw, so it still runs."""
    chain: BaseException | None = error
    while chain is not None and not (
        isinstance(chain, Py4JNetworkError | ConnectionError)
        or (isinstance(chain, Py4JError) and not isinstance(chain, Py4JJavaError))
    ):
        chain = chain.__cause__ or chain.__context__
    deadline = time.monotonic() + (seconds if chain is not None else 0.0)
    while (code := jvm_exit_code(spark)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return code


# A driver of its own (or its standby) runs one job on local[parallelism]. When the job's state is in RocksDB (off the
# heap), its heap holds little that lives: 80–150 MiB after a collection (measured, docs/benchmarks.md). G1, the JVM's
# default, let the heap's resident part grow past 300 MiB. The serial collector with a 64 MiB young generation, in
# Spark's smallest heap, starting at 128 MiB (the default start, a 64th of the host's memory, is where the old
# generation's resident part would grow to before its first full collection), keeps it near what lives: about 230 MiB
# less than G1 for the same batches, for a full collection of 0.2 s every minute or two. Fewer glibc malloc arenas (by
# default one per thread, up to 8 a core) keep the JVM's 300 threads and RocksDB's native allocations from spreading
# over many half-used ones. A job on the memory backend keeps its state on the heap, and its driver the default heap
# and collector.
LEAN_MEMORY = "512m"
LEAN_JAVA_OPTIONS = "-XX:+UseSerialGC -Xms128m -Xmn64m"
LEAN_ENV = {"MALLOC_ARENA_MAX": "2"}


def lean_jvm(backend: str) -> dict[str, str]:
    """The JVM settings of a driver that runs one job with the ``backend``: a lean JVM (LEAN_MEMORY, LEAN_JAVA_OPTIONS)
    when the state is in RocksDB, unless STATEKEEPER_DRIVER_MEMORY or STATEKEEPER_DRIVER_JAVA_OPTIONS say otherwise or
    STATEKEEPER_OWN_DRIVER_LEAN is false. It sets LEAN_ENV in this process's environment, which the JVM Spark starts
    next inherits: call it in a process that runs that job."""
    given = any(
        os.environ.get(name, "").strip() for name in ("STATEKEEPER_DRIVER_MEMORY", "STATEKEEPER_DRIVER_JAVA_OPTIONS")
    )
    off = os.environ.get("STATEKEEPER_OWN_DRIVER_LEAN", "true").strip().lower() in ("0", "false", "no", "off")
    if given or off or not backend.startswith("rocksdb"):
        return {}
    for name, value in LEAN_ENV.items():
        os.environ.setdefault(name, value)
    return {"spark.driver.memory": LEAN_MEMORY, **driver_java_options(LEAN_JAVA_OPTIONS)}


def jvm_death(code: int, log_path: str, memory_setting: str) -> str:
    """Why the JVM ended, from its exit code and the last lines it wrote to the process's log, as a sentence; out of
    memory, it names the setting that sizes the heap (``memory_setting``)."""
    tail = ""
    try:
        with open(log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 65536))
            tail = log.read().decode("utf-8", "replace")
    except OSError:
        pass
    if code == OOM_EXIT_CODE or "java.lang.OutOfMemoryError" in tail:
        found = [line for line in tail.splitlines() if "java.lang.OutOfMemoryError" in line]
        what = found[-1].split("java.lang.", 1)[-1].strip() if found else "OutOfMemoryError"
        return f"its JVM ran out of memory ({what}) and exited. Give it a larger {memory_setting}."
    if code < 0:
        return f"its JVM was killed (signal {-code}{': the kernel out-of-memory killer, or a kill' if code == -9 else ''})."
    return f"its JVM exited with code {code}."


def quiet(spark: SparkSession, loggers: tuple[str, ...]) -> None:
    """Only errors from these JVM loggers."""
    log4j = spark._jvm.org.apache.logging.log4j  # type: ignore[union-attr]
    for logger in loggers:
        log4j.core.config.Configurator.setLevel(logger, log4j.Level.ERROR)


def build_session(
    app_name: str,
    master: str = "local[2]",
    *,
    backend: str = "memory",
    partitions: int = 4,
    batches_retained: int = 100,
    extra: dict[str, str] | None = None,
) -> SparkSession:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    testing_stand_in.install()  # pandas, numpy and pyarrow only in a driver whose pipeline uses them
    conf = {
        "spark.sql.shuffle.partitions": str(partitions),
        "spark.sql.streaming.minBatchesToRetain": str(batches_retained),
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.driver.memory": os.environ.get("STATEKEEPER_DRIVER_MEMORY", "1g"),
        **driver_java_options(),
        "spark.sql.session.timeZone": "UTC",
        "spark.python.worker.reuse": "true",
        # the pipelines' Python workers freeze their imports out of the collection Spark runs after every task
        "spark.python.daemon.module": WORKER_DAEMON,
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        # progress events for idle triggers are not checkpoints; keep them rare
        "spark.sql.streaming.noDataProgressEventInterval": "60000",
        # Spark keeps what its UI would show of past jobs, stages, tasks and SQL executions (plans and metrics) on the
        # driver's heap even with the UI off: a thousand of each by default, which a streaming query fills in minutes
        # (one or more of each a micro-batch) and which a shared driver's jobs fill together. Nothing here reads them.
        "spark.ui.retainedJobs": "50",
        "spark.ui.retainedStages": "50",
        "spark.ui.retainedTasks": "500",
        "spark.sql.ui.retainedExecutions": "20",
        **backend_conf(backend),
        **state_maintenance_conf(),
        **quiet_files_conf(master),
        **jars(),
        **(extra or {}),
    }
    builder = SparkSession.builder.appName(app_name).master(master)
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("STATEKEEPER_SPARK_LOG_LEVEL", "WARN"))
    quiet(spark, QUIET)
    for key, value in conf.items():  # getOrCreate keeps an existing session's settings: set what may be set
        if key.startswith("spark.sql.") and key not in STATIC:
            spark.conf.set(key, value)
    return spark


@functools.lru_cache(maxsize=4)
def _memory_beans(context: Any) -> tuple[frozenset[str], tuple[Any, ...], Any]:
    """The JVM's heap pools' names, its garbage collectors and its memory bean: fixed for the JVM's life, and about
    30 ms of py4j calls to list, so asked once per SparkContext (a shared driver's sessions have one)."""
    management = context._jvm.java.lang.management.ManagementFactory
    pools = frozenset(
        pool.getName() for pool in management.getMemoryPoolMXBeans() if str(pool.getType()) == "Heap memory"
    )
    return pools, tuple(management.getGarbageCollectorMXBeans()), management.getMemoryMXBean()


def heap_after_gc(spark: SparkSession) -> tuple[int, int] | None:
    """(bytes the driver JVM's heap held after its latest garbage collection, the heap's maximum): what the live
    objects need, which the heap in use (garbage included) does not say. None before the first collection, or when
    the JVM cannot be asked (it is going away)."""
    try:
        heap_pools, collectors, memory = _memory_beans(spark.sparkContext)
        latest = None
        for collector in collectors:
            info = collector.getLastGcInfo()
            if info is not None and (latest is None or info.getEndTime() > latest.getEndTime()):
                latest = info
        if latest is None:
            return None
        after = latest.getMemoryUsageAfterGc()
        held = sum(after[name].getUsed() for name in heap_pools if name in after)
        return int(held), int(memory.getHeapMemoryUsage().getMax())
    except Exception:  # py4j's errors, and the gateway gone
        return None
