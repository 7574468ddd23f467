"""Steps that several actions share, and what a step answers the engine (dashboard/services/actions.py).

An action is a sequence of named steps. A step does a bounded piece of work and answers ``Next(step)`` (go on to
that step now), ``Wait(note)`` (nothing to do until something outside changes: a driver stops, a run comes up,
Spark's reader starts, a process of its own ends; the worker is freed and the step is visited again later), or
``Done(outcome)``; it raises ``ActionFailed`` to end the action with the reason. A step may run again from its start
(its worker was killed), so each one is written to be safe to repeat: it checks what is already done first.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.utils import timezone

from dashboard import pipelines
from dashboard.models import ACTIVE_RUN_STATUSES, Action, Job, Run, RunStatus
from dashboard.services.enqueue import RUN_ACTION
from dashboard.services.errors import ActionFailed, ActionRefused
from dashboard.services.processes import processes_running
from dashboard.services.runs import (
    job_request_start,
    job_request_stop,
    pid_alive,
    run_holds_process,
    run_launch,
    spawn_process,
)  # fmt: skip


@dataclass(frozen=True)
class Next:
    step: str


@dataclass(frozen=True)
class Wait:
    note: str
    seconds: float = 1.0


@dataclass(frozen=True)
class Done:
    outcome: str


Outcome = Next | Wait | Done
Step = Callable[[Action], Outcome]
# An action kind's steps in order, each with the label its phase is shown under; the first is where it begins.
Steps = dict[str, tuple[str, Step]]


def branch_targets(step: Step) -> set[str]:
    """The steps ``step`` may go on to: the names its ``Next(...)`` calls give (a conditional's both branches), and
    the ``then`` a step factory bound it to (``stop_step(then="savepoint")``). Empty when its source is not at hand."""
    found: set[str] = set()
    code = getattr(step, "__code__", None)
    for name, cell in zip(code.co_freevars if code else (), getattr(step, "__closure__", None) or (), strict=True):
        if name == "then" and isinstance(cell.cell_contents, str):
            found.add(cell.cell_contents)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(step)))
    except (OSError, TypeError, SyntaxError):
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Next" and node.args:
            found |= _names(node.args[0])
    return found


def _names(node: ast.expr) -> set[str]:
    """The step names an argument of ``Next`` may be: a literal, or either branch of a conditional."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.IfExp):
        return _names(node.body) | _names(node.orelse)
    return set()


def check_steps(kind: str, steps: Steps) -> None:
    """Refuse a table of steps one of whose steps may go on to a step the table lacks (ValueError, naming both)."""
    for name, (_, step) in steps.items():
        if missing := sorted(branch_targets(step) - steps.keys()):
            raise ValueError(f"{kind}: step {name!r} may go on to {', '.join(map(repr, missing))}, which it lacks")


def one_step(label: str, work: Callable[[Action], str]) -> Steps:
    """An action that is a single bounded piece of work (a disposal, a re-drive): one step, then done."""
    return {"run": (label, lambda action: Done(work(action)))}


def step_seconds(action: Action) -> float:
    """How long the action has been at its current step (across visits and resumptions)."""
    started = action.step_started_at
    return (timezone.now() - started).total_seconds() if started else 0.0


NoneType = type(None)
Kind = type | tuple[type, ...]

# What a step leaves for its next visit or a later step (``memo_save``), each key with its type. A key not declared
# here, or a value of another type, fails the step at once, naming the key: not a KeyError three steps later.
MEMO: dict[str, Kind] = {
    "abort_reason": str,  # blue/green: why it goes on to "abort"
    "after_savepoint": str,  # rescale: the step its savepoint (taken once the new run is up) goes on to
    "batch": int,  # the batch a partition count reads
    "blue_missing_since": (str, NoneType),  # blue/green: since when blue has had no run (ISO time)
    "failure": str,  # upgrade: why the new version failed, for "roll-back"
    "forked": bool,  # blue/green: green's fork is made
    "green_ended": str,  # blue/green: why green's run ended
    "green_starts": int,  # blue/green: green's runs started, bounded
    "input_waiting": bool,  # upgrade, rescale: records wait for the new run's first batch
    "load_proof": str,  # rescale: "first-batch" when the new run's first batch is to show the repartitioned state loads
    "load_failure": str,  # rescale: why Spark could not load the repartitioned state, for "back"
    "migrated": bool,  # upgrade: the migration wrote the new line's seed
    "migration_begun": bool,
    # migration preview: the input range of the first batch ({"id", "n"}; Kafka's {topic: {partition: offset}})
    "migration_start": dict,
    "migration_end": (dict, NoneType),  # None: no input after the batch to run a first batch on
    "plan_batch": int,  # upgrade preview: the batch the scratch copy re-runs
    "plan_full": bool,  # upgrade preview: the re-run on the trimmed copy failed; it runs again on a full one
    "previous": str,  # the checkpoint directory a fork replaced
    "put_back": str,  # upgrade rollback: what was put back
    "rescaled": str,  # rescale: its outcome as it started the new run, which "first-batch" completes
    "savepoint_failure": str,  # rescale: why its savepoint, taken once the new run is up, could not be
    "sinks_at_stop": dict,  # rescale: each sink's last batch as the job stopped, for its savepoint's manifest
    "source": dict,  # state inspector: the copy read ({"path", "batch", "origin"})
    "stopped_batch": int,  # rescale: the newest committed batch of the checkpoint it stopped on (its savepoint's)
    "stopped_offset": (dict, NoneType),  # rescale: where that batch ended in the source
}
# A Spark read's or a process's own record under its key (``state_read``, ``tool_process``): these keys, each also
# with a number after it (``verify-12``: savepoint 12's), "-process" after either (its process of its own).
TOOL_KEYS = ("check-state", "check-after", "inspect", "migration", "plan", "rows", "verify", "repartition", "shadow")
MEMO.update(dict.fromkeys(TOOL_KEYS, dict))

# What the operator sees with the action (``remember``), each key with its type; the values an action is requested
# with are checked where it is requested (the form, the API).
PARAMS: dict[str, Kind] = {
    "after": dict,
    "before": dict,  # rescale: the scale after and before
    "bg_batch": (int, NoneType),
    "blue_run": (int, NoneType),
    "green_run": int,
    "fork": str,
    "follow": str,  # blue/green
    "handed_over": bool,
    "pipeline": str,  # blue/green: the version green runs (the job's own for a rescale alone)
    "shift": int,  # blue/green: how far green's batch numbers run ahead of blue's (a rescale 1, a migration -(K+1))
    "green_start": dict,  # blue/green migration: where green's new checkpoint starts reading (the savepoint's end)
    "state_partitions": int,  # blue/green rescale: as requested
    "handover_after": (int, NoneType),
    "handover_at": str,
    "gap_seconds": (float, int, NoneType),
    "first_batch": int,
    "replaced": list,  # blue/green: the old version's batches past the handover that green wrote again
    "ending": dict,
    "start": dict,
    "records": int,
    "shadow": dict,  # shadow run
    "from_backend": str,
    "from_deploy": (int, NoneType),
    "from_parameters": dict,
    "from_pipeline": str,  # upgrade
    "parameters": dict,
    "plan": dict,
    "plan_from": int,  # upgrade: the preview whose plan it took
    "migration": dict,
    "proof": dict,
    "kept": str,
    "had_state": bool,
    "stopped_at": str,
    "was_running": bool,
    "replay_records": (int, NoneType),  # restore and rollback: the records the replay reads
    "run": int,
    "rollback_run": int,  # the run an action started (``start_once``)
    "back_run": int,  # rescale: the run started on the original checkpoint, the repartitioned state not loading
    "savepoint": (int, NoneType),
}


def _checked(declared: dict[str, Kind], where: str, values: dict[str, Any]) -> None:
    for name, value in values.items():
        family = re.sub(r"(-\d+)?(-process)?$", "", name) if where == "memo" else name
        if (kind := declared.get(name) or declared.get(family)) is None:
            raise TypeError(f"{where} key {name!r} is not declared (dashboard/services/action_steps.py)")
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
            raise TypeError(f"{where} key {name!r} holds {type(value).__name__}, not {_named(kind)}")


def _kinds(kind: Kind) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _named(kind: Kind) -> str:
    return " or ".join("None" if k is NoneType else k.__name__ for k in _kinds(kind))


def memo_save(action: Action, **values: Any) -> None:
    """Keep values for the step's next visit (a process's pid, a run it requested): declared in ``MEMO``."""
    _checked(MEMO, "memo", values)
    action.memo = {**action.memo, **values}
    Action.objects.filter(id=action.id).update(memo=action.memo)


def remember(action: Action, **params: Any) -> None:
    """Keep values the operator sees with the action (a plan, a savepoint, the run it started): declared in
    ``PARAMS``."""
    _checked(PARAMS, "params", params)
    action.params = {**action.params, **params}
    Action.objects.filter(id=action.id).update(params=action.params)


def action_progress(action: Action, text: str) -> None:
    Action.objects.filter(id=action.id).update(progress=text[:300])
    action.progress = text


# The commands the warm state reader answers (a plan re-runs one batch on a scratch copy, a migration writes a new
# checkpoint's seed and may run its first batch, a repartition rewrites a copy's state, each in a session of its own:
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


def active_run(job: Job) -> Run | None:
    return job.runs.filter(status__in=ACTIVE_RUN_STATUSES).first()


def alive_run(job: Job) -> Run | None:
    """A run whose driver may still touch the checkpoint: one in flight, or an ended one whose process on this host
    is still there (a fenced driver on its way out)."""
    if (run := active_run(job)) is not None:
        return run
    return next((r for r in job.runs.order_by("-id")[:5] if run_holds_process(r)), None)


def refuse_while_alive(job: Job, doing: str) -> None:
    """Checkpoint files are changed only while no driver of the job is alive."""
    if (run := alive_run(job)) is not None:
        state = run.get_status_display().lower() if run.is_active else f"{run.status}, its process still alive"
        raise ActionRefused(f"{job.name} has run #{run.id} ({state}): stop it before {doing}; nothing was changed.")


def settled(action: Action, job: Job, doing: str) -> Wait | None:
    """None once no driver of the job is alive. A run in flight is refused (the operator stops it first); a run that
    has ended but whose process is still on its way out (a driver of its own drains, closes its sinks and its JVM for
    some seconds after the API says stopped) is waited for, as a stop with a savepoint waits."""
    run = alive_run(job)
    if run is None:
        return None
    if run.is_active:
        refuse_while_alive(job, doing)
    if step_seconds(action) > settings.STOP_GRACE_SECONDS + 30:
        raise ActionFailed(
            f"run #{run.id} of {job.name} ended but its driver process is still alive; nothing was changed"
        )
    return Wait(f"run #{run.id} has stopped: waiting for its driver process to exit before {doing}", 0.5)


def stopped(action: Action, job: Job) -> Wait | None:
    """None once the job has no run in flight; else ask its driver to drain and stop (asking again is harmless) and
    wait. Fails when it has not stopped within the stop grace (the supervisor kills it past that)."""
    if active_run(job) is None:
        return None
    if step_seconds(action) > settings.STOP_GRACE_SECONDS + 30:
        raise ActionFailed(f"{job.name} did not stop in time; nothing else was changed")
    with contextlib.suppress(ActionRefused):  # it stopped between the look and the request
        job_request_stop(job=job)
    return Wait("stopping the job: the batch in flight commits first", 0.5)


def exited(action: Action, job: Job, seconds: float = 60) -> Wait | None:
    """None once no driver process of the job is alive (a failed driver ends a few seconds after its run ended); the
    checkpoint is touched only after."""
    run = alive_run(job)
    if run is None:
        return None
    if step_seconds(action) > seconds:
        raise ActionFailed(f"run #{run.id} of {job.name} is still alive; nothing was restored")
    return Wait(f"waiting for run #{run.id}'s driver process to end", 0.5)


def stop_step(then: str) -> tuple[str, Step]:
    """A step that stops the job (see ``stopped``) and goes on to ``then``."""
    return "stop the job", lambda action: stopped(action, action.job) or Next(then)


def exit_step(then: str) -> tuple[str, Step]:
    """A step that waits for every driver process of the job to end (see ``exited``) and goes on to ``then``."""
    return "the driver exits", lambda action: exited(action, action.job) or Next(then)


def start_once(action: Action, key: str = "run", launch: bool = False) -> Run:
    """Start the job for this action, once however often the step runs: a run requested by an earlier visit (its
    worker killed between the request and the record of it) is adopted, not refused. With ``launch`` the step starts
    the driver itself (an action that then watches the run gains the queue's latency; the queued start task finds it
    launched and does nothing); either way the action never waits for a task to be picked up."""
    job = action.job
    if (known := action.params.get(key)) is not None:
        return Run.objects.get(id=known)
    began = action.step_started_at
    active = job.runs.filter(status__in=ACTIVE_RUN_STATUSES).first()
    if active is not None and began is not None and active.requested_at >= began:
        run = active
    else:
        run = job_request_start(job=job, requested_by=action.requested_by)
    remember(action, **{key: run.id})
    if launch and run.status == RunStatus.PENDING:
        run_launch(run_id=run.id)
        run.refresh_from_db()
    return run


def run_up(action: Action, run: Run, limit: float = 600) -> Wait | str | None:
    """None once the run's query is running; a Wait while it starts; the reason (a string) when it ended first."""
    run.refresh_from_db()
    if run.status == RunStatus.RUNNING:
        return None
    if not run.is_active:
        return run.message or f"run #{run.id} ended {run.status}"
    if step_seconds(action) > limit:
        return f"run #{run.id} was still {run.status} after {limit:.0f} s"
    return Wait(f"run #{run.id} {run.get_status_display().lower()}: waiting for its query to run", 0.5)


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
