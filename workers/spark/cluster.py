"""Spark standalone clusters: starting one from the PySpark wheel (its ``bin/spark-class``) for the tests, the demo and
the benchmarks, and what a driver needs to run its job on one. No Django here.

    python -m workers.spark.cluster up DIR [--workers 1] [--cores 2] [--memory 2g] [--port 7077] [--ui-port 8080]

``up`` starts a master and workers on 127.0.0.1, prints the master's URL, and stops them on SIGTERM or Ctrl-C.

A job on a cluster runs its driver where the Celery worker runs it (client mode) and its tasks in executors on the
workers: ``spark.cores.max`` is the job's parallelism, in one executor of that many cores. Executors import the
pipelines' code and write the state files, so every host must have the project installed (``PYTHONPATH`` here) and
see the checkpoint root at the same path (``checkpoint_visible`` checks it before a job starts).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyspark

from dashboard.selectors.cluster import master_status

SPARK_HOME = Path(pyspark.__file__).parent
MASTER = "org.apache.spark.deploy.master.Master"
WORKER = "org.apache.spark.deploy.worker.Worker"


def is_cluster(master: str) -> bool:
    return not master.startswith("local")


@dataclass
class Standalone:
    master_url: str
    ui_url: str
    work: Path
    master: subprocess.Popen
    workers: list[subprocess.Popen] = field(default_factory=list)


def _spark_class(name: str, args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        return subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-class"), name, *args],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
        )  # fmt: skip


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def alive_workers(ui_url: str) -> list[dict[str, Any]]:
    with contextlib.suppress(OSError, ValueError):
        return [w for w in master_status(ui_url)["workers"] if w.get("state") == "ALIVE"]
    return []


def _env(work: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "SPARK_LOG_DIR": str(work / "logs"),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_NO_DAEMONIZE": "1",
    }


def start_worker(cluster: Standalone, cores: int = 2, memory: str = "2g") -> subprocess.Popen:
    index = len(cluster.workers)
    folder = cluster.work / f"worker-{index}"
    args = ["--host", "127.0.0.1", "--cores", str(cores), "--memory", memory, "--work-dir", str(folder),
            "--webui-port", str(free_port()), cluster.master_url]  # fmt: skip
    cluster.workers.append(_spark_class(WORKER, args, cluster.work / f"worker-{index}.log", _env(cluster.work)))
    return cluster.workers[-1]


def start(
    work: Path, *, workers: int = 1, cores: int = 2, memory: str = "2g", port: int = 0, ui_port: int = 0,
    timeout: float = 90,
) -> Standalone:  # fmt: skip
    """A master and ``workers`` workers on 127.0.0.1, each worker offering ``cores`` and ``memory``; returns when
    every worker has registered with the master."""
    work.mkdir(parents=True, exist_ok=True)
    port, ui_port = port or free_port(), ui_port or free_port()
    master = _spark_class(
        MASTER, ["--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui_port)], work / "master.log",
        _env(work),
    )  # fmt: skip
    cluster = Standalone(f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{ui_port}", work, master)
    try:
        _wait(lambda: _answers(cluster.ui_url), timeout, "the master to answer", master)
        for _ in range(workers):
            start_worker(cluster, cores, memory)
        _wait(lambda: len(alive_workers(cluster.ui_url)) >= workers, timeout, f"{workers} worker(s) to register")
    except BaseException:
        stop(cluster)
        raise
    return cluster


def _answers(ui_url: str) -> bool:
    with contextlib.suppress(OSError, ValueError):
        master_status(ui_url, timeout=2)
        return True
    return False


def _wait(check: Any, timeout: float, what: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"waiting for {what}: the process exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waiting for {what}: gave up after {timeout:.0f} s")
        time.sleep(0.3)


def stop(cluster: Standalone, grace: float = 20) -> None:
    """Workers first (they end their executors), then the master."""
    for process in [*cluster.workers, cluster.master]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    for process in [*cluster.workers, cluster.master]:
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)


def executor_processes(cluster: Standalone) -> list[int]:
    """Pids of the executors the cluster's workers run (the workers' JVMs start them as their children)."""
    workers = {process.pid for process in cluster.workers}
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int((proc / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            if parent in workers and b"CoarseGrainedExecutorBackend" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
    return found


def driver_conf(master: str, parallelism: int, project_root: str) -> dict[str, str]:
    """Settings a driver adds on a cluster: the job's parallelism as cores (one executor holding them all), and the
    project's code and Python on the executors."""
    if not is_cluster(master):
        return {}
    return {
        "spark.cores.max": str(parallelism),
        "spark.executor.cores": str(parallelism),
        "spark.executor.memory": os.environ.get("STATEKEEPER_EXECUTOR_MEMORY", "1g"),
        "spark.executorEnv.PYTHONPATH": project_root,
        "spark.pyspark.python": sys.executable,
        # a lost executor's tasks are retried on the next one the worker starts
        "spark.task.maxFailures": "8",
    }


def probe_executors(spark: Any, root: Path, tasks: int) -> tuple[list[str], str]:
    """The hosts the executors run on (as each names itself), and what is wrong with ``root`` there: empty when every
    executor sees it as the driver does (a file the driver writes there is found by a task on each)."""
    root.mkdir(parents=True, exist_ok=True)
    probe = root / f".probe-{uuid.uuid4().hex}"
    probe.write_text(socket.gethostname())
    path = str(probe)

    def look(_: Any) -> Any:
        import os as os_
        import socket as socket_

        yield socket_.gethostname(), os_.path.isfile(path)

    try:
        answers = spark.sparkContext.parallelize(range(tasks), tasks).mapPartitions(look).collect()
    finally:
        probe.unlink(missing_ok=True)
    hosts = sorted({host for host, _ in answers})
    blind = sorted({host for host, seen in answers if not seen})
    if blind:
        return hosts, (
            f"the checkpoint root {root} is not visible to the executors on {', '.join(blind)}: every host must mount "
            f"the same shared storage at the same path"
        )
    return hosts, ""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.spark.cluster")
    parser.add_argument("command", choices=["up"])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--memory", default="2g")
    parser.add_argument("--port", type=int, default=7077)
    parser.add_argument("--ui-port", type=int, default=8080)
    args = parser.parse_args(argv)
    cluster = start(args.dir, workers=args.workers, cores=args.cores, memory=args.memory, port=args.port,
                    ui_port=args.ui_port)  # fmt: skip
    print(f"Spark master {cluster.master_url}, web UI {cluster.ui_url}", flush=True)
    ended = []
    signal.signal(signal.SIGTERM, lambda *_: ended.append(1))
    try:
        while not ended and cluster.master.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        stop(cluster)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
