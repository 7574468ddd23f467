"""A Python process kept ready for the Python processes Spark starts per streaming query.

Spark starts a new Python process, ``python -m <module>``, for a Python data source's stream reader each time a query
starts (``python_streaming_source_runner``), and another for a transformWithState query's planning. Each imports
PySpark and PyArrow before it answers: about half a second on the critical path of a standby's takeover, measured
between the process's exec and its imports' end. A standby makes ``pyspark-python`` (beside this file) its
``PYSPARK_PYTHON``; that script hands such a start to this server, which has done those imports once and forks a child
that runs the module with the caller's arguments, environment, working directory and standard streams.

    python -m workers.spark.fork_server SOCKET_PATH

Anything the server cannot take (it is gone, a request it does not know) runs as an ordinary ``python`` instead: the
server only ever saves time. It is single-threaded, so a fork never copies a lock held by another of its threads; it
ends with the process that started it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HEADER = struct.Struct("!I")
MAX_REQUEST = 4 * 1024 * 1024  # an environment and an argument list; anything bigger is not from the client
# the modules a forked child finds imported; more can be named in STATEKEEPER_FORK_PRELOAD (comma-separated)
PRELOAD = (
    "pyspark.sql.streaming.python_streaming_source_runner",
    "pyspark.sql.streaming.transform_with_state_driver_worker",
    "workers.spark.sources.redis_streams",
)
SCRIPT = Path(__file__).with_name("pyspark-python")
PROJECT = Path(__file__).resolve().parents[2]
SOCKET_ENV = "STATEKEEPER_FORK_SERVER"
DIRECTORY_PREFIX = "statekeeper-fork-"


def _die_with_parent(how: int = signal.SIGKILL) -> None:
    """PR_SET_PDEATHSIG: the kernel sends ``how`` to this process when the one that started it ends (Linux only)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, how)


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the client went away")
        data += chunk
    return data


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _flags, _addr = socket.recv_fds(conn, HEADER.size, 3)
    try:
        if len(head) < HEADER.size:
            head += _recv_exactly(conn, HEADER.size - len(head))
        (size,) = HEADER.unpack(head)
        if size > MAX_REQUEST or len(fds) != 3:
            raise ValueError(f"a request of {size} bytes with {len(fds)} descriptors")
        request = json.loads(_recv_exactly(conn, size))
        if not isinstance(request, dict) or not isinstance(request.get("env"), dict):
            raise ValueError("not a request: an object with argv and env")
        argv = request.get("argv")
        if not (
            isinstance(argv, list) and len(argv) >= 2 and argv[0] == "-m" and all(isinstance(a, str) for a in argv)
        ):
            raise ValueError(f"not a module run: {argv!r}")
    except BaseException:  # the caller's descriptors are not kept for a request that is refused
        for fd in fds:
            os.close(fd)
        raise
    return request, fds


def _child(request: dict[str, Any], fds: list[int]) -> None:
    """Run the module as ``python -m`` would, in the caller's environment; never returns."""
    code = 1
    try:
        for number in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a new Python has them
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        _die_with_parent()
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        env = {str(k): str(v) for k, v in request["env"].items()}
        os.environ.clear()
        os.environ.update(env)
        for entry in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        os.chdir(request.get("cwd") or "/")
        import runpy

        argv = request["argv"]
        sys.argv = [argv[1], *argv[2:]]
        sys.modules.pop(argv[1], None)  # run afresh as __main__ (its imports stay loaded), as ``python -m`` would
        try:
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - whatever the module raised, the caller learns it from stderr and the code
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code & 0xFF)


def serve(path: str) -> None:
    def remove_and_exit(*_: Any) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)
            if os.path.basename(os.path.dirname(path)).startswith(DIRECTORY_PREFIX):
                os.rmdir(os.path.dirname(path))
        os._exit(0)

    signal.signal(signal.SIGTERM, remove_and_exit)
    _die_with_parent(signal.SIGTERM)  # its children end with it (SIGKILL: they are its own)
    parent = os.getppid()
    import importlib

    for module in (*PRELOAD, *filter(None, os.environ.get("STATEKEEPER_FORK_PRELOAD", "").split(","))):
        try:
            importlib.import_module(module.strip())
        except Exception as exc:  # noqa: BLE001 - a module that does not import here is imported by the child
            print(f"fork server: {module} not preloaded: {exc}", file=sys.stderr)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener.bind(path + ".new")
    os.chmod(path + ".new", 0o600)
    listener.listen(16)
    os.rename(path + ".new", path)  # the path appears once it answers
    wake_read, wake_write = os.pipe()  # a child's end wakes the loop up at once
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:  # (a parent gone before PR_SET_PDEATHSIG took effect)
        waiting: list[Any] = [listener, wake_read, *children.values()]
        readable, _, _ = select.select(waiting, [], [], 0.5)
        for ready in readable:
            if ready == wake_read:
                os.read(wake_read, 512)
            elif ready is listener:
                conn, _ = listener.accept()
                conn.settimeout(5)  # a caller that connects and says nothing must not hold up the others
                try:
                    request, fds = _read_request(conn)
                except (OSError, ValueError) as exc:
                    print(f"fork server: request refused: {exc}", file=sys.stderr)
                    with contextlib.suppress(OSError):
                        conn.sendall(HEADER.pack(0))
                    conn.close()
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    os.close(wake_read)
                    os.close(wake_write)
                    listener.close()
                    for other in children.values():
                        other.close()
                    conn.close()
                    _child(request, fds)
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
                with contextlib.suppress(OSError):
                    conn.sendall(HEADER.pack(pid))
            else:  # the client is gone (Spark destroyed it): so goes what it asked for
                pid = next(p for p, c in children.items() if c is ready)
                if not ready.recv(1):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid in children:
                conn = children.pop(pid)
                with contextlib.suppress(OSError):
                    code = os.waitstatus_to_exitcode(status)
                    conn.sendall(HEADER.pack(code if code >= 0 else 128 - code))  # as a shell reports a signal
                conn.close()
    remove_and_exit()  # the parent went before PR_SET_PDEATHSIG took effect: leave nothing behind


class ForkServer:
    """The server as its starter sees it: ``env`` is what makes a SparkSession started afterwards use it.

    ``start=False``: its path is fixed (and can go into a JVM's environment) but the server is started later, by
    ``start``; until then, and whenever it is not running, the script runs the ordinary ``python``. Call ``start``
    from a thread that lives as long as the server should: the server ends with that thread (PR_SET_PDEATHSIG)."""

    def __init__(self, start: bool = True) -> None:
        from dashboard.services.processes import remove_left_by_the_gone  # the starter's side: not in the server

        # a server killed with its starter's group (a stack's stop, a kill -9) leaves its directory: named with the
        # starter's pid, it is removed by the next server started on the host once that pid is gone
        for left in remove_left_by_the_gone(Path(tempfile.gettempdir()), f"{DIRECTORY_PREFIX}*"):
            print(f"removed {left}: a fork server's directory whose process is gone", file=sys.stderr, flush=True)
        self.directory = tempfile.mkdtemp(prefix=f"{DIRECTORY_PREFIX}{os.getpid()}-")
        self.path = os.path.join(self.directory, "socket")
        self.process: subprocess.Popen[bytes] | None = None
        if start:
            self.start()

    def start(self) -> bool:
        """Start the server unless it runs; whether this call started it."""
        if self.process is not None and self.process.poll() is None:
            return False
        os.makedirs(self.directory, mode=0o700, exist_ok=True)  # a server that ended removed it
        self.process = subprocess.Popen(
            [sys.executable, "-m", "workers.spark.fork_server", self.path], stdin=subprocess.DEVNULL, cwd=PROJECT
        )
        return True

    @property
    def env(self) -> dict[str, str]:
        return {"PYSPARK_PYTHON": str(SCRIPT), SOCKET_ENV: self.path, "STATEKEEPER_PYTHON": sys.executable}

    def ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process is not None and self.process.poll() is None:
            if os.path.exists(self.path):
                return True
            time.sleep(0.05)
        return os.path.exists(self.path)

    def idle(self) -> bool:
        """Running, with no child: a query's Python processes that it forked end with it, so it is closed only idle.
        The kernel's list of the server's children (it is single-threaded); unreadable, it is taken as not idle."""
        if self.process is None or self.process.poll() is not None:
            return False
        try:
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text()
        except OSError:
            return False
        return not children.split()

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            os.rmdir(self.directory)


def start_fork_server(master: str, start: bool = True) -> ForkServer | None:
    """A fork server for the Python processes Spark starts per query, and this process's environment pointed at it
    before its JVM starts. Local masters only: on a cluster the executors would be given the script's path too.
    ``start=False``: the path only, the server started later (``ForkServer.start``)."""
    if not master.startswith("local"):
        return None
    server = ForkServer(start)  # from this (the main) thread: the server ends with it
    os.environ.update(server.env)
    return server


if __name__ == "__main__":
    serve(sys.argv[1])
