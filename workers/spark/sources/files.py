"""Spark's file source: a directory of JSON-lines, CSV or Parquet files, read as new files arrive.

Every row goes through the same checks as a Redis stream entry (``parse_entries``: size, UTF-8, JSON, required
fields, numbers, text bounds, event time against the arrival), as the JSON text of its row: a row that fails is
written to the job's dead-letter stream with the reason and never reaches the pipeline. A row's entry id is
``<file modification ms>-<sequence>``, so pipelines that order by entry id order by file arrival, and a replayed batch
gives the same ids (its dead letters are written once).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, MapType, StructType
from statekeeper_sdk import Limits, PayloadFormat, Rejected

from workers.spark.sources.checks import Entries, check_batches

FORMATS = ("json", "csv", "parquet")
MAX_FILES_PER_TRIGGER = 100
CORRUPT = "_corrupt_record"
CSV_MARK = "\x00csv:"  # before the text of a CSV line that did not parse (a NUL never starts JSON)


def unsupported(payload: PayloadFormat, file_format: str) -> str:
    """Why a pipeline with this payload cannot read files of this format; empty when it can."""
    if file_format not in FORMATS:
        return f"a file source reads {', '.join(FORMATS)}, not {file_format!r}"
    if payload.kind != "json":
        return f"its payload is parsed as {payload.kind}, and a file source gives rows of named fields (JSON's shape)"
    nested = [f.name for f in payload.struct.fields if isinstance(f.dataType, (ArrayType, MapType, StructType))]
    if file_format == "csv" and nested:
        return f"a CSV row is flat, and its payload nests {', '.join(nested)} (JSON lines or Parquet hold them)"
    return ""


def _entry_ids(
    paths: list[str], starts: list[int], mtimes: list[int], counters: dict[tuple[str, int], int]
) -> list[bytes]:
    """<file modification ms>-<24-bit hash of the file and its split><32-bit row in the split>: unique, and the
    same when a batch is replayed (a split's rows come in order, in one partition)."""
    ids = []
    for path, start, mtime in zip(paths, starts, mtimes, strict=True):
        row = counters.get((path, start), 0)
        counters[(path, start)] = row + 1
        split = zlib.crc32(f"{path}:{start}".encode()) & 0xFFFFFF
        ids.append(f"{mtime}-{(split << 32) | row}".encode())
    return ids


def _rows(spark: SparkSession, path: str, file_format: str, payload: PayloadFormat) -> tuple[DataFrame, Column]:
    """The files as rows, and each row's payload as text: the line for JSON; the row's JSON, or the raw text of a CSV
    line that did not parse, otherwise."""
    reader = spark.readStream.option("maxFilesPerTrigger", str(MAX_FILES_PER_TRIGGER))
    if file_format == "json":
        return reader.format("text").load(path), F.col("value")
    columns = payload.columns()
    fields = F.to_json(F.struct(*[F.col(f"`{name}`") for name in payload.names]))
    if file_format == "csv":
        frame = (
            reader.format("csv").schema(f"{columns}, {CORRUPT} string").option("header", "true")
            .option("mode", "PERMISSIVE").option("columnNameOfCorruptRecord", CORRUPT).load(path)
        )  # fmt: skip
        return frame, F.when(F.col(CORRUPT).isNotNull(), F.concat(F.lit(CSV_MARK), F.col(CORRUPT))).otherwise(fields)
    return reader.format("parquet").schema(columns).load(path), fields


def file_events(
    spark: SparkSession, path: str, file_format: str, payload: PayloadFormat, dead_letters: str, redis_url: str,
    max_future_seconds: float,
) -> DataFrame:  # fmt: skip
    """The directory as a stream of checked events with the payload's schema (``_id`` first), like the Redis
    source's."""
    if reason := unsupported(payload, file_format):
        raise ValueError(f"This pipeline cannot read files: {reason}.")
    rows, text = _rows(spark, path, file_format, payload)
    entries = rows.select(
        F.col("_metadata.file_path").alias("path"),
        F.col("_metadata.file_block_start").alias("start"),
        F.unix_millis(F.col("_metadata.file_modification_time")).alias("mtime"),
        text.alias("v"),
    )
    option, limits = payload.to_option(), Limits(max_future_seconds=max_future_seconds)
    mark, columns_named = CSV_MARK.encode(), ", ".join(payload.names)

    def entries_of(batch: Any, counters: dict[tuple[str, int], int]) -> Entries:
        columns = batch.to_pydict()
        ids = _entry_ids(columns["path"], columns["start"], columns["mtime"], counters)
        raw: list[tuple[bytes, list[bytes]]] = []
        dead: list[Rejected] = []
        where: dict[str, str] = {}  # entry id -> file name, for the dead letters' reasons
        for entry, value, path in zip(ids, columns["v"], columns["path"], strict=True):
            where[entry.decode()] = unquote(path.rpartition("/")[2])
            text = (value or "").encode("utf-8", "surrogatepass")
            if text.startswith(mark):
                dead.append(Rejected(entry.decode(), "parse", f"not a CSV row of {columns_named}", text[len(mark) :]))
            else:
                raw.append((entry, [b"v", text]))
        return raw, dead, where

    def check(batches: Iterator[Any]) -> Iterator[Any]:
        counters: dict[tuple[str, int], int] = {}  # rows seen per file split, in this partition
        yield from check_batches(batches, option, limits, dead_letters, redis_url, lambda b: entries_of(b, counters))

    return entries.mapInArrow(check, payload.spark_schema())
