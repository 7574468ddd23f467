"""What an action's steps keep (``memo_save``: for their next visit; ``remember``: what the operator sees with the
action), declared per action kind with each key's type (``Keys``, written beside the kind's step table), and the
action's progress line. A key its kind does not declare, or a value of another type, fails the step at once, naming the
key and the kind: not a KeyError three steps later, nor a key one kind writes and another misreads."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dashboard.models import Action
from dashboard.services.action_steps import Kind, NoneType


@dataclass(frozen=True)
class Keys:
    """What an action of one kind keeps, each key with its type: ``memo``, for its steps' next visits; ``params``,
    what the operator sees with it. ``+`` joins the keys of the parts a kind's steps share (a fork, a Spark read);
    a key two parts declare with two types fails at load."""

    memo: Mapping[str, Kind] = field(default_factory=dict)
    params: Mapping[str, Kind] = field(default_factory=dict)

    def __add__(self, other: Keys) -> Keys:
        for mine, theirs in ((self.memo, other.memo), (self.params, other.params)):
            if clash := sorted(k for k in mine.keys() & theirs.keys() if mine[k] != theirs[k]):
                raise TypeError(f"keys declared twice with two types: {', '.join(clash)}")
        return Keys(memo={**self.memo, **other.memo}, params={**self.params, **other.params})


# A Spark read's or a process's own record under its key (``state_read``, ``tool_process``): these keys, each also
# with a number after it (``verify-12``: savepoint 12's), "-process" after either (its process of its own).
TOOL_KEYS = ("check-state", "check-after", "inspect", "migration", "plan", "rows", "verify", "repartition", "shadow")
SPARK_READS = Keys(memo=dict.fromkeys(TOOL_KEYS, dict))
STARTED = Keys(params={"run": int})  # the run an action started (``start_once``)
SAVEPOINT_TAKEN = Keys(params={"savepoint": (int, NoneType)})  # the savepoint an action took or started from

_DECLARED: dict[str, Keys] = {}


def declare_keys(kind: str, keys: Keys) -> None:
    """What actions of ``kind`` keep: called once per kind where the step tables are registered (``actions.STEPS``)."""
    _DECLARED[kind] = keys


def _checked(action: Action, where: str, values: dict[str, Any]) -> None:
    keys = _DECLARED.get(action.kind)
    if keys is None:
        raise TypeError(f"the action kind {action.kind!r} declares no keys (dashboard/services/actions.py KEYS)")
    declared = keys.memo if where == "memo" else keys.params
    for name, value in values.items():
        family = re.sub(r"(-\d+)?(-process)?$", "", name) if where == "memo" else name
        if (kind := declared.get(name) or declared.get(family)) is None:
            raise TypeError(f"{where} key {name!r} is not declared for a {action.kind} (the Keys beside its steps)")
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
            raise TypeError(f"{where} key {name!r} of a {action.kind} holds {type(value).__name__}, not {_named(kind)}")


def _kinds(kind: Kind) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _named(kind: Kind) -> str:
    return " or ".join("None" if k is NoneType else k.__name__ for k in _kinds(kind))


def memo_save(action: Action, **values: Any) -> None:
    """Keep values for the step's next visit (a process's pid, a run it requested): declared in its kind's ``Keys``."""
    _checked(action, "memo", values)
    action.memo = {**action.memo, **values}
    Action.objects.filter(id=action.id).update(memo=action.memo)


def remember(action: Action, **params: Any) -> None:
    """Keep values the operator sees with the action (a plan, a savepoint, the run it started): declared in
    its kind's ``Keys``."""
    _checked(action, "params", params)
    action.params = {**action.params, **params}
    Action.objects.filter(id=action.id).update(params=action.params)


def action_progress(action: Action, text: str) -> None:
    Action.objects.filter(id=action.id).update(progress=text[:300])
    action.progress = text


# The commands the warm state reader answers (a plan re-runs one batch on a scratch copy, a migration writes a new
# checkpoint's seed and may run its first batch, a repartition rewrites a copy's state, each in a session of its own:
