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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame

from statekeeper_sdk._moved import to_runtime


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


# moved to statekeeper_sdk._runtime.migration in 1.7
__getattr__ = to_runtime(
    __name__,
    {
        "takes_initial_state",
        "declared_variables",
        "has_timers",
        "state_frames",
        "last_committed",
        "read_state",
        "check_columns",
        "check_keys",
        "built_state",
        "MIGRATION_SAMPLES",
        "migration_figures",
    },
)
