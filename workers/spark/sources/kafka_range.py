"""Ranges of a Kafka topic that the console fixes, read on the executors by its own client (confluent-kafka): what
Spark's Kafka source cannot be told in a streaming query, which always plans its batches on to the newest record. An
upgrade's shadow run reads one range with both versions; a migration's preview reads the first batch after the
migrated state; a blue/green upgrade's green reads exactly the offsets of each of the job's batches (``Following``),
then, once handed over, on to the newest record by itself until its run ends (the job's next run reads its
checkpoint with Spark's Kafka source again).

Offsets are in the form of Spark's Kafka source, ``{"topic": {"0": 812, ...}}``, so a copy of a Kafka job's checkpoint
(a savepoint) goes on from its own offsets. Entry ids, checks and dead letters are those of the Kafka source
(``sources/kafka.py``): ``<record timestamp ms>-<partition << 40 | offset>``, and a dead letter names its topic,
partition and offset."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
from statekeeper_sdk import Limits, PayloadFormat

from dashboard import kafka
from workers.spark.sources.checks import Entries, check_batches
from workers.spark.sources.following import Following
from workers.spark.sources.kafka import Places
from workers.spark.sources.register import register

log = logging.getLogger(__name__)

FORMAT_NAME = "statekeeper-kafka-range"
CHUNK = 5_000  # records checked at a time: bounds a reader's memory whatever the range
STALL_SECONDS = 60.0  # a read that gets no record of its range for this long fails, naming the range


@dataclass(frozen=True)
class PartitionRange(InputPartition):
    """Offsets [start, end) of one partition."""

    partition: int
    start: int
    end: int

    def __init__(self, partition: int, start: int, end: int) -> None:
        object.__setattr__(self, "partition", partition)
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "end", end)


class KafkaRangeDataSource(DataSource):
    """``spark.readStream.format("statekeeper-kafka-range")`` with ``servers``, ``topic``, ``ending`` (JSON offsets),
    ``starting`` (JSON offsets; a new checkpoint's first batch starts there), ``format``, ``deadLetter``, ``url`` and
    ``maxRecordsPerBatch``; ``securityPassword``: the job's Kafka security settings, revealed, as JSON (the option's
    name has Spark redact it wherever it prints a plan's options)."""

    @classmethod
    def name(cls) -> str:
        return FORMAT_NAME

    def schema(self) -> str:
        return PayloadFormat.from_option(self.options["format"]).spark_schema()

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return KafkaRangeReader(dict(self.options))


class KafkaRangeReader(DataSourceStreamReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.topic = options["topic"]
        self.cluster = kafka.Cluster(options["servers"], json.loads(options.get("securitypassword") or "{}"))
        self.config = {"bootstrap.servers": options["servers"], **kafka.client_config(self.cluster.security)}
        # read no further; none: the newest record the broker holds, at each batch (a green after its handover)
        ending = json.loads(options.get("ending") or "{}").get(self.topic)
        self.ending = {str(p): int(o) for p, o in ending.items()} if ending else None
        self.following = Following(options)  # a blue/green upgrade's green (``following.py``)
        starting = json.loads(options.get("starting") or "{}").get(self.topic)
        self.starting = {str(p): int(o) for p, o in starting.items()} if starting else None
        self.max_records = int(options.get("maxrecordsperbatch", "0"))
        self.format_option = options["format"]
        self.dead_letter = options["deadletter"]
        self.url = options["url"]
        self.limits = Limits(max_future_seconds=float(options.get("maxfutureseconds", "300")))

    def initialOffset(self) -> dict:
        """A new checkpoint starts at ``starting``, else at each partition's first offset the broker holds."""
        if self.starting is not None:
            return {self.topic: self.starting}
        lows = kafka.end_offsets(self.cluster, self.topic)
        return {self.topic: {str(p): low for p, (low, _) in lows.items()}}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_records) if self.max_records > 0 else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        if (followed := self.following.end(start)) is not None:
            return followed
        self.following.paced()
        at = {str(p): int(o) for p, o in start[self.topic].items()}
        if self.ending is not None:
            newest = self.ending
        else:  # a green that reads on by itself after its handover
            try:
                newest = {str(p): high for p, (_, high) in kafka.end_offsets(self.cluster, self.topic).items()}
            except kafka.KafkaUnavailable as exc:  # no new data while the broker is away, as Spark's source waits
                log.warning("%s: no batch planned: %s", self.topic, exc)
                return start
        ending = {p: max(o, at.get(p, 0)) for p, o in newest.items()}
        most = limit.max_rows if isinstance(limit, ReadMaxRows) else sum(ending.values())
        return {self.topic: kafka.spread(at, ending, most)}

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        at, to = start[self.topic], end[self.topic]
        return [PartitionRange(int(p), int(at.get(p, 0)), int(o)) for p, o in to.items() if int(o) > int(at.get(p, 0))]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, PartitionRange)
        places = Places(self.topic)

        def entries_of(chunk: list[tuple[str, bytes]]) -> Entries:
            return [(i.encode(), [b"v", v]) for i, v in chunk], [], places

        yield from check_batches(
            _chunks(self.config, self.topic, partition), self.format_option, self.limits, self.dead_letter, self.url,
            entries_of,
        )  # fmt: skip

    def commit(self, end: dict) -> None:
        pass


def kafka_range_events(
    spark: SparkSession, servers: str, topic: str, payload: PayloadFormat, dead_letters: str, redis_url: str,
    max_future_seconds: float, max_records: int, starting: str, ending: str, security: dict[str, str],
    follow: dict[str, str] | None = None,
) -> DataFrame:  # fmt: skip
    """The checked events of the topic from ``starting`` (a new checkpoint; a copy goes on from its own offsets) up to
    ``ending``, both JSON offsets in the Kafka source's form; ``follow``: a green's options (``following.py``)."""
    register(spark, KafkaRangeDataSource)
    reader = (
        spark.readStream.format(FORMAT_NAME).option("servers", servers).option("topic", topic)
        .option("starting", starting).option("ending", ending).option("format", payload.to_option())
        .option("deadLetter", dead_letters).option("url", redis_url).option("maxFutureSeconds", str(max_future_seconds))
        .option("maxRecordsPerBatch", str(max_records)).option("securityPassword", json.dumps(security))
    )  # fmt: skip
    return reader.options(**(follow or {})).load()


def _chunks(config: dict[str, Any], topic: str, part: PartitionRange) -> Iterator[list[tuple[str, bytes]]]:
    """(entry id, value) of every record of the range, CHUNK at a time. Offsets the range holds that are no records
    (a transaction's markers) are passed over; offsets the broker no longer holds fail the read with the reason."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    errors = kafka.Heard()  # a refused login or TLS handshake comes only here: the client retries it quietly
    consumer = Consumer(
        {**config, "error_cb": errors, "group.id": "statekeeper-range", "enable.auto.commit": False, "auto.offset.reset": "error",
         "enable.partition.eof": True, "isolation.level": "read_uncommitted"}  # as Spark's Kafka source reads
    )  # fmt: skip
    where = f"topic {topic}, partition {part.partition}, offsets {part.start}–{part.end - 1}"
    try:
        consumer.assign([TopicPartition(topic, part.partition, part.start)])
        chunk: list[tuple[str, bytes]] = []
        position, heard = part.start, time.monotonic()
        while position < part.end:
            message = consumer.poll(1.0)
            error = message.error() if message is not None else None
            if message is None or (error is not None and error.code() == KafkaError._PARTITION_EOF):
                if refused := errors.refusal():
                    raise ConnectionRefusedError(f"{where} cannot be read: {refused}")
                position = max(position, consumer.position([TopicPartition(topic, part.partition)])[0].offset)
                if time.monotonic() - heard > STALL_SECONDS:
                    raise TimeoutError(f"no record of {where} came in {STALL_SECONDS:g} s (read to {position})")
                continue
            if error is not None:
                raise RuntimeError(f"{where} cannot be read: {error.str()}")
            offset = int(message.offset() or 0)
            heard, position = time.monotonic(), offset + 1
            if offset >= part.end:
                break
            stamp = message.timestamp()[1]
            chunk.append((f"{stamp}-{(part.partition << 40) + offset}", message.value() or b""))
            if len(chunk) >= CHUNK:
                yield chunk
                chunk = []
        if chunk:
            yield chunk
    finally:
        consumer.close()
