"""The fork server a standby keeps for the Python processes Spark starts per query (workers/spark/fork_server.py):
through ``pyspark-python`` a module runs as ``python -m`` would, in a child forked from the server, and anything the
server cannot take runs the ordinary way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.spark.fork_server import SCRIPT, ForkServer

MODULE = """
import json, os, sys, time
if sys.argv[1:] == ["sleep"]:
    print(os.getpid(), flush=True)
    time.sleep(60)
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "marker": os.environ.get("MARKER"),
                  "ppid": os.getppid(), "stdin": sys.stdin.read()}))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("EXIT", "0")))
"""


@pytest.fixture
def server(tmp_path: Path):
    started = ForkServer()
    assert started.ready(60), "the fork server did not start"
    yield started
    started.close()


def _env(server: ForkServer, tmp_path: Path, **more: str) -> dict[str, str]:
    (tmp_path / "probe_module.py").write_text(MODULE)
    return {**os.environ, **server.env, "PYTHONPATH": str(tmp_path), **more}


def test_a_module_runs_in_a_child_of_the_server_with_the_callers_arguments_environment_and_streams(server, tmp_path):
    work = tmp_path / "cwd"
    work.mkdir()
    done = subprocess.run(
        [str(SCRIPT), "-m", "probe_module", "a", "b c"], input=b"from stdin", capture_output=True, cwd=work,
        env=_env(server, tmp_path, MARKER="m-1", EXIT="3"), timeout=60,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"argv": ["a", "b c"], "cwd": str(work), "marker": "m-1", "ppid": server.process.pid,
                    "stdin": "from stdin"}  # fmt: skip
    assert b"to stderr" in done.stderr


def test_without_a_server_the_same_module_runs_in_a_python_of_its_own(server, tmp_path):
    env = _env(server, tmp_path, MARKER="m-2")
    server.close()
    done = subprocess.run(
        [str(SCRIPT), "-m", "probe_module"], input=b"", capture_output=True, env=env, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["marker"] == "m-2" and seen["ppid"] != server.process.pid


def test_a_command_that_is_not_a_module_run_goes_to_the_ordinary_python(server, tmp_path):
    done = subprocess.run(
        [str(SCRIPT), "-c", "import os, sys; print(os.getppid(), sys.argv[1:])", "x"], capture_output=True,
        env=_env(server, tmp_path), timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.split(b" ", 1)[1].strip() == b"['x']"
    assert int(done.stdout.split()[0]) != server.process.pid


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_a_child_ends_when_its_caller_is_stopped_or_killed(server, tmp_path, how):
    caller = subprocess.Popen(
        [str(SCRIPT), "-m", "probe_module", "sleep"], stdout=subprocess.PIPE, env=_env(server, tmp_path),
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert caller.stdout is not None
    child = int(caller.stdout.readline())
    assert child != caller.pid and _alive(child)
    caller.send_signal(how)
    caller.wait(10)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), f"the child {child} outlived its caller ({how.name})"
    if how == signal.SIGTERM:
        assert caller.returncode == 128 + signal.SIGTERM


def test_the_server_refuses_a_request_it_does_not_know_and_keeps_serving(server, tmp_path):
    import socket

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(server.path)
    conn.sendall(b"\xff\xff\xff\xffgarbage")
    assert conn.recv(4) == b"\x00\x00\x00\x00"
    conn.close()
    for body in (b"[1, 2]", b'{"argv": ["-m", "x"], "env": 3}', b"\xed\xa0\x80 not json"):  # well-framed, wrong inside
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(server.path)
        socket.send_fds(conn, [len(body).to_bytes(4, "big")], [0, 1, 2])
        conn.sendall(body)
        assert conn.recv(4) == b"\x00\x00\x00\x00", body
        conn.close()
    done = subprocess.run(
        [str(SCRIPT), "-m", "probe_module"], input=b"", capture_output=True, env=_env(server, tmp_path), timeout=60
    )
    assert done.returncode == 0 and json.loads(done.stdout)["ppid"] == server.process.pid


def test_the_server_ends_with_the_process_that_started_it(tmp_path):
    code = (
        "import sys, time; from workers.spark.fork_server import ForkServer; s = ForkServer(); "
        "assert s.ready(60); print(s.process.pid, s.directory, flush=True); time.sleep(60)"
    )
    starter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert starter.stdout is not None
    pid_text, directory = starter.stdout.readline().split()
    pid = int(pid_text)
    assert os.path.exists(os.path.join(directory, b"socket"))
    starter.kill()
    starter.wait(10)
    deadline = time.monotonic() + 10
    while (_alive(pid) or os.path.exists(directory)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid) and not os.path.exists(directory), "the server and its socket's directory are gone"


def test_a_caller_that_connects_and_says_nothing_does_not_hold_up_the_next(server, tmp_path):
    import socket

    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(server.path)
    try:
        done = subprocess.run(
            [str(SCRIPT), "-m", "probe_module"], input=b"", capture_output=True, env=_env(server, tmp_path), timeout=60
        )
        assert done.returncode == 0 and json.loads(done.stdout)["ppid"] == server.process.pid
    finally:
        silent.close()


def test_a_server_started_later_serves_at_the_path_its_callers_were_given_and_is_idle_only_without_a_child(tmp_path):
    """A driver of its own puts the path in its JVM's environment at its start and starts the server only when a
    restart is coming (``RestartReady``); it closes it again only while no query's process is its child."""
    later = ForkServer(start=False)
    env = _env(later, tmp_path)
    try:
        before = subprocess.run([str(SCRIPT), "-m", "probe_module"], input=b"", capture_output=True, env=env,
                                timeout=60)  # fmt: skip
        assert before.returncode == 0 and json.loads(before.stdout)["ppid"] == os.getpid(), "the ordinary python"
        assert later.process is None and not later.idle() and not os.path.exists(later.path)

        assert later.start() and not later.start(), "started once; the second call finds it running"
        assert later.ready(60)
        assert later.idle(), "no child yet"
        caller = subprocess.Popen([str(SCRIPT), "-m", "probe_module", "sleep"], stdout=subprocess.PIPE, env=env,
                                  stdin=subprocess.DEVNULL)  # fmt: skip
        assert caller.stdout is not None
        child = int(caller.stdout.readline())
        with open(f"/proc/{child}/stat") as stat:
            assert int(stat.read().rsplit(")", 1)[1].split()[1]) == later.process.pid, "forked by the server"
        assert not later.idle(), "a query's process is its child: closing it would end that process"
        caller.kill()
        caller.wait(10)
        deadline = time.monotonic() + 10
        while not later.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert later.idle()

        later.close()
        assert not os.path.exists(later.directory)
        assert later.start() and later.ready(60), "started again: its directory made anew"
        again = subprocess.run([str(SCRIPT), "-m", "probe_module"], input=b"", capture_output=True, env=env,
                               timeout=60)  # fmt: skip
        assert again.returncode == 0 and json.loads(again.stdout)["ppid"] == later.process.pid
    finally:
        later.close()
