"""What every pipeline module provides, and the catalog that names them."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import DataFrame, Row

from workers.spark.sources.redis_streams import Field, PayloadFormat

# A sink result: (kind, key, value). Rows are upserted on (job, kind, key), so a replayed batch changes nothing.
Result = tuple[str, str, dict[str, Any]]

ACCESS_LOG_PATTERN = (
    r'^(?P<remote>\S+) \S+ \S+ \[(?P<time>[^\]]+)\] "(?P<method>[A-Z]+) (?P<url>\S+) [^"]*" '
    r"(?P<status>\d{3}) (?P<bytes>\d+|-)"
)
ACCESS_LOG = PayloadFormat(
    "regex",
    (
        Field("remote", "string"),
        Field("time", "string"),
        Field("method", "string"),
        Field("url", "string"),
        Field("status", "long"),
        Field("bytes", "string"),
    ),
    ACCESS_LOG_PATTERN,
)


@dataclass(frozen=True)
class ResultView:
    """How the job page shows one kind of result: a table of value fields, largest first by ``order_by``."""

    kind: str
    title: str
    columns: tuple[tuple[str, str], ...]  # (heading, key in the value; "key" for the row key)
    order_by: str = ""


@dataclass(frozen=True)
class Pipeline:
    name: str
    title: str
    description: str
    payload: PayloadFormat
    transform: Callable[[DataFrame], DataFrame]
    output_mode: str
    results: Callable[[list[Row]], Iterable[Result]]
    generator: Callable[[random.Random], Callable[[int], str]]  # rng -> (now_ms -> payload)
    views: tuple[ResultView, ...]
    needs_rocksdb: bool = False
    # Spark session settings the pipeline needs (e.g. transformWithState's Arrow settings).
    conf: dict[str, str] = field(default_factory=dict)
