"""What an action's steps keep (``memo_save``: for their next visit; ``remember``: what the operator sees with the
action), each key declared with its type, and the action's progress line."""

from __future__ import annotations

import re
from typing import Any

from dashboard.models import Action
from dashboard.services.action_steps import Kind, NoneType

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
    # rescale: its outcome's parts as it started the new run ("scale", "notes", "offline" s, "then" the first batch
    # and the like): the outcome is said from them at the end, never parsed back
    "rescaled": dict,
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
