"""A Kafka topic through Spark's own Kafka source (its connector's jars: requirements/maven/spark-kafka.xml, put on every
driver's class path by the set-up). Each record's value passes the same checks as a Redis stream entry, in the JVM
for a flat payload (``jvm_checks.py``; their dead letters: ``kafka_rejected.py``), in Python otherwise; its entry id
is ``<record timestamp ms>-<partition << 40 | offset>``, unique and the same on a replay, and a dead letter's reason
names its topic, partition and offset. Lag comes from the progress events (the latest offsets against the batch's end,
per partition) and, while the job is down, from the broker's end offsets (``dashboard/kafka.py``)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from statekeeper_sdk import Limits, PayloadFormat

from dashboard.kafka import spark_options
from workers.spark.sources.checks import Entries, check_batches
from workers.spark.sources.jvm_checks import SESSION_CONF, checks_for

FETCH_WAIT_MS = 10
REJECTED_METRIC = "statekeeper_rejected"  # a batch's count of records the JVM checks rejected


class Places(Mapping[str, str]):
    """A record's place, for its dead letter's reason, read from its entry id: ``<timestamp ms>-<partition << 40 |
    offset>`` -> ``topic T, partition P, offset O``."""

    def __init__(self, topic: str) -> None:
        self.topic = topic

    def __getitem__(self, entry: str) -> str:
        try:
            n = int(entry.rpartition("-")[2])
        except ValueError:
            raise KeyError(entry) from None
        return f"topic {self.topic}, partition {n >> 40}, offset {n & ((1 << 40) - 1)}"

    def __contains__(self, entry: object) -> bool:
        return isinstance(entry, str) and entry.rpartition("-")[2].isdigit()

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def kafka_events(
    spark: SparkSession, servers: str, topic: str, payload: PayloadFormat, dead_letters: str, redis_url: str,
    max_future_seconds: float, max_records: int, starting: str = "", security: Mapping[str, str] | None = None,
) -> DataFrame:  # fmt: skip
    """``starting``: where a new checkpoint starts reading, as a checkpoint's Kafka offsets in JSON
    (``{"topic": {"0": 812, ...}}``: an upgrade with empty or migrated state goes on where the old line stopped);
    empty: the earliest record the broker holds. Spark takes it only when the checkpoint is new."""
    reader = (
        spark.readStream.format("kafka").option("kafka.bootstrap.servers", servers).option("subscribe", topic)
        .option("startingOffsets", starting or "earliest").option("failOnDataLoss", "true")
        # a task's last fetch of its range otherwise waits the consumer's default 500 ms for more bytes: a small batch
        # took 373 ms in addBatch against 185 ms with this (docs/benchmarks.md); the consumer fetches only in a task
        .option("kafka.fetch.max.wait.ms", str(FETCH_WAIT_MS))
    )  # fmt: skip
    reader = reader.options(**spark_options(security or {}))  # TLS and SASL, in the Java client's words
    if max_records > 0:
        reader = reader.option("maxOffsetsPerTrigger", str(max_records))
    records = reader.load()
    entries = records.select(_entry_id(), F.col("value").alias("v"))
    option, limits, where = payload.to_option(), Limits(max_future_seconds=max_future_seconds), Places(topic)
    checks = checks_for(payload, limits)
    if checks is not None:  # in the JVM; the rejected records' dead letters are written after their batch
        for key, value in SESSION_CONF.items():
            spark.conf.set(key, value)
        return checks.events(checked_columns(records), REJECTED_METRIC)

    def entries_of(batch: Any) -> Entries:
        columns = batch.to_pydict()
        return [(i.encode(), [b"v", v or b""]) for i, v in zip(columns["_id"], columns["v"], strict=True)], [], where

    def check(batches: Iterator[Any]) -> Iterator[Any]:
        yield from check_batches(batches, option, limits, dead_letters, redis_url, entries_of)

    return entries.mapInArrow(check, payload.spark_schema())


def _entry_id() -> Column:
    return F.format_string(
        "%d-%d", F.unix_millis("timestamp"), F.shiftleft(F.col("partition").cast("long"), 40) + F.col("offset")
    ).alias("_id")


def checked_columns(records: DataFrame) -> DataFrame:
    """Spark's Kafka records as the JVM checks read them: the entry id, the value (a tombstone's as empty) and the
    record's arrival."""
    return records.select(
        _entry_id(), F.coalesce("value", F.lit(bytearray())).alias("value"),
        F.unix_millis("timestamp").alias("arrival_ms"),
    )  # fmt: skip


def revealed_security(settings: str) -> dict[str, str]:
    """A job's Kafka security settings (JSON) with its password's secret revealed: in the process that starts the query
    (a driver, the state reader), which sets Django up for it the first time a reference is there."""
    security = {str(k): str(v) for k, v in json.loads(settings or "{}").items()}
    if not any("${secret:" in value for value in security.values()):
        return security
    import os

    import django
    from django.apps import apps

    if not apps.ready:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "statekeeper.settings")
        django.setup()
    from dashboard.services.secrets import security_revealed

    return security_revealed(security)
