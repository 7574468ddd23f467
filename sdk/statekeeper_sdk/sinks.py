"""Where a pipeline's output goes: the sinks it declares.

A pipeline lists its sinks in ``Pipeline.sinks``; without any, its output goes to the console's results table
(``ResultsTable``). The console hands each micro-batch's output to every sink exactly once across a replay, a kill,
a restore, a rollback and an upgrade (its engine, not this package, writes them: see the console's README).

- ``TableSink``: a table in the team's own database, through any DB-API 2 driver (PostgreSQL through psycopg first).
  Each row carries its batch id (``batch_column``), which a rewind deletes by. One job writes a table.
- ``FileSink``: Parquet or JSON files in the layout of Spark's file sink (data files and a ``_spark_metadata`` log).
- ``KafkaSink``: a topic; each batch is one Kafka transaction, so a consumer reading ``read_committed`` sees it whole
  and once. Every record carries the headers ``statekeeper-job``, ``statekeeper-batch`` and ``statekeeper-lineage``:
  after a restore or rollback the batches after it come again under a new lineage. A cluster that asks for TLS or a
  SASL login takes ``security``, in the names a job's Kafka source takes (``KAFKA_SECURITY``).

Targets may name the job's parameters: ``FileSink("lake", path="{lake_dir}/spend")``. A sink whose target is left
empty (the parameter's value is "") is off: the job writes to its other sinks.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
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


# A Kafka cluster's TLS and SASL settings, by the names a KafkaSink's ``security`` and a job's Kafka source take
KAFKA_SECURITY = (
    "security_protocol",  # PLAINTEXT (the default), SSL, SASL_PLAINTEXT or SASL_SSL
    "sasl_mechanism",  # PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512
    "sasl_username",
    "sasl_password",  # a secret parameter's template, "{kafka_password}": never the password itself
    "ssl_ca_file",  # the CA's certificates (PEM), an absolute path, when the brokers' are not in the system's
    "ssl_check_hostname",  # "true" (the default) or "false"
)


@dataclass(frozen=True)
class KafkaSink:
    """Records into a Kafka topic: ``key`` the column of the record key, the value the row as JSON. ``security``: the
    cluster's TLS and SASL settings (``KAFKA_SECURITY``'s names), each value a template as the targets are; the
    password names a parameter declared ``secret=True``::

        KafkaSink("alerts", servers="{kafka}", topic="alerts", key="card",
                  security={"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512",
                            "sasl_username": "{kafka_user}", "sasl_password": "{kafka_password}"})
    """

    name: str
    servers: str
    topic: str
    key: str = ""
    columns: tuple[str, ...] = ()
    security: Mapping[str, str] = field(default_factory=dict, hash=False, repr=False)  # a password once bound
    kind = "kafka"

    def __post_init__(self) -> None:
        if odd := sorted(set(self.security) - set(KAFKA_SECURITY)):
            raise ValueError(
                f"sink {self.name!r}: {odd[0]!r} is not a Kafka security setting ({', '.join(KAFKA_SECURITY)})"
            )
        if bad := [k for k, v in self.security.items() if not isinstance(v, str)]:
            raise ValueError(f"sink {self.name!r}: the security setting {bad[0]!r} is text")
        object.__setattr__(self, "security", dict(self.security))  # the sink's own copy

    def where(self) -> str:
        return f"topic {self.topic} on {self.servers}"

    def off(self) -> bool:
        return not self.servers.strip()


Sink = ResultsTable | TableSink | FileSink | KafkaSink
TEMPLATED = ("dsn", "path", "table", "servers", "topic")


def redacted(dsn: str) -> str:
    """A connection string without its password (in any form statekeeper_sdk._passwords lists)."""
    return _passwords.redacted(dsn)


def _templates(sink: Any) -> dict[str, str]:
    """A sink's targets that may name parameters, by where they are (``path``; ``security.sasl_password``)."""
    found = {f.name: getattr(sink, f.name) for f in fields(sink) if f.name in TEMPLATED}
    found |= {f"security.{k}": v for k, v in (getattr(sink, "security", None) or {}).items()}
    return {where: value for where, value in found.items() if isinstance(value, str) and "{" in value}


def _template_names(value: str) -> set[str]:
    """The parameters a template names (``{lake_dir}/spend`` -> lake_dir); ValueError when it is not a template."""
    names = {name for _, name, _, _ in string.Formatter().parse(value) if name}
    return {name.partition(".")[0].partition("[")[0] for name in names}


def targets_named(sink: Any) -> set[str]:
    """The parameters a sink's targets name (``{lake_dir}`` in a path, ``{kafka_password}`` in its security)."""
    names: set[str] = set()
    for value in _templates(sink).values():
        try:
            names |= _template_names(value)
        except ValueError:
            continue  # not a template: bound() says so
    return names


def bound(sink: Sink, params: Mapping[str, Any]) -> Sink:
    """The sink with the job's parameter values put into its targets. ValueError names a parameter it lacks."""
    changes: dict[str, Any] = {}
    for where, value in _templates(sink).items():
        try:
            filled = value.format_map(dict(params))
        except KeyError as exc:
            raise ValueError(f"sink {sink.name!r}: {where} names the parameter {exc}, which is not declared") from None
        except (ValueError, IndexError) as exc:
            raise ValueError(f"sink {sink.name!r}: {where} {value!r} is not a template: {exc}") from None
        if where.startswith("security."):
            security = changes.setdefault("security", dict(getattr(sink, "security", {})))
            security[where.removeprefix("security.")] = filled
        else:
            changes[where] = filled
    return replace(sink, **changes) if changes else sink


# the engine that writes the sinks moved to the console in 1.3 (deprecated here, gone in 2.0)
_MOVED = frozenset({
    "COMMITS", "FENCES", "Fenced", "SinkError", "lineage_digest", "Written", "Position", "rejected_output", "plain",
    "TableWriter", "quoted", "COMPACT_INTERVAL", "BLOCK_SIZE", "FileLog", "write_files", "write_kafka", "chunked",
})  # fmt: skip


def __getattr__(name: str) -> Any:
    from statekeeper_sdk._moved import moved

    return moved(__name__, "dashboard.engine.sinks", _MOVED, name)
