"""What a step answers the engine (dashboard/services/actions.py), and the step tables' own checks.

An action is a sequence of named steps. A step does a bounded piece of work and answers ``Next(step)`` (go on to
that step now), ``Wait(note)`` (nothing to do until something outside changes: a driver stops, a run comes up,
Spark's reader starts, a process of its own ends; the worker is freed and the step is visited again later), or
``Done(outcome)``; it raises ``ActionFailed`` to end the action with the reason. A step may run again from its start
(its worker was killed), so each one is written to be safe to repeat: it checks what is already done first.

What steps keep between visits is declared in action_keys.py; the waits on a job's runs are in run_waits.py; the
reads of Spark's state through the warm state reader in state_reader_client.py.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from django.utils import timezone

from dashboard.models import Action


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
