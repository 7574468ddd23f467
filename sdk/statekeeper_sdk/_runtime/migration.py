"""The console's and the test kit's side of a state migration (``statekeeper_sdk.Migration``): reading the old
state at a savepoint, building the new one, checking its columns and keys, and the figures the preview shows."""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame

from statekeeper_sdk.migration import Migration, OldState


def takes_initial_state(transform: Callable[..., Any]) -> bool:
    """Whether a transform accepts the ``initial_state`` keyword a migrated start gives it."""
    try:
        parameters = inspect.signature(transform).parameters
    except (TypeError, ValueError):
        return False
    return "initial_state" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def declared_variables(properties: dict[str, Any]) -> list[dict[str, Any]]:
    """A transformWithState operator's own state variables as its metadata's properties declare them (Spark's timer
    indexes, named ``$...``, are not one)."""
    return [v for v in properties.get("stateVariables", []) if not str(v.get("stateName", "")).startswith("$")]


def has_timers(properties: dict[str, Any]) -> bool:
    """Whether a transformWithState operator's metadata declares timers."""
    return any(v.get("stateVariableType") == "TimerState" for v in properties.get("stateVariables", []))


def state_frames(spark: Any, checkpoint: str | Path, batch: int) -> Iterator[tuple[Any, str, DataFrame]]:
    """For each stateful operator in the checkpoint's metadata and each of its state variables: the operator's
    metadata row, the variable's name (Spark's store name for an operator without variables) and Spark's state
    reader on it at the batch."""
    path = str(checkpoint)
    for row in spark.read.format("state-metadata").load(path).collect():
        properties = json.loads(row["operatorProperties"]) if row["operatorProperties"] else {}
        names: list[str | None] = [str(v["stateName"]) for v in declared_variables(properties)] or [None]
        for name in names:
            reader = (
                spark.read.format("statestore")
                .option("batchId", str(batch))
                .option("operatorId", str(row["operatorId"]))
            )
            if name is not None:
                reader = reader.option("stateVarName", name)
            yield row, name or row["stateStoreName"], reader.load(path)


def last_committed(checkpoint: str | Path) -> int | None:
    """A checkpoint's newest committed batch, None before its first commit."""
    commits = Path(checkpoint) / "commits"
    done = [int(n) for n in os.listdir(commits) if n.isdigit()] if commits.is_dir() else []
    return max(done, default=None)


def read_state(spark: Any, checkpoint: str | Path, batch: int | None = None) -> OldState:
    """A checkpoint's state at a committed batch (its last by default), as a migration's ``build`` gets it."""
    if batch is None:
        batch = last_committed(checkpoint)
        if batch is None:
            raise ValueError(f"{checkpoint} has no committed batch: there is no state to read")
    frames: dict[str, DataFrame] = {}
    for row, name, frame in state_frames(spark, checkpoint, batch):
        frames[name if name not in frames else f"{row['operatorId']}:{name}"] = frame
    if not frames:
        raise ValueError("no stateful operator in the checkpoint's metadata: there is no state to migrate")
    return OldState(frames, batch)


def check_columns(migration: Migration, built: Any) -> None:
    """Refuse a migration's output that is not a DataFrame, or lacks one of its key columns (the schema alone)."""
    if not isinstance(built, DataFrame):
        raise TypeError(f"the migration returned {type(built).__name__}, not a DataFrame")
    if missing := [k for k in migration.key if k not in built.columns]:
        raise ValueError(
            f"the migration's output lacks its key column {missing[0]!r} (it has {', '.join(built.columns)})"
        )


def check_keys(migration: Migration, built: DataFrame) -> None:
    """Refuse a migration's output that gives a key more than one row, naming up to three such keys."""
    twice = built.groupBy(*migration.key).count().filter("count > 1")
    if doubled := twice.limit(3).collect():
        shown = "; ".join(", ".join(f"{k}={row[k]}" for k in migration.key) for row in doubled)
        raise ValueError(f"the migration gives {twice.count()} keys more than one row ({shown}): one row a key")


def built_state(migration: Migration, old: OldState, params: Any) -> DataFrame:
    """The migration's output on ``old``, refused as the console refuses it (``check_columns``, ``check_keys``)."""
    built = migration.build(old, params)
    check_columns(migration, built)
    check_keys(migration, built)
    return built


MIGRATION_SAMPLES = 10  # keys shown before and after, and of the old keys that map to nothing


def _key_leaves(schema: Any, prefix: str = "") -> dict[str, str]:
    """A struct's leaf fields by their last name, with their path (``window.start`` for ``start``)."""
    found: dict[str, str] = {}
    for field in schema.fields:
        path = f"{prefix}{field.name}"
        if hasattr(field.dataType, "fields"):
            found.update({k: v for k, v in _key_leaves(field.dataType, path + ".").items() if k not in found})
        else:
            found.setdefault(field.name, path)
    return found


def _shown(rows: list[Any], width: int = 300) -> list[str]:
    return [json.dumps(row.asDict(recursive=True), default=str, sort_keys=True)[:width] for row in rows]


def migration_figures(migration: Migration, old: OldState, built: DataFrame) -> dict[str, Any]:
    """What a migration did, as its preview shows it: rows read per variable and written, keys in and out, samples
    before and after, and the old keys that map to nothing (``dropped``: compared on the key columns the old and new
    keys share; absent when they share none, or the old variables are keyed differently)."""
    from pyspark.sql import functions as F

    keys = [frame.select("key") for frame in old.values()]
    same_keys = all(k.schema == keys[0].schema for k in keys)
    old_keys = keys[0]
    for other in keys[1:] if same_keys else []:
        old_keys = old_keys.unionByName(other)
    old_keys = old_keys.distinct()
    figures: dict[str, Any] = {
        "key": list(migration.key), "description": migration.description,
        "variables": {name: frame.count() for name, frame in old.items()}, "rows_out": built.count(),
        "keys_in": old_keys.count() if same_keys else None,
        "keys_out": built.select(*migration.key).distinct().count(),
        "before": _shown(next(iter(old.values())).limit(MIGRATION_SAMPLES).collect()),
        "after": _shown(built.limit(MIGRATION_SAMPLES).collect()),
    }  # fmt: skip
    leaves = _key_leaves(old_keys.schema["key"].dataType)
    shared = [k for k in migration.key if k in leaves]
    if shared and same_keys:
        before = old_keys.select(*[F.col(f"key.{leaves[k]}").alias(k) for k in shared]).distinct()
        lost = before.join(built.select(*shared).distinct(), on=shared, how="left_anti")
        figures["dropped"] = {"on": shared, "keys": lost.count(), "samples": _shown(lost.limit(MIGRATION_SAMPLES).collect())}  # fmt: skip
    return figures
