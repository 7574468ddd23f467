"""How a pipeline version builds its state from an older version's: a state migration.

A change that the old state cannot be read with (another key, another shape of value) is refused by the console's
upgrade preview. A version that declares a ``Migration`` from the job's current pipeline can be moved to anyway: the
console reads the old state at a savepoint, runs ``build`` on it, and starts the new version on a new checkpoint with
the result as its initial state, its source going on exactly after the savepoint's batch::

    def by_day(old: OldState, params: Params) -> DataFrame:
        spend = old["default"]  # a streaming aggregation's state: key and value structs, as Spark's reader gives them
        return spend.select(F.col("key.customer").alias("customer"), ...).groupBy("customer", "day").agg(...)

    DAILY = Pipeline(..., transform=daily, migrations=(Migration("customer-spend", ("customer", "day"), by_day),))

Spark seeds only a ``transformWithState`` operator (its ``initialState``), and only at a new checkpoint's first batch:
the new version's transform takes the built state as its ``initial_state`` argument and hands it to
``transformWithState(..., initialState=initial_state.groupBy(*key))`` when it is not None. A migration into any other
operator (an aggregation, a join, flatMapGroupsWithState) is refused with that reason.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame


class OldState(dict[str, DataFrame]):
    """The old version's state at the savepoint's batch, one DataFrame per state variable as Spark's state reader
    (``format("statestore")``) reads it: columns ``key`` and ``value`` (structs), and ``partition_id``.

    Named by state variable for a ``transformWithState`` operator (``old["totals"]``), and by Spark's store name for
    the others (``old["default"]`` for an aggregation or deduplication); when two operators use one name, the second
    is ``"<operator id>:<name>"``. ``batch`` is the savepoint's batch."""

    def __init__(self, frames: dict[str, DataFrame], batch: int = -1) -> None:
        super().__init__(frames)
        self.batch = batch

    def __missing__(self, name: str) -> DataFrame:
        raise KeyError(f"the old state has no variable {name!r}; it has {', '.join(sorted(self)) or 'none'}")


@dataclass(frozen=True)
class Migration:
    """A new version's state built from ``from_pipeline``'s.

    ``key``: the columns of the built state that key it: the new version's grouping key, which it groups the
    initial state by. ``build(old, params)``: the old state (``OldState``) and the new version's parameter values
    (``Params``) to the new initial state, a DataFrame with the key columns and the values the new version's
    ``handleInitialState`` reads. A key given twice is refused, with the keys. ``description`` is shown with the
    preview."""

    from_pipeline: str
    key: tuple[str, ...]
    build: Callable[[OldState, Any], DataFrame]  # (old state, the new version's Params)
    description: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.key, str):
            object.__setattr__(self, "key", (self.key,))
        if not self.from_pipeline:
            raise ValueError("a migration names the pipeline whose state it reads (from_pipeline)")
        if not self.key or not all(isinstance(k, str) and k for k in self.key):
            raise ValueError(f"migration from {self.from_pipeline!r}: key names one column or more, not {self.key!r}")
        if not callable(self.build):
            raise ValueError(f"migration from {self.from_pipeline!r}: build is a function (old state, params)")


def takes_initial_state(transform: Callable[..., Any]) -> bool:
    """Whether a transform accepts the ``initial_state`` keyword a migrated start gives it."""
    try:
        parameters = inspect.signature(transform).parameters
    except (TypeError, ValueError):
        return False
    return "initial_state" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _variables(properties: dict[str, Any]) -> list[str]:
    """A transformWithState operator's own state variables (Spark's timer indexes, named ``$...``, are not one)."""
    declared = properties.get("stateVariables", [])
    return [str(v["stateName"]) for v in declared if not str(v.get("stateName", "")).startswith("$")]


def state_frames(spark: Any, checkpoint: str | Path, batch: int) -> Iterator[tuple[Any, str, DataFrame]]:
    """For each stateful operator in the checkpoint's metadata and each of its state variables: the operator's
    metadata row, the variable's name (Spark's store name for an operator without variables) and Spark's state
    reader on it at the batch."""
    path = str(checkpoint)
    for row in spark.read.format("state-metadata").load(path).collect():
        properties = json.loads(row["operatorProperties"]) if row["operatorProperties"] else {}
        names: list[str | None] = [*_variables(properties)] or [None]
        for name in names:
            reader = (
                spark.read.format("statestore")
                .option("batchId", str(batch))
                .option("operatorId", str(row["operatorId"]))
            )
            if name is not None:
                reader = reader.option("stateVarName", name)
            yield row, name or row["stateStoreName"], reader.load(path)


def read_state(spark: Any, checkpoint: str | Path, batch: int | None = None) -> OldState:
    """A checkpoint's state at a committed batch (its last by default), as a migration's ``build`` gets it."""
    if batch is None:
        commits = Path(checkpoint) / "commits"
        done = sorted(int(n) for n in os.listdir(commits) if n.isdigit()) if commits.is_dir() else []
        if not done:
            raise ValueError(f"{checkpoint} has no committed batch: there is no state to read")
        batch = done[-1]
    frames: dict[str, DataFrame] = {}
    for row, name, frame in state_frames(spark, checkpoint, batch):
        frames[name if name not in frames else f"{row['operatorId']}:{name}"] = frame
    if not frames:
        raise ValueError("no stateful operator in the checkpoint's metadata: there is no state to migrate")
    return OldState(frames, batch)
