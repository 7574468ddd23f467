"""Steps that several actions share: report progress, stop the job and wait, read state with Spark in a process of
its own."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from django.conf import settings

from dashboard.models import ACTIVE_RUN_STATUSES, Action, Job, Run
from dashboard.services.errors import ActionFailed, ActionRefused
from dashboard.services.runs import job_request_stop, pid_alive, spawn_process


def action_progress(action: Action, text: str) -> None:
    Action.objects.filter(id=action.id).update(progress=text[:300])
    action.progress = text


# The commands the warm state reader answers; the others (plan, shadow, repartition) run queries or write, each in a
# process of its own.
READER_COMMANDS = ("verify", "partition-rows", "inspect")


def run_state_tool(
    command: str, path: Path, number: int, timeout: int = 900, spec: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Spark's reading of a checkpoint copy: by the warm state reader when it can answer, else in a process of its
    own (see workers/spark/state_tool.py)."""
    result = None
    if command in READER_COMMANDS and settings.STATE_READER_IDLE_SECONDS > 0:
        request = {"command": command, "path": str(path), "number": number, "spec": spec or {}}
        result = state_reader_ask(request, timeout)
    if result is None:
        result = _state_tool_process(command, path, number, timeout, spec)
    if "error" in result:
        raise ActionFailed(f"Spark could not read the state: {result.get('error')}")
    return result


def _state_tool_process(
    command: str, path: Path, number: int, timeout: int, spec: dict[str, Any] | None
) -> dict[str, Any]:
    extra = [json.dumps(spec)] if spec is not None else []
    try:
        done = subprocess.run(
            [sys.executable, "-m", "workers.spark.state_tool", command, str(path), str(number), *extra],
            cwd=settings.BASE_DIR,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise ActionFailed(f"Spark's state reader did not finish within {timeout} s") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": done.stderr.strip().splitlines()[-1:] or "no output"}
    if done.returncode != 0 and "error" not in result:
        result["error"] = f"the state tool exited with {done.returncode}"
    return dict(result)


def state_reader_ask(request: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    """The warm reader's answer, starting it when none listens (the first read pays its start, the next ones do
    not); None when it cannot answer (it could not start, or went away mid-request): the caller reads in a process
    of its own instead."""
    path = settings.STATE_READER_SOCKET
    try:
        return _ask(path, request, timeout)
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    except OSError:
        return None
    pid = state_reader_warm()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (pid_alive(pid) or pid_alive(state_reader_pid() or 0)):
        try:
            return _ask(path, request, timeout)
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.2)
        except OSError:
            return None
    return None


def state_reader_warm() -> int:
    """Start the reader unless one runs (its pid either way): the inspector asks for it when its page opens, so that
    the first inspection finds it ready. Two at once are harmless: the second exits on the first's lock."""
    return state_reader_pid() or spawn_process(
        "workers.spark.state_reader", str(settings.STATE_READER_SOCKET), settings.LOG_ROOT / "state-reader.log",
        str(settings.STATE_READER_IDLE_SECONDS),
    )  # fmt: skip


def state_reader_warmed() -> bool:
    """Whether a reader listens and has warmed up (it warms up beside its first requests)."""
    try:
        return bool(_ask(settings.STATE_READER_SOCKET, {"command": "status"}, 5).get("warm"))
    except (OSError, ValueError):
        return False


def state_reader_pid() -> int | None:
    """The running reader's pid, from the lock file it holds (None when no reader holds it)."""
    lock = settings.STATE_READER_SOCKET.with_suffix(".lock")
    try:
        with open(lock) as held:
            try:
                fcntl.flock(held, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = held.read().strip()
                return int(text) if text.isdigit() else None
            fcntl.flock(held, fcntl.LOCK_UN)
    except FileNotFoundError:
        pass
    return None


def state_reader_stop() -> int | None:
    """End the warm reader (its process group: the Python process and its JVM); its pid, or None when none ran."""
    pid = state_reader_pid()
    if pid and pid > 1:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
    return pid


def _ask(path: Path, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(str(path))
        conn.sendall(json.dumps(request).encode() + b"\n")
        reply = conn.makefile("rb").readline()
    if not reply:
        raise ConnectionResetError("the state reader closed the connection without an answer")
    return dict(json.loads(reply))


def active_run(job: Job) -> Run | None:
    return job.runs.filter(status__in=ACTIVE_RUN_STATUSES).first()


def alive_run(job: Job) -> Run | None:
    """A run whose driver may still touch the checkpoint: one in flight, or an ended one whose process on this host
    is still there (a fenced driver on its way out)."""
    if (run := active_run(job)) is not None:
        return run
    host = settings.HOST_ID
    return next((r for r in job.runs.order_by("-id")[:5] if r.host == host and r.pid and pid_alive(r.pid)), None)


def refuse_while_alive(job: Job, doing: str) -> None:
    """Checkpoint files are changed only while no driver of the job is alive."""
    if (run := alive_run(job)) is not None:
        state = run.get_status_display().lower() if run.is_active else f"{run.status}, its process still alive"
        raise ActionRefused(f"{job.name} has run #{run.id} ({state}): stop it before {doing}; nothing was changed.")


def wait_until_stopped(action: Action, job: Job, timeout: float | None = None) -> None:
    """Ask the running driver to drain and stop, and wait for it (a no-op when the job is not running)."""
    if active_run(job) is None:
        return
    action_progress(action, "stopping the job: the batch in flight commits first")
    job_request_stop(job=job)
    deadline = time.monotonic() + (timeout or settings.STOP_GRACE_SECONDS + 30)
    while active_run(job) is not None:
        if time.monotonic() > deadline:
            raise ActionFailed(f"{job.name} did not stop in time; nothing else was changed")
        time.sleep(0.5)
