"""Rescaling: compute (cores) by a restart; state partitions by stop, Spark's offline repartition on a fork, restart,
savepoint. The savepoint is kept for rollback; the original checkpoint directory is untouched.

While the job is stopped only what the restart needs runs: the copy and its repartition. The savepoint of the batch
the job stopped at is taken once the new run is up (its first batch committed, when records wait for it), from the
original checkpoint directory: the job no longer runs there, so nothing writes to it between the stop and the copy,
and the copy no longer holds the job's output up (about a second on the busy demo stack: docs/benchmarks.md). Until
that copy is made the original directory itself is the way back ("back" returns to it). Spark's reading of the
savepoint (its verification) follows its copy, as an upgrade's follows its first batch. That Spark loads the
repartitioned state is shown by the new run's first batch when records wait for it (a batch loads every state
partition's store at its new count before it commits), and by the state reader before the restart otherwise.
Should the new run end before its first batch (or have none within FIRST_BATCH_WAIT), the reader reads the
repartitioned copy then; one Spark cannot load sends the job back to its original checkpoint and scale ("back"),
which the rescale never wrote to."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from django.utils import timezone

from dashboard.checkpoint_dir.files import (
    CheckpointError,
    batch_offsets,
    copy_checkpoint,
    directory_bytes,
    latest_committed,
    remove_tree,
)
from dashboard.models import Action, Job, Run, Savepoint
from dashboard.services.action_keys import (
    SAVEPOINT_TAKEN,
    SPARK_READS,
    STARTED,
    Keys,
    action_progress,
    memo_save,
    remember,
)
from dashboard.services.action_steps import Done, Next, NoneType, Outcome, Steps, Wait, step_seconds
from dashboard.services.errors import ActionFailed
from dashboard.services.forks import fork_name, switch_to_fork
from dashboard.services.run_waits import start_once, stopped
from dashboard.services.savepoints import (
    records_after,
    records_after_savepoint,
    savepoint_copy,
    savepoint_files_checked,
    savepoint_read_after,
    sinks_last_batches,
)
from dashboard.services.state_reader_client import state_read, tool_process
from dashboard.services.upgrades import first_batch

MEMORY_REPARTITION = (
    "State partitions of a memory-backend job cannot change: Spark's offline repartition supports only RocksDB state "
    "(it answers STATE_REPARTITION_INVALID_CHECKPOINT.UNSUPPORTED_PROVIDER for the HDFS-backed store). The "
    "parallelism (cores) can still change."
)
BACKEND_SWITCH = (
    "Switching between the memory and RocksDB backends is not offered: Spark records the state store provider in the "
    "checkpoint at the first batch and refuses another one on restart, and its state reader cannot re-seed a "
    "dropDuplicates or aggregation operator in a new checkpoint. Only transformWithState jobs could be re-seeded "
    "(through initialState), and they already need RocksDB."
)
REPARTITION_LIMIT = 1800  # seconds Spark's offline repartition may take before the rescale gives up


def _target(action: Action) -> tuple[int, int]:
    job = action.job
    before = action.params.get("before") or {"parallelism": job.parallelism, "state_partitions": job.state_partitions}
    return (
        int(action.params.get("parallelism") or before["parallelism"]),
        int(action.params.get("state_partitions") or before["state_partitions"]),
    )


def _repartitions(action: Action) -> bool:
    return _target(action)[1] != action.params["before"]["state_partitions"] and bool(action.params["had_state"])


def _check(action: Action) -> Next:
    job = action.job
    before = {"parallelism": job.parallelism, "state_partitions": job.state_partitions}
    parallelism, partitions = _target(action)
    if not 1 <= parallelism <= 64 or not 1 <= partitions <= 1024:
        raise ActionFailed("Parallelism must be 1–64 and state partitions 1–1024.")
    if (parallelism, partitions) == (before["parallelism"], before["state_partitions"]):
        raise ActionFailed("Nothing to change: that is the current scale.")
    if partitions != before["state_partitions"] and job.state_backend == "memory" and job.has_state():
        raise ActionFailed(MEMORY_REPARTITION)
    remember(action, before=before, was_running=job.runs.filter(status="running").exists(), had_state=job.has_state())
    return Next("stop")


def _rescale_stop(action: Action) -> Outcome:
    job = action.job
    if (waiting := stopped(action, job)) is not None:
        return waiting
    remember(action, stopped_at=timezone.now().isoformat())
    if not _repartitions(action):
        return Next("apply")
    try:  # what the savepoint, taken once the new run is up, is of: the newest batch where the job stopped
        batch = latest_committed(job.checkpoint_location)
        offset = (batch_offsets(job.checkpoint_location, batch)["sources"] or [None])[0]
    except CheckpointError as exc:
        raise ActionFailed(f"{STAYS_STOPPED}: {exc}") from None
    memo_save(action, stopped_batch=batch, stopped_offset=offset, sinks_at_stop=sinks_last_batches(job))
    return Next("repartition")


def _records_waiting(action: Action) -> bool:
    """Whether records wait for the new run after the batch the job stopped at (where its savepoint will be)."""
    if "stopped_batch" not in action.memo:  # an action begun with its savepoint taken before the repartition
        return records_after_savepoint(action)
    return records_after(action.job, action.memo["stopped_offset"])


def _savepoint_first(action: Action, then: str) -> Next | None:
    """Next("savepoint") when the rescale's savepoint is still to be taken (it repartitioned, and switched the job
    off its original checkpoint), going on to ``then`` after it; None when there is none to take."""
    if action.params.get("savepoint") is not None or "previous" not in action.memo:
        return None
    memo_save(action, after_savepoint=then)
    return Next("savepoint")


def _savepoint(action: Action) -> Next:
    """The savepoint of the batch the job stopped at, copied from the checkpoint directory it left (nothing writes
    there since its stop)."""
    job, memo = action.job, action.memo
    try:
        if "previous" in memo and "stopped_batch" in memo:
            source, batch = job.directory / memo["previous"], memo["stopped_batch"]
            savepoint_copy(
                job=job, action=action, origin="before-rescale", batch=batch, source=source, sinks=memo["sinks_at_stop"]
            )  # fmt: skip
        else:  # an action begun before this order: the job still on the checkpoint it stopped on
            savepoint_copy(job=job, action=action, origin="before-rescale")
    except ActionFailed as exc:
        if "after_savepoint" not in memo:  # the order before: nothing has changed yet
            raise
        memo_save(action, savepoint_failure=str(exc)[:1000])  # the rescale stands: its outcome says so
        return Next(memo["after_savepoint"])
    return Next("verify")


def _copy(action: Action) -> Path:
    """The checkpoint copy the rescale repartitions, and the job runs on once rescaled."""
    return action.job.directory / fork_name(action, "rescale")


def _repartition(action: Action) -> Outcome:
    job = action.job
    partitions = _target(action)[1]
    target = _copy(action)

    def copy() -> None:  # the job is stopped: its newest committed batch is the savepoint's
        remove_tree(target)
        try:
            copy_checkpoint(job.checkpoint_location, target, latest_committed(job.checkpoint_location))
        except CheckpointError as exc:
            remove_tree(target)
            raise ActionFailed(f"{STAYS_STOPPED}: {exc}") from None

    if "repartition" not in action.memo:
        copy()
    return repartition_wait(action, target, partitions, STAYS_STOPPED, copy) or Next("check-state")


FIRST_BATCH = "first-batch"  # the memo's ``load_proof``: the new run's first batch shows the state loads


def _restarts(action: Action) -> bool:
    """Whether the rescale starts the job once rescaled: it ran, or the request asks for a start."""
    return bool(action.params["was_running"] or action.params.get("start"))


def _check_state(action: Action) -> Outcome:
    """Spark's state reader loads the repartitioned copy, unless the job restarts with records waiting: then its first
    batch shows it, and the job's output stops that much less (the reader's load took 1.6-1.8 s of a 6-7.5 s gap on
    the busy demo stack: docs/benchmarks.md)."""
    if _restarts(action) and (action.memo.get("load_proof") == FIRST_BATCH or _records_waiting(action)):
        memo_save(action, load_proof=FIRST_BATCH)
        return Next("apply")
    target = _copy(action)
    return state_loads_wait(action, target, STAYS_STOPPED) or Next("apply")


def _check_after(action: Action) -> Outcome:
    """The new run did not show that Spark loads the repartitioned state (it ended before its first batch, or had none
    within FIRST_BATCH_WAIT): the state reader reads the copy now. Loaded, the rescale stands, and says why the run
    showed nothing; else the job goes back to its original checkpoint ("back")."""
    target = _copy(action)
    try:
        if state_read(action, "check-after", "verify", target, latest_committed(target)) is None:
            return Wait("checking that Spark loads the repartitioned state", 0.5)
    except (CheckpointError, ActionFailed) as exc:
        memo_save(action, load_failure=str(exc)[:1000])
        return Next("back")
    run = Run.objects.get(id=action.params["run"])
    why = f"run #{run.id} committed no batch within {FIRST_BATCH_WAIT} s" if run.is_active else _ended_first(run)
    return _rescaled(action, f"{_words(action)}; {why}; Spark loads the repartitioned state")


def _back(action: Action) -> Outcome:
    """Spark could not load the repartitioned state: the job back on the checkpoint directory and the scale it had
    (untouched since its stop: the repartition wrote into a copy), and started again if it ran; the action fails,
    saying so. The repartitioned copy and the savepoint are kept."""
    job = action.job
    if (waiting := stopped(action, job)) is not None:
        return waiting
    before, previous = action.params["before"], action.memo["previous"]
    if job.checkpoint_dir != previous:
        switch_to_fork(job, previous)
    Job.objects.filter(id=job.id).update(
        parallelism=before["parallelism"], state_partitions=before["state_partitions"], updated_at=timezone.now()
    )
    job.refresh_from_db()
    started = ""
    if _restarts(action):
        started = f"; run #{start_once(action, key='back_run', launch=True).id} starting"
    spec = ""
    if action.params.get("from_spec"):  # the applied spec holds the scale asked (``_apply``): its drift says so
        spec = (
            f" The spec applied still asks for {scale_change(action.params['after'], action.params['after'])}: the job "
            "page shows the difference, and the next `statekeeper plan` proposes this rescale again."
        )
    raise ActionFailed(
        f"Spark could not load the repartitioned state ({action.memo['load_failure']}). The job is back on its "
        f"original checkpoint ({previous}) at {scale_change(before, before)}{started}: nothing was lost. The "
        f"repartitioned copy ({fork_name(action, 'rescale')}) is kept to look into, and savepoint "
        f"#{action.params.get('savepoint')} too.{spec}"
    )


STAYS_STOPPED = "Repartition failed, nothing changed (the job stays stopped)"
# A copy's state up to this size is repartitioned by the warm state reader (seconds, no JVM to start while the job
# waits); a larger one by a process of its own, which holds no preview or verification up behind it.
READER_REPARTITION_BYTES = 256 * 2**20


def repartition_wait(
    action: Action, copy: Path, partitions: int, failed: str, fresh_copy: Callable[[], None]
) -> Wait | None:
    """Spark's offline repartition of ``copy`` (a checkpoint copy of the action's, which ``fresh_copy`` makes again
    should a reader die while writing into it) into ``partitions``: by the warm state reader, or by a process of its
    own for a state over READER_REPARTITION_BYTES. A Wait while it runs, None once done. ActionFailed (``failed``,
    then why) when it fails or outlasts REPARTITION_LIMIT; the copy is removed then. It writes one batch of no input
    after the copy's last: the repartitioned state."""
    asked = action.memo.get("repartition")
    apart = "pid" in asked if asked else directory_bytes(copy / "state") > READER_REPARTITION_BYTES
    try:
        if apart:
            done = tool_process(action, "repartition", "repartition", copy, partitions, None)
        else:
            done = state_read(action, "repartition", "repartition", copy, partitions, None, fresh_copy)
    except ActionFailed as exc:
        remove_tree(copy)
        raise ActionFailed(f"{failed}: {exc}") from None
    if done is not None:
        return None
    if step_seconds(action) > REPARTITION_LIMIT:
        remove_tree(copy)
        raise ActionFailed(f"{failed}: Spark's repartition did not finish within {REPARTITION_LIMIT} s")
    return Wait(f"Spark repartitions a copy of the state into {partitions} partitions", 0.5)


def state_loads_wait(action: Action, copy: Path, failed: str) -> Wait | None:
    """Spark's state reader loads the repartitioned ``copy`` (its newest committed batch): a Wait while it reads,
    None once it did; ActionFailed as ``repartition_wait``."""
    action_progress(action, "checking that Spark loads the repartitioned state")
    try:
        if state_read(action, "check-state", "verify", copy, latest_committed(copy)) is None:
            return Wait("checking that Spark loads the repartitioned state", 0.5)
    except (CheckpointError, ActionFailed) as exc:
        remove_tree(copy)
        raise ActionFailed(f"{failed}: {exc}") from None
    return None


def _verify_files(action: Action) -> Next:
    savepoint_files_checked(action)
    return Next(action.memo.get("after_savepoint", "repartition"))  # "repartition": begun in the order before


def _apply(action: Action) -> Outcome:
    job = action.job
    parallelism, partitions = _target(action)
    fork = fork_name(action, "rescale")
    if _repartitions(action) and job.checkpoint_dir != fork:
        memo_save(action, previous=job.checkpoint_dir)  # where "back" returns the job to
        switch_to_fork(job, fork)
    Job.objects.filter(id=job.id).update(
        parallelism=parallelism, state_partitions=partitions, updated_at=timezone.now()
    )
    job.refresh_from_db()
    after = {"parallelism": parallelism, "state_partitions": partitions}
    remember(action, after=after)
    if action.params.get("from_spec"):  # asked by `statekeeper apply`: the applied spec holds the new scale
        job.spec_applied(after)
    notes = []
    if savepoint_id := action.params.get("savepoint"):  # taken before the repartition, in the order before
        notes.append(f"savepoint #{Savepoint.objects.get(id=savepoint_id).id} kept for rollback")
    if _restarts(action):
        notes.append(f"run #{start_once(action, launch=True).id} starting")
        memo_save(action, input_waiting=_records_waiting(action))
    stopped_at = datetime.fromisoformat(action.params["stopped_at"])
    downtime = (timezone.now() - stopped_at).total_seconds()
    memo_save(action, rescaled={"scale": scale_change(action.params["before"], after), "notes": notes,
                                "offline": round(downtime, 1), "then": []})  # fmt: skip
    return Next("first-batch")


def _said(parts: dict[str, Any]) -> str:
    """The rescale's outcome in an operator's words, from its parts (``rescaled`` in the memo)."""
    return (
        f"Rescaled: {parts['scale']}; {', '.join(parts['notes']) or 'job left stopped'}; offline for "
        f"{parts['offline']:.1f} s before the restart request" + "".join(f"; {then}" for then in parts["then"])
    )


def _first_batch(action: Action) -> Outcome:
    """The new run's first batch (when records wait for it), then the savepoint (``_savepoint_first``) and Spark's
    reading of it."""
    parts = dict(action.memo["rescaled"])
    proof = action.memo.get("load_proof") == FIRST_BATCH
    if run_id := action.params.get("run"):
        run = Run.objects.get(id=run_id)
        if (batch := first_batch(run, None)) is not None:
            parts["then"] = [*parts["then"], f"its first batch ({batch}) committed"
                             + (": Spark loaded the repartitioned state" if proof else "")]  # fmt: skip
        elif proof and (not run.is_active or step_seconds(action) >= FIRST_BATCH_WAIT):
            return _savepoint_first(action, "check-after") or Next("check-after")
        elif not run.is_active:
            parts["then"] = [*parts["then"], _ended_first(run)]
        elif (proof or action.memo.get("input_waiting")) and step_seconds(action) < FIRST_BATCH_WAIT:
            return Wait(f"run #{run.id} starting: waiting for its first batch", 0.5)
    if then := _savepoint_first(action, "settle"):
        memo_save(action, rescaled=parts)
        return then
    return _rescaled(action, _said(parts))


def _settle(action: Action) -> Outcome:
    return _rescaled(action, _words(action))


def _words(action: Action) -> str:
    """The rescale's outcome so far, with its savepoint once taken (after the new run's start: ``_savepoint``)."""
    parts = dict(action.memo["rescaled"])
    savepoint = action.params.get("savepoint")
    if failure := action.memo.get("savepoint_failure"):
        return (f"{_said(parts)}; its savepoint could not be taken ({failure}): the checkpoint directory it left, "
                f"{action.memo['previous']}, is kept as the way back; take a savepoint now")  # fmt: skip
    kept = f"savepoint #{savepoint} kept for rollback"
    if savepoint is not None and kept not in parts["notes"]:  # taken after the new run's start: named first
        parts["notes"] = [kept, *parts["notes"]]
    return _said(parts)


def _ended_first(run: Run) -> str:
    return f"run #{run.id} ended {run.status} before its first batch ({run.message or 'no message'})"


def _rescaled(action: Action, done: str) -> Outcome:
    """The rescale's outcome once its new run is settled: after Spark's reading of the savepoint."""
    if isinstance(checked := savepoint_read_after(action), Wait):
        return checked
    if checked:  # first: the Runs tab shortens a long outcome
        done = (f"Savepoint #{action.params['savepoint']}, the way back, failed its verification: take a savepoint "
                f"now ({checked}). {done}")  # fmt: skip
    return Done(done + ".")


# How long a rescale waits for its new run's first batch (records waiting) before Spark reads the savepoint anyway
FIRST_BATCH_WAIT = 120


def scale_change(before: dict[str, int], after: dict[str, int]) -> str:
    """'parallelism 1 → 2, state partitions 4': what changed, then what stayed, in an operator's words."""
    words = {"parallelism": "parallelism", "state_partitions": "state partitions"}
    changed = [f"{words[k]} {before.get(k)} → {after[k]}" for k in words if before.get(k) != after[k]]
    kept = [f"{words[k]} {after[k]}" for k in words if before.get(k) == after[k]]
    return ", ".join(changed + kept)


RESCALE_KEYS = (
    SPARK_READS + STARTED + SAVEPOINT_TAKEN + Keys(
        memo={
            "after_savepoint": str,  # the step its savepoint (taken once the new run is up) goes on to
            "input_waiting": bool,  # records wait for the new run's first batch
            "load_failure": str,  # why Spark could not load the repartitioned state, for "back"
            "load_proof": str,  # "first-batch": the new run's first batch shows the repartitioned state loads
            "previous": str,  # the checkpoint directory the repartitioned copy replaced
            # its outcome's parts as it started the new run ("scale", "notes", "offline" s, "then" the first batch
            # and the like): the outcome is said from them at the end, never parsed back
            "rescaled": dict,
            "savepoint_failure": str,  # why its savepoint, taken once the new run is up, could not be
            "sinks_at_stop": dict,  # each sink's last batch as the job stopped, for its savepoint's manifest
            "stopped_batch": int,  # the newest committed batch of the checkpoint it stopped on (its savepoint's)
            "stopped_offset": (dict, NoneType),  # where that batch ended in the source
        },
        params={
            "after": dict, "before": dict,  # the scale after and before
            "back_run": int,  # the run started on the original checkpoint, the repartitioned state not loading
            "had_state": bool, "stopped_at": str, "was_running": bool,
        },
    )
)  # fmt: skip
RESCALE_STEPS: Steps = {
    "check": ("check the new scale", _check),
    "stop": ("stop the job", _rescale_stop),
    "repartition": ("repartition a copy of the state", _repartition),
    "check-state": (
        "Spark loads the repartitioned state (or, records waiting, the new run's first batch)",
        _check_state,
    ),
    "apply": ("switch and start", _apply),
    "first-batch": ("its first batch", _first_batch),
    "savepoint": ("copy the checkpoint it stopped at (the savepoint)", _savepoint),
    "verify": ("verify the savepoint's files", _verify_files),
    "settle": ("Spark reads the savepoint", _settle),
    "check-after": ("no first batch: Spark loads the repartitioned state", _check_after),
    "back": ("back to the original checkpoint", _back),
}
