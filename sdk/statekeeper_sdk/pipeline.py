"""The pipeline record a package registers, the views of its results, and its parameters.

A package exposes ``Pipeline`` records through the ``statekeeper.pipelines`` entry-point group. The console runs
``transform`` on the checked events of the job's source (a DataFrame with ``_id`` and the payload's fields) and hands
each micro-batch's output rows to ``results``, whose ``(kind, key, value)`` triples are upserted, so a replayed batch
changes nothing. A pipeline that declares ``parameters`` gets their values as a second argument of ``transform``::

    def transform(events: DataFrame, params: Params) -> DataFrame:
        return events.withWatermark("at", f"{params.window_minutes} minutes")...
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pyspark.sql import DataFrame, Row

from statekeeper_sdk._runtime.migration import takes_initial_state
from statekeeper_sdk.migration import Migration
from statekeeper_sdk.payload import PayloadFormat
from statekeeper_sdk.sinks import FileSink, KafkaSink, ResultsTable, Sink, TableSink, bound, targets_named

# A sink result: (kind, key, value). Rows are upserted on (job, kind, key), so a replayed batch changes nothing.
Result = tuple[str, str, dict[str, Any]]


class ResultRecord(NamedTuple):
    """A result as the results table stores it, checked (``Pipeline.record``): a ``results`` function may yield these
    or plain ``(kind, key, value)`` tuples (1.5)."""

    kind: str  # one of the pipeline's views' kinds
    key: str
    value: dict[str, Any]


PARAMETER_TYPES = ("int", "float", "str", "bool")
PARAMETER_ALIASES = {"string": "str", "long": "int", "double": "float", "boolean": "bool"}  # a field's words
OUTPUT_MODES = ("append", "update", "complete")  # Spark's, for the query's sink


@dataclass(frozen=True)
class ResultView:
    """How the job page shows one kind of result: a table of value fields, largest first by ``order_by``.

    A kind whose keys are entities (an order, a session) adds a row per entity for good; ``keep_rows`` keeps the rows
    its latest batches wrote, that many at most, and ``keep_hours`` drops a row no batch has written for that long.
    The console trims a view to its bound as it trims the sinks' bookkeeping; a view that sets neither keeps the
    console's default count (1.3)::

        ResultView("order", "Orders", (("Order", "key"), ("State", "state")), "ts", keep_rows=50_000)
    """

    kind: str
    title: str
    columns: tuple[tuple[str, str], ...]  # (heading, key in the value; "key" for the row key)
    order_by: str = ""
    keep_rows: int | None = None
    keep_hours: float | None = None

    def __post_init__(self) -> None:
        if self.keep_rows is not None and (isinstance(self.keep_rows, bool) or not isinstance(self.keep_rows, int)
                                           or self.keep_rows < 1):  # fmt: skip
            raise ValueError(
                f"view {self.kind!r}: keep_rows is a whole number of rows, 1 or more, not {self.keep_rows!r}"
            )
        if self.keep_hours is not None and (
            isinstance(self.keep_hours, bool) or not isinstance(self.keep_hours, (int, float))
            or not math.isfinite(self.keep_hours) or self.keep_hours <= 0
        ):  # fmt: skip
            raise ValueError(f"view {self.kind!r}: keep_hours is a number of hours above 0, not {self.keep_hours!r}")


@dataclass(frozen=True)
class Parameter:
    """A value the job sets and the pipeline reads (a window's length, a threshold). Changing it on a running job is
    an upgrade: previewed on the job's state, savepointed, rolled back by itself if the new run fails.

    ``operational``: an operator may change it in an upgrade (a threshold, a window); any other parameter takes the
    console's admin role to change, as a sink's target does. ``secret``: its value is a password or a key, so a job
    gives it as a reference to a secret the console keeps (``${secret:NAME}``), never inline; the console reveals it
    to the job's sinks alone. A secret or a sink's target is never operational::

        Parameter("threshold", "float", 100.0, "a window reaching this is big", minimum=0, operational=True)
        Parameter("api_key", "str", "", "the key of the team's endpoint", secret=True)
    """

    name: str
    type: str  # int | float | str | bool
    default: Any
    help: str = ""
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    operational: bool = False
    secret: bool = False

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"parameter {self.name!r}: a name is a Python identifier")
        object.__setattr__(self, "type", PARAMETER_ALIASES.get(self.type, self.type))
        if self.type not in PARAMETER_TYPES:
            raise ValueError(f"parameter {self.name!r}: type is one of {', '.join(PARAMETER_TYPES)}, not {self.type!r}")
        if self.secret and self.type != "str":
            raise ValueError(f"parameter {self.name!r}: a secret is text (type 'str'), not {self.type!r}")
        if self.secret and self.operational:
            raise ValueError(f"parameter {self.name!r}: a secret cannot be operational (only an admin sets a secret)")
        self.clean(self.default)  # a default outside its own bounds is the package's mistake, found at import

    def clean(self, value: Any) -> Any:
        """The value as the pipeline gets it; ValueError naming the parameter when it cannot be one."""
        name = self.name
        if self.type == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "false", "on", "off", "1", "0"):
                return value.lower() in ("true", "on", "1")
            raise ValueError(f"{name}: expected true or false, got {value!r}")
        if self.type == "str":
            if not isinstance(value, str):
                raise ValueError(f"{name}: expected text, got {value!r}")
            if self.choices and value not in self.choices:
                raise ValueError(f"{name}: {value!r} is not one of {', '.join(self.choices)}")
            if len(value) > 1000:
                raise ValueError(f"{name}: at most 1,000 characters")
            return value
        number: float | int
        expected = "an integer" if self.type == "int" else "a number"
        if isinstance(value, bool):
            raise ValueError(f"{name}: expected {expected}, got {value!r}")
        if self.type == "int" and isinstance(value, int):
            number = value
        elif (
            self.type == "int"
            and isinstance(value, float)
            and value.is_integer()
            or self.type == "int"
            and isinstance(value, str)
            and re.fullmatch(r"\s*[-+]?\d{1,19}\s*", value)
        ):
            number = int(value)
        elif self.type == "float" and isinstance(value, (int, float, str)) and _is_number(value):
            number = float(value)
        else:
            raise ValueError(f"{name}: expected {expected}, got {value!r}")
        if isinstance(number, float) and not math.isfinite(number):
            raise ValueError(f"{name}: expected a finite number, got {value!r}")
        if self.type == "int" and not -(2**63) <= number < 2**63:
            raise ValueError(f"{name}: {number} is out of range for a 64-bit integer")
        if self.minimum is not None and number < self.minimum:
            raise ValueError(f"{name}: must be at least {self.minimum:g}, got {number:g}")
        if self.maximum is not None and number > self.maximum:
            raise ValueError(f"{name}: must be at most {self.maximum:g}, got {number:g}")
        return number


def _is_number(value: Any) -> bool:
    try:
        return len(str(value)) <= 100 and abs(float(value)) < 2**1024
    except (TypeError, ValueError, OverflowError):
        return False


class Params(dict[str, Any]):
    """A job's parameter values as a pipeline reads them: ``params.window_minutes`` or ``params["window_minutes"]``.

    >>> Params(window_minutes=30).window_minutes
    30
    >>> Params(window_minutes=30).windows
    Traceback (most recent call last):
    ...
    AttributeError: no parameter 'windows'; the pipeline declares window_minutes
    """

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no parameter {name!r}; the pipeline declares {', '.join(self) or 'none'}") from None


def resolve(parameters: Iterable[Parameter], given: Mapping[str, Any]) -> Params:
    """Every declared parameter's value: the given one, checked, else its default. ValueError lists what is wrong
    (an unknown name, a value out of bounds), one problem per line.

    >>> declared = (Parameter("window_minutes", "int", 60, minimum=1), Parameter("threshold", "float", 100.0))
    >>> values = resolve(declared, {"window_minutes": 30})
    >>> values.window_minutes, values["threshold"]
    (30, 100.0)
    >>> resolve(declared, {"window_minutes": 0, "windows": 2})
    Traceback (most recent call last):
    ...
    ValueError: windows: the pipeline has no such parameter
    window_minutes: must be at least 1, got 0
    """
    declared = {p.name: p for p in parameters}
    problems = [f"{name}: the pipeline has no such parameter" for name in given if name not in declared]
    values = Params()
    for name, parameter in declared.items():
        try:
            values[name] = parameter.clean(given[name]) if name in given else parameter.default
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError("\n".join(problems))
    return values


@dataclass(frozen=True)
class Pipeline:
    """A stateful streaming pipeline as the console runs it.

    ``generator`` (rng -> now_ms -> payload) feeds the demo producer and a standby's warm-up; without one, the warm-up
    uses ``samples`` (a JSON-lines file in the package) or events made from the payload's schema."""

    name: str
    title: str
    description: str
    payload: PayloadFormat
    transform: Callable[..., DataFrame]
    output_mode: str
    results: Callable[[list[Row]], Iterable[Result]]
    views: tuple[ResultView, ...]
    generator: Callable[[random.Random], Callable[[int], str]] | None = None
    needs_rocksdb: bool = False
    # Spark session settings the pipeline needs (e.g. transformWithState's Arrow settings).
    conf: dict[str, str] = field(default_factory=dict)
    parameters: tuple[Parameter, ...] = ()
    samples: str = ""  # a JSON-lines file of sample payloads (absolute, or beside the module that defines it)
    # where the output goes (statekeeper_sdk.sinks); none: the console's results table
    sinks: tuple[Sink, ...] = ()
    # the pipeline this one is a later version of (``customer-spend-v2`` of ``customer-spend``): an operator may
    # upgrade a job to a version of its own pipeline; moving it to another pipeline takes an admin
    version_of: str = ""
    # how this version builds its state from older versions' when their state cannot be read as it is (a new key, a
    # new shape): statekeeper_sdk.migration
    migrations: tuple[Migration, ...] = ()
    # its query may run in Spark's real-time mode (1.9): records flow through it as they come rather than batch by batch,
    # and Spark's Kafka writer writes its one sink, a KafkaSink (the console's writers run per micro-batch). A job
    # chooses the mode; the same pipeline runs in micro-batches too. ``statekeeper_sdk.testing.check_real_time`` says
    # whether Spark plans its query so (no Python UDF; aggregations, dropDuplicates, the JVM's transformWithState).
    real_time: bool = False

    def __post_init__(self) -> None:
        if self.output_mode not in OUTPUT_MODES:
            raise ValueError(
                f"pipeline {self.name!r}: output_mode is one of {', '.join(OUTPUT_MODES)}, not {self.output_mode!r}"
            )
        if odd := [s for s in self.sinks if not isinstance(s, (ResultsTable, TableSink, FileSink, KafkaSink))]:
            raise ValueError(
                f"pipeline {self.name!r}: {odd[0]!r} is not a sink: declare ResultsTable, TableSink, FileSink or "
                "KafkaSink (statekeeper_sdk)"
            )
        kinds = [v.kind for v in self.views]
        if duplicated := sorted({k for k in kinds if kinds.count(k) > 1}):
            raise ValueError(f"pipeline {self.name!r}: two views show the kind {duplicated[0]!r}")
        names = [p.name for p in self.parameters]
        if duplicated := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"pipeline {self.name!r}: the parameter {duplicated[0]!r} is declared twice")
        sinks = [s.name for s in self.sinks]
        if duplicated := sorted({n for n in sinks if sinks.count(n) > 1}):
            raise ValueError(f"pipeline {self.name!r}: two sinks are named {duplicated[0]!r}")
        for sink in self.sinks:
            bound(sink, {p.name: p.default for p in self.parameters})  # a target naming an undeclared parameter
        secret = {p.name for p in self.parameters if p.secret}
        for sink in self.sinks:
            password = sink.security.get("sasl_password") if isinstance(sink, KafkaSink) else None
            if password is not None and not (re.fullmatch(r"\{\w+\}", password) and password[1:-1] in secret):
                raise ValueError(
                    f"pipeline {self.name!r}: sink {sink.name!r} takes its sasl_password from a parameter declared "
                    'secret=True ("{kafka_password}"), never as text in the package'
                )
        if steering := sorted(self.target_parameters() & {p.name for p in self.parameters if p.operational}):
            raise ValueError(
                f"pipeline {self.name!r}: the parameter {steering[0]!r} names where a sink writes, so it cannot be "
                "operational (changing where the output goes takes an admin)"
            )
        if self.real_time:
            self._real_time_problem()
        if self.version_of == self.name:
            raise ValueError(f"pipeline {self.name!r}: version_of names another pipeline, not itself")
        if strays := [m for m in self.migrations if not isinstance(m, Migration)]:
            raise ValueError(f"pipeline {self.name!r}: {strays[0]!r} is not a Migration (statekeeper_sdk)")
        sources = [m.from_pipeline for m in self.migrations]
        if duplicated := sorted({n for n in sources if sources.count(n) > 1}):
            raise ValueError(f"pipeline {self.name!r}: two migrations read {duplicated[0]!r}")
        if self.migrations and not takes_initial_state(self.transform):
            raise ValueError(
                f"pipeline {self.name!r}: it declares a migration, so its transform takes the migrated state as a "
                "keyword argument initial_state (a DataFrame, or None when the job starts as usual)"
            )

    def _real_time_problem(self) -> None:
        if self.output_mode != "update":
            raise ValueError(
                f"pipeline {self.name!r}: real-time mode takes output_mode 'update' (Spark's only mode for it), not "
                f"{self.output_mode!r}"
            )
        if len(self.sinks) != 1 or not isinstance(self.sinks[0], KafkaSink):
            raise ValueError(
                f"pipeline {self.name!r}: a real-time pipeline declares one sink, a KafkaSink: Spark's Kafka writer "
                "writes it as records come (the results table, a team's table and files are written per micro-batch)"
            )
        if self.payload.nested:
            raise ValueError(
                f"pipeline {self.name!r}: a real-time pipeline's payload has flat fields (a nested schema is checked "
                "in Python, which real-time mode does not run)"
            )

    def record(self, result: Any) -> ResultRecord:
        """One item ``results`` yielded, as a checked record: a (kind, key, value) triple whose kind one of the
        pipeline's views shows (any kind when it declares no view), with a text key and a dict value. ValueError with
        the reason: the console sends such a result to the job's dead letters, and stores the others."""
        try:
            kind, key, value = result
        except (TypeError, ValueError):
            raise ValueError(
                f"a result is (kind, key, value), not {type(result).__name__} {repr(result)[:80]}"
            ) from None
        if not isinstance(kind, str):
            raise ValueError(f"a result's kind is text, not {type(kind).__name__} {repr(kind)[:40]}")
        if self.views and not any(view.kind == kind for view in self.views):
            shown = ", ".join(repr(view.kind) for view in self.views)
            raise ValueError(
                f"the kind {kind[:80]!r} has no view in {self.name} (its views show {shown}): it would be stored and "
                "never shown"
            )
        if not isinstance(key, str):
            raise ValueError(f"a {kind} result's key is text, not {type(key).__name__} {repr(key)[:40]}")
        if not isinstance(value, dict):
            raise ValueError(f"a {kind} result's value is a dict, not {type(value).__name__}")
        return ResultRecord(kind, key, value)

    def checked_results(self, rows: list[Row]) -> tuple[list[ResultRecord], list[tuple[Any, str]]]:
        """The results of these output rows as the results table would store them (``record``), and the ones refused,
        each with its reason."""
        stored: list[ResultRecord] = []
        refused: list[tuple[Any, str]] = []
        for result in self.results(rows):
            try:
                stored.append(self.record(result))
            except ValueError as exc:
                refused.append((result, str(exc)))
        return stored, refused

    def migration_from(self, pipeline: str) -> Migration | None:
        """The migration that builds this version's state from ``pipeline``'s, if it declares one."""
        return next((m for m in self.migrations if m.from_pipeline == pipeline), None)

    def target_parameters(self) -> set[str]:
        """The parameters that say where the output goes: those a sink's target names."""
        return {name for sink in self.sinks for name in targets_named(sink)}

    def outputs(self, values: Mapping[str, Any] | None = None) -> tuple[Any, ...]:
        """The sinks the output goes to: the declared ones, else the console's results table; with ``values`` (a job's
        parameters), their targets filled in (ValueError names a parameter they lack)."""
        sinks = self.sinks or (ResultsTable(),)
        return sinks if values is None else tuple(bound(sink, values) for sink in sinks)


def apply(
    pipeline: Any, events: DataFrame, values: Mapping[str, Any], initial_state: DataFrame | None = None
) -> DataFrame:
    """The pipeline's output for these events, with its parameters' values when it declares any, and with
    ``initial_state`` (a migration's output, statekeeper_sdk.migration) when a migrated job starts on a new checkpoint."""
    declared = tuple(getattr(pipeline, "parameters", ()) or ())
    extra = {"initial_state": initial_state} if initial_state is not None else {}
    if not declared:
        return pipeline.transform(events, **extra)
    return pipeline.transform(events, resolve(declared, values), **extra)
