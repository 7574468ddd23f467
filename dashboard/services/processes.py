"""The processes the console starts on its own host (drivers, standbys, shared drivers, the state reader): starting one
in a session of its own, asking whether one lives, killing its whole group, finding what runs under one."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings


def spawn_process(
    module: str, argument: int | str, log_path: Path, *more: str, env: dict[str, str] | None = None
) -> int:
    """``python -m module argument [more...]`` in a session of its own (it outlives the worker that started it, and its whole
    group can be killed at once), writing to ``log_path``; ``env`` adds to the worker's environment."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, str(argument), *more],
            cwd=settings.BASE_DIR,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={
                **os.environ,
                "DJANGO_SETTINGS_MODULE": os.environ.get("DJANGO_SETTINGS_MODULE", "statekeeper.settings"),
                **(env or {}),
            },
        )
    return proc.pid


def exited_within(pid: int | None, seconds: float) -> bool:
    """Wait up to ``seconds`` for process ``pid`` to exit; True the moment it has (or if there is none). A pidfd wakes
    the caller as the process exits (a zombie counts as exited), where a poll of ``pid_alive`` would find it a tick
    later; without pidfds (not Linux, an old kernel), ticks of 50 ms."""
    try:
        fd = os.pidfd_open(pid) if pid else None
    except ProcessLookupError:
        return True
    except (AttributeError, OSError):  # no pidfds here
        deadline = time.monotonic() + seconds
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        return not pid_alive(pid)
    if fd is None:
        return True
    try:
        return bool(select.select([fd], [], [], seconds)[0]) or not pid_alive(pid)
    finally:
        os.close(fd)


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped by its parent) is not alive
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def remove_left_by_the_gone(where: Path, pattern: str) -> list[Path]:
    """Remove the directories under ``where`` matching ``pattern`` whose owner is gone: named ``NAME-PID-RANDOM``
    (``tempfile.mkdtemp(prefix=f"NAME-{os.getpid()}-")``) by a process that is no longer alive or is a zombie (killed,
    not yet reaped by its parent), which left them there when it was killed. One without a pid in its name is left
    alone: whose it is cannot be told. The ones removed."""
    removed = []
    for path in where.glob(pattern):
        pid = path.name.rsplit("-", 2)[-2] if path.name.count("-") >= 2 else ""
        if not path.is_dir() or not pid.isdigit() or pid_alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def processes_running(module: str, argument: str) -> list[int]:
    """The pids of the live processes started as ``python -m module argument …`` (``spawn_process``), read from /proc.
    A process that ends while read is left out."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for n in range(len(words) - 2):
            if words[n : n + 3] == [b"-m", module.encode(), argument.encode()]:
                if pid_alive(int(entry.name)):
                    found.append(int(entry.name))
                break
    return found


def children_by_parent() -> dict[int, list[int]]:
    """Every process's children, by parent pid, read from /proc (a JVM forks from any of its threads, so a thread's own
    list of children would miss some). A process that ends while read is left out."""
    found: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        found.setdefault(parent, []).append(int(entry.name))
    return found


def kill_group(pid: int) -> None:
    """SIGKILL the driver's process group (it runs in a session of its own: the JVM and Python workers go too).
    SIGKILL also ends a stopped (SIGSTOP) process."""
    if pid <= 1:  # 0 would be our own group
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
