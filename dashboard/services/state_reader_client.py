"""The console's side of Spark's warm state reader (workers/spark/state_reader.py): a step asks it to verify, plan,
migrate, inspect or repartition a copy of a job's state, without holding its worker while Spark works, or runs the
same in a process of its own when the reader is not there."""

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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings

from dashboard import pipelines
from dashboard.models import Action, Job
from dashboard.services.action_keys import memo_save
from dashboard.services.action_steps import Next, Steps, Wait, step_seconds
from dashboard.services.enqueue import RUN_ACTION
from dashboard.services.errors import ActionFailed
from dashboard.services.processes import processes_running
from dashboard.services.runs import (
    pid_alive,
    spawn_process,
)  # fmt: skip

# no JVM to start while a job waits); a shadow run's longer query runs in a process of its own.
READER_COMMANDS = ("verify", "partition-rows", "inspect", "plan", "migrate", "repartition")
READER_MODULE = "workers.spark.state_reader"  # the warm reader: ``python -m READER_MODULE SOCKET IDLE_SECONDS``


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
        # it went away mid-request (a reset, a broken pipe): this read is done in a process of its own, and a new
        # reader is started for the next one (a second beside a live one leaves at once)
        state_reader_warm()
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
        READER_MODULE, str(settings.STATE_READER_SOCKET), settings.LOG_ROOT / "state-reader.log",
        str(settings.STATE_READER_IDLE_SECONDS),
        # where it sends the visit an answer wakes, where its warm-up reads a scratch stream, and what it plans then
        env={
            "CELERY_BROKER_URL": settings.CELERY_BROKER_URL, "REDIS_URL": settings.REDIS_URL,
            WARM_PIPELINES: " ".join(warm_pipelines_order()) if settings.STATE_READER_WARM_PIPELINES_SECONDS else "",
            WARM_PIPELINES_SECONDS: str(settings.STATE_READER_WARM_PIPELINES_SECONDS),
        },
    )  # fmt: skip


# The reader's environment for its pipelines' warm-up (workers/spark/state_reader.py reads them; the console may not
# import it).
WARM_PIPELINES = "STATEKEEPER_WARM_PIPELINES"
WARM_PIPELINES_SECONDS = "STATEKEEPER_WARM_PIPELINES_SECONDS"


def warm_pipelines_order() -> list[str]:
    """The registered pipelines' references for the reader's warm-up, those in the modules of the jobs' pipelines
    first: an upgrade's preview plans a job's next version, which is most often a pipeline beside its own."""
    references = pipelines.registry().references
    used = {references[name].partition(":")[0] for name in Job.objects.values_list("pipeline", flat=True).distinct()
            if name in references}  # fmt: skip
    return sorted(references.values(), key=lambda reference: reference.partition(":")[0] not in used)


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
                # a killed reader's lock outlives its pid for a moment (its main thread is reaped first): not alive
                text = held.read().strip()
                return int(text) if text.isdigit() and pid_alive(int(text)) else None
            fcntl.flock(held, fcntl.LOCK_UN)
    except FileNotFoundError:
        pass
    return None


def state_reader_stop() -> int | None:
    """End the warm reader (its process group: the Python process and its JVM), and any reader started for the same
    socket that waits for its lock: it would take the lock over once the first has gone (two requests at once after a
    reader was killed each start one). The pid of the one that held the lock (else of one that waited), or None."""
    holder = state_reader_pid()
    waiting = processes_running(READER_MODULE, str(settings.STATE_READER_SOCKET))
    ended = [pid for pid in dict.fromkeys([holder or 0, *waiting]) if pid > 1]
    for pid in ended:  # each spawned in a session of its own: its pid is its group's
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
    return ended[0] if ended else None


def _ask(path: Path, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(str(path))
        conn.sendall(json.dumps(request).encode() + b"\n")
        reply = conn.makefile("rb").readline()
    if not reply:
        raise ConnectionResetError("the state reader closed the connection without an answer")
    return dict(json.loads(reply))


READER_START_WAIT = 120  # a step waits this long for the warm reader to listen, then reads in a process of its own


def reader_ready(action: Action) -> Wait | None:
    """None when a read can be asked of the warm state reader now (or it is switched off, or would not come up in
    time: the read then runs in a process of its own); else start it and wait, without holding the worker."""
    if settings.STATE_READER_IDLE_SECONDS <= 0 or reader_listening():
        return None
    if step_seconds(action) > READER_START_WAIT:
        return None
    state_reader_warm()
    return Wait("starting Spark's state reader (one JVM for every read, kept warm)", 1.0)


def reader_step(then: str) -> Steps:
    """A step, "reader", that waits for the warm state reader to listen (see ``reader_ready``) and goes on to
    ``then``."""
    return {"reader": ("Spark's state reader", lambda action: reader_ready(action) or Next(then))}


def reader_listening() -> bool:
    """Whether the warm state reader is up (its socket there and its lock held) and so answers a read now."""
    return (
        settings.STATE_READER_IDLE_SECONDS > 0
        and settings.STATE_READER_SOCKET.exists()
        and state_reader_pid() is not None
    )


def tool_process(action: Action, key: str, command: str, path: Path, number: int, spec: dict[str, Any] | None) -> Any:
    """Spark's answer to a state tool command that runs a query or writes (repartition, shadow, a plan the reader
    cannot give) from a process of its own, started once and left to run while the action waits: None until it
    has answered, then its JSON. The process outlives a killed worker; the step's next visit finds its answer."""
    started = action.memo.get(key)
    if started is None:
        log = settings.LOG_ROOT / f"action-{action.id}-{key}.log"
        log.unlink(missing_ok=True)
        extra = [json.dumps(spec)] if spec is not None else []
        pid = spawn_process("workers.spark.state_tool", command, log, str(path), str(number), *extra)
        memo_save(action, **{key: {"pid": pid, "log": str(log), "host": settings.HOST_ID}})
        return None
    answer = _last_json(Path(started["log"]))
    if answer is None:
        here = started["host"] == settings.HOST_ID
        if not here or pid_alive(started["pid"]):
            return None
        answer = {"error": f"the state tool's process ended without an answer (see {started['log']})"}
    if "error" in answer:
        raise ActionFailed(f"Spark could not {command} the state: {answer['error']}")
    return answer


STATE_READ_LIMIT = 900  # seconds a step's read of the state may take, however it is read
READER_RETRIES = 2  # a warm reader that dies with a step's request is restarted this often, then a process reads


def state_read(
    action: Action,
    key: str,
    command: str,
    path: Path,
    number: int,
    spec: dict[str, Any] | None = None,
    fresh_copy: Callable[[], None] | None = None,
) -> dict[str, Any] | None:
    """Spark's reading of a checkpoint copy for an action step, without holding the worker: the request is left in
    the warm state reader's spool (started if it is not up) or, where it cannot answer, given to a process of its
    own; None until the answer is there (the step returns a Wait and looks again), then the answer. ActionFailed
    when Spark could not read it, or not within STATE_READ_LIMIT. A reader that went away with the request is
    restarted (``fresh_copy`` first remakes a copy the reader may have written into); after READER_RETRIES, or when
    it runs older code of the pipeline (``stale``), a process of its own reads (after ``fresh_copy`` too)."""
    if step_seconds(action) > STATE_READ_LIMIT:
        _spool_withdraw(key, action)
        raise ActionFailed(f"Spark's reading of the state ({command}) did not finish within {STATE_READ_LIMIT} s")
    asked = action.memo.get(key)
    if asked is None:
        if command in READER_COMMANDS and settings.STATE_READER_IDLE_SECONDS > 0:
            request = {"command": command, "path": str(path), "number": number, "spec": spec or {},
                       "wake": {"task": RUN_ACTION, "args": [action.id]}}  # fmt: skip
            _spool_put(key, action, request)
            memo_save(action, **{key: {"spool": True, "restarts": 0}})
            state_reader_warm()
            return None
        asked = {"process": True}
        memo_save(action, **{key: asked})
    if asked.get("spool"):
        answer = _spool_take(key, action)
        if answer is None:
            if state_reader_pid() is None:  # it idled out, died, or was never up: start it (and count the deaths)
                taken = _spool_file(key, action, "taken")
                if taken.exists():  # it died with the request in hand
                    if asked["restarts"] >= READER_RETRIES:
                        return _read_apart(action, key, command, path, number, spec, fresh_copy)
                    if fresh_copy is not None:  # it may have written into the copy (a plan, a repartition)
                        fresh_copy()
                    taken.rename(taken.with_suffix(".request"))
                    memo_save(action, **{key: {**asked, "restarts": asked["restarts"] + 1}})
                elif step_seconds(action) > READER_START_WAIT:  # it does not come up
                    return _read_apart(action, key, command, path, number, spec, fresh_copy)
                state_reader_warm()
            return None
        if "stale" in answer:  # the reader ran older code of the pipeline (and ends): a new process reads
            return _read_apart(action, key, command, path, number, spec, fresh_copy)
        if "error" in answer:
            raise ActionFailed(f"Spark could not {command} the state: {answer['error']}")
        return answer
    return tool_process(action, f"{key}-process", command, path, number, spec)


def state_read_early(action: Action, key: str) -> dict[str, Any] | None:
    """What the warm reader said of a spooled request before its answer (a plan's verdict, given once Spark has
    planned the batch and before the batch has run), if it said anything yet."""
    if not (action.memo.get(key) or {}).get("spool"):
        return None
    try:
        return dict(json.loads(_spool_file(key, action, "verdict").read_text()))
    except (FileNotFoundError, ValueError):
        return None


def _read_apart(
    action: Action, key: str, command: str, path: Path, number: int, spec: dict[str, Any] | None,
    fresh_copy: Callable[[], None] | None,
) -> dict[str, Any] | None:  # fmt: skip
    _spool_withdraw(key, action)
    if fresh_copy is not None:
        fresh_copy()
    memo_save(action, **{key: {"process": True}})
    return tool_process(action, f"{key}-process", command, path, number, spec)


def _spool_file(key: str, action: Action, kind: str) -> Path:
    # the reader's own spool, beside its socket (workers/spark/state_reader.py ``spool_of``): one per deployment
    return settings.STATE_READER_SOCKET.with_suffix(".spool") / f"action-{action.id}-{key}.{kind}"


def _spool_put(key: str, action: Action, request: dict[str, Any]) -> None:
    target = _spool_file(key, action, "request")
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for kind in ("answer", "verdict"):
        _spool_file(key, action, kind).unlink(missing_ok=True)
    partial = target.with_suffix(".writing")
    partial.write_text(json.dumps(request))
    partial.rename(target)


def _spool_take(key: str, action: Action) -> dict[str, Any] | None:
    answer = _spool_file(key, action, "answer")
    try:
        found = dict(json.loads(answer.read_text()))
    except FileNotFoundError:
        return None
    except ValueError as exc:  # written whole by a rename: only a damaged disk gets here
        found = {"error": f"the reader's answer could not be read: {exc}"}
    answer.unlink(missing_ok=True)
    _spool_file(key, action, "verdict").unlink(missing_ok=True)
    return found


def _spool_withdraw(key: str, action: Action) -> None:
    for kind in ("request", "taken", "answer", "verdict"):
        _spool_file(key, action, kind).unlink(missing_ok=True)


def _last_json(log: Path) -> dict[str, Any] | None:
    """The state tool's answer: the last line of its output that is a JSON object (Spark's own log lines are not)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                return dict(json.loads(line))
    return None
