"""Where a pipeline's output goes: the sinks it declares.

A pipeline lists its sinks in ``Pipeline.sinks``; without any, its output goes to the console's results table
(``ResultsTable``). The console hands each micro-batch's output to every sink exactly once across a replay, a kill,
a restore, a rollback and an upgrade (its engine, not this package, writes them: see the console's README).

- ``TableSink``: a table in the team's own database, through any DB-API 2 driver (PostgreSQL through psycopg first).
  Each row carries its batch id (``batch_column``), which a rewind deletes by. One job writes a table.
- ``FileSink``: Parquet or JSON files in the layout of Spark's file sink (data files and a ``_spark_metadata`` log).
- ``KafkaSink``: a topic; each batch is one Kafka transaction, so a consumer reading ``read_committed`` sees it whole
  and once. Every record carries the headers ``statekeeper-job``, ``statekeeper-batch`` and ``statekeeper-lineage``:
  after a restore or rollback the batches after it come again under a new lineage.

Targets may name the job's parameters: ``FileSink("lake", path="{lake_dir}/spend")``. A sink whose target is left
empty (the parameter's value is "") is off: the job writes to its other sinks.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from statekeeper_sdk import _passwords

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")


@dataclass(frozen=True)
class ResultsTable:
    """The console's own results table: ``Pipeline.results`` turns the output rows into (kind, key, value) upserts."""

    name: str = "results"
    kind = "results"

    def where(self) -> str:
        return "the console's results table"

    def off(self) -> bool:
        return False


@dataclass(frozen=True)
class TableSink:
    """Rows into a table of the team's database. ``key``: upsert on these columns (a unique index on them); empty:
    append. ``create``: DDL run before the first batch (write it with IF NOT EXISTS)."""

    name: str
    table: str
    dsn: str
    columns: tuple[str, ...] = ()  # the output columns written, in this order; empty: all of them
    key: tuple[str, ...] = ()
    batch_column: str = "batch_id"
    driver: str = "psycopg"  # the DB-API 2 module
    create: str = ""
    kind = "table"

    def __post_init__(self) -> None:
        for name in (self.table, *self.columns, *self.key, self.batch_column):
            if not IDENTIFIER.match(name):
                raise ValueError(f"sink {self.name!r}: {name!r} is not a plain SQL name")
        if missing := [k for k in self.key if self.columns and k not in self.columns]:
            raise ValueError(f"sink {self.name!r}: the key column {missing[0]!r} is not among its columns")

    def where(self) -> str:
        return f"{self.table} in {redacted(self.dsn)}"

    def off(self) -> bool:
        return not self.dsn.strip()


@dataclass(frozen=True)
class FileSink:
    """Files in Spark's file-sink layout under ``path``: ``format`` parquet or json, ``files_per_batch`` files at
    most for each batch, every row with its batch id in ``batch_column``."""

    name: str
    path: str
    format: str = "parquet"
    columns: tuple[str, ...] = ()
    batch_column: str = "batch_id"
    files_per_batch: int = 1
    kind = "files"

    def __post_init__(self) -> None:
        if self.format not in ("parquet", "json"):
            raise ValueError(f"sink {self.name!r}: format is parquet or json, not {self.format!r}")
        if self.files_per_batch < 1:
            raise ValueError(f"sink {self.name!r}: files_per_batch is at least 1")

    def where(self) -> str:
        return f"{self.format} files in {self.path}"

    def off(self) -> bool:
        return not self.path.strip()


@dataclass(frozen=True)
class KafkaSink:
    """Records into a Kafka topic: ``key`` the column of the record key, the value the row as JSON."""

    name: str
    servers: str
    topic: str
    key: str = ""
    columns: tuple[str, ...] = ()
    kind = "kafka"

    def where(self) -> str:
        return f"topic {self.topic} on {self.servers}"

    def off(self) -> bool:
        return not self.servers.strip()


Sink = ResultsTable | TableSink | FileSink | KafkaSink
TEMPLATED = ("dsn", "path", "table", "servers", "topic")


def redacted(dsn: str) -> str:
    """A connection string without its password (in any form statekeeper_sdk._passwords lists)."""
    return _passwords.redacted(dsn)


def targets_named(sink: Any) -> set[str]:
    """The parameters a sink's targets name (``{lake_dir}`` in a path)."""
    names: set[str] = set()
    for f in fields(sink):
        value = getattr(sink, f.name)
        if f.name in TEMPLATED and isinstance(value, str) and "{" in value:
            try:
                names.update(name for _, name, _, _ in string.Formatter().parse(value) if name)
            except ValueError:
                continue  # not a template: bound() says so
    return {name.partition(".")[0].partition("[")[0] for name in names}


def bound(sink: Sink, params: Mapping[str, Any]) -> Sink:
    """The sink with the job's parameter values put into its targets. ValueError names a parameter it lacks."""
    changes = {}
    for f in fields(sink):
        value = getattr(sink, f.name)
        if f.name in TEMPLATED and isinstance(value, str) and "{" in value:
            try:
                changes[f.name] = value.format_map(dict(params))
            except KeyError as exc:
                raise ValueError(
                    f"sink {sink.name!r}: {f.name} names the parameter {exc}, which is not declared"
                ) from None
            except (ValueError, IndexError) as exc:
                raise ValueError(f"sink {sink.name!r}: {f.name} {value!r} is not a template: {exc}") from None
    return replace(sink, **changes) if changes else sink  # type: ignore[arg-type]


# the engine that writes the sinks moved to the console in 1.3 (deprecated here, gone in 2.0)
_MOVED = frozenset({
    "COMMITS", "FENCES", "Fenced", "SinkError", "lineage_digest", "Written", "Position", "rejected_output", "plain",
    "TableWriter", "quoted", "COMPACT_INTERVAL", "BLOCK_SIZE", "FileLog", "write_files", "write_kafka", "chunked",
})  # fmt: skip


def __getattr__(name: str) -> Any:
    from statekeeper_sdk._moved import moved

    return moved(__name__, "dashboard.engine.sinks", _MOVED, name)
