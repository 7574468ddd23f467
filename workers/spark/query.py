"""Builds a job's streaming query: a source (Redis stream, files, Kafka) -> the pipeline's transform -> a foreachBatch
sink. No Django here."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

from py4j.protocol import Py4JJavaError
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from statekeeper_sdk import KafkaSink, Limits, Pipeline, apply
from statekeeper_sdk._runtime.events import MAX_FUTURE_SECONDS
from statekeeper_sdk._runtime.real_time import MIN_INTERVAL_SECONDS

from dashboard.checkpoint_dir.files import closing_file, committed_batches, lineage, seed_dir
from dashboard.kafka import spark_options
from workers.spark.manifest import ManifestKeeper
from workers.spark.session import RAW_LOCAL_FILES, backend_conf, local_files_conf, quiet_raw_local
from workers.spark.sources.files import file_events
from workers.spark.sources.following import unmark_followed
from workers.spark.sources.jvm_checks import checks_for
from workers.spark.sources.kafka import kafka_events, revealed_security
from workers.spark.sources.kafka_range import kafka_range_events
from workers.spark.sources.kafka_rejected import RejectedRecords
from workers.spark.sources.redis_streams import FORMAT_NAME, RedisStreamDataSource
from workers.spark.sources.register import register

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobSpec:
    """Everything a driver needs to run a job; plain values, so Spark code never touches Django."""

    job_id: int
    name: str
    pipeline: str
    stream: str
    redis_url: str
    backend: str
    trigger_seconds: float
    partitions: int
    parallelism: int
    checkpoint: str
    batches_retained: int
    max_records: int
    dead_letter: str
    skip_list: str = ""
    max_future_seconds: float = MAX_FUTURE_SECONDS
    ending_offset: str = ""  # JSON {"id", "n"} or Kafka's offsets: read up to there, then stop (``available_now``)
    available_now: bool = False
    source_kind: str = "redis-stream"  # "files": Spark's file source on ``source_path``; "kafka": topic ``stream``
    source_path: str = ""
    source_format: str = "json"
    # JSON: a Kafka source's TLS and SASL settings, a password as its secret's reference (revealed as the query starts)
    source_security: str = "{}"
    # JSON, where a new checkpoint starts reading: a Redis stream's {"id", "n"}, a Kafka topic's {topic: {partition: n}}
    starting_offset: str = ""
    parameters: str = "{}"  # JSON: the job's values for the pipeline's parameters
    # Start each batch this many seconds into the trigger interval rather than on Spark's tick (a shared driver spreads
    # its jobs so); see ``spread_trigger``.
    phase_seconds: float | None = None
    # A blue/green upgrade's new version: the job's checkpoint it follows batch by batch until ``handover_file``
    # exists (the source's ``BatchFollower``); empty for every other query.
    follow: str = ""
    handover_file: str = ""
    # how many numbers ahead of the job's batches the new version's are: 1 after a blue/green rescale (Spark's offline
    # repartition wrote one batch of no input into its fork), else 0
    follow_shift: int = 0
    follow_mirror: str = ""  # the console's copies of the job's committed batches (checkpoint_dir/files.py)
    # Spark's real-time mode: records flow through as they come, ``trigger_seconds`` apart a checkpoint, and Spark's
    # Kafka writer writes the pipeline's one sink (``start_real_time``)
    real_time: bool = False

    def session_conf(self) -> dict[str, str]:
        return {
            "spark.sql.shuffle.partitions": str(self.partitions),
            "spark.sql.streaming.minBatchesToRetain": str(self.batches_retained),
            **backend_conf(self.backend),
            **local_files_conf(self.backend, self.checkpoint),
        }


JOB_SPEC_FIELDS = frozenset(f.name for f in fields(JobSpec))  # what a scratch query takes from a job's run values

SPREAD_SLOTS = 20  # a spread job's trigger polls this often per interval: the phases a shared driver can give
SPREAD_POLL_MIN = 0.25  # seconds: but no more often than this (each poll is a planning round with no batch)
SPREAD_MIN_TRIGGER = 1.0  # seconds: a shorter interval has too few polls to spread over
# How a plan's analyzed form shows that Spark runs its batches without new data. A processing-time clock (timers or
# TTL of transformWithState in ProcessingTime mode, a ProcessingTimeTimeout of [flat]MapGroupsWithState) runs one at
# every trigger; an event-time watermark runs one after each batch that moved it (to evict state, fire its timers). A
# transformWithState or [flat]MapGroupsWithState with neither clock (NoTime, NoTimeout) runs none.
PROCESSING_TIME = re.compile(r"TransformWithState\w*? .*, ProcessingTime, |ProcessingTimeTimeout")
WATERMARK = "EventTimeWatermark"


def spread_poll(trigger_seconds: float) -> float:
    """How often a spread job's trigger polls its source; its phases are multiples of this."""
    return max(SPREAD_POLL_MIN, trigger_seconds / SPREAD_SLOTS)


def runs_without_data(frame: DataFrame) -> bool:
    """Whether Spark runs batches of this plan without new data: polled at a spread job's tick rate, it would run
    one at each poll (a processing-time clock) or one after each data batch (a watermark to move)."""
    plan = frame._jdf.queryExecution().analyzed().toString()
    return bool(PROCESSING_TIME.search(plan)) or WATERMARK in plan


def rejected_records(spark: SparkSession, spec: JobSpec, pipeline: Pipeline) -> RejectedRecords | None:
    """The writer of the dead letters of a job whose source checks its records in the JVM (Spark's Kafka source with a
    flat payload), to be told the query's progress; None for any other job, whose source writes them itself."""
    if spec.source_kind != "kafka" or spec.ending_offset or spec.follow:
        return None
    checks = checks_for(pipeline.payload, Limits(max_future_seconds=spec.max_future_seconds))
    if checks is None:
        return None
    return RejectedRecords(
        spark, checks, servers=spec.source_path, topic=spec.stream, security=revealed_security(spec.source_security),
        dead_letters=spec.dead_letter, redis_url=spec.redis_url, checkpoint=spec.checkpoint,
        starting=spec.starting_offset,
    )  # fmt: skip


def events_frame(spark: SparkSession, spec: JobSpec, pipeline: Pipeline, spread: bool = False) -> DataFrame:
    if spec.source_kind == "kafka" and (spec.ending_offset or spec.follow):  # ranges Spark's Kafka source cannot read
        return kafka_range_events(
            spark, spec.source_path, spec.stream, pipeline.payload, spec.dead_letter, spec.redis_url,
            spec.max_future_seconds, spec.max_records, spec.starting_offset, spec.ending_offset,
            revealed_security(spec.source_security), follow_options(spec),
        )  # fmt: skip
    if spec.source_kind == "kafka":
        if unmark_followed(spec.checkpoint):  # a checkpoint a green wrote while it followed the job
            log.info("%s: green's marks of no-data batches taken out of the offsets files", spec.name)
        return kafka_events(
            spark, spec.source_path, spec.stream, pipeline.payload, spec.dead_letter, spec.redis_url,
            spec.max_future_seconds, spec.max_records, spec.starting_offset,
            security=revealed_security(spec.source_security),
        )  # fmt: skip
    if spec.source_kind == "files":
        return file_events(
            spark, spec.source_path, spec.source_format, pipeline.payload, spec.dead_letter, spec.redis_url,
            spec.max_future_seconds,
        )  # fmt: skip
    register(spark, RedisStreamDataSource)
    reader = spark.readStream.format(FORMAT_NAME)
    if spread and spec.phase_seconds is not None:
        reader = (
            reader.option("admitEveryMs", str(round(spec.trigger_seconds * 1000)))
            .option("admitPhaseMs", str(round(spec.phase_seconds * 1000)))
            .option("closingFile", str(closing_file(Path(spec.checkpoint.removeprefix("file:")))))
        )
    reader = reader.options(**follow_options(spec))
    return (
        reader.option("url", spec.redis_url)
        .option("stream", spec.stream)
        .option("deadLetter", spec.dead_letter)
        .option("maxFutureSeconds", str(spec.max_future_seconds))
        .option("skipList", spec.skip_list)
        .option("maxRecordsPerBatch", str(spec.max_records))
        .option("readPartitions", str(max(1, spec.parallelism)))
        .option("format", pipeline.payload.to_option())
        .option("endingOffset", spec.ending_offset)
        .option("startingPosition", spec.starting_offset or "earliest")
        .load()
    )


def follow_options(spec: JobSpec) -> dict[str, str]:
    """A blue/green green's source options: the job's checkpoint it follows and the rest ``Following`` reads."""
    if not spec.follow:
        return {}
    return {"follow": spec.follow, "ownCheckpoint": spec.checkpoint, "handoverFile": spec.handover_file,
            "followShift": str(spec.follow_shift), "followMirror": spec.follow_mirror,
            "paceMs": str(round(spec.trigger_seconds * 1000))}  # fmt: skip


def spread_trigger(spec: JobSpec, output: DataFrame) -> bool:
    """Whether the job's batches start at its phase of the interval: Spark starts a processing-time trigger on the
    clock's multiples of the interval, so every job of one interval starts its batch on the same tick and their tasks
    queue for the cores. A spread job's trigger polls every ``spread_poll`` seconds and its source admits new entries
    once an interval, from its phase. Only the Redis stream source can, and only for a plan that runs no batch without
    new data (each poll would run one)."""
    return (
        spec.phase_seconds is not None
        and not spec.available_now
        and not spec.follow
        and spec.trigger_seconds >= SPREAD_MIN_TRIGGER
        and spec.source_kind == "redis-stream"
        and not runs_without_data(output)
    )


def drop_checksums(checkpoint: str) -> None:
    """Remove the checkpoint's Hadoop `.crc` side files, before a query that writes it without them starts.

    A file the raw local file system rewrites (a replayed batch's state delta) would otherwise keep the checksum of its
    old content, and a reader through Hadoop's checksummed file system (Spark's state reader, a savepoint's
    verification) would refuse it."""
    for path in Path(checkpoint.removeprefix("file:")).rglob(".*.crc"):
        path.unlink(missing_ok=True)


def session_settings(spark: SparkSession, spec: JobSpec, pipeline: Pipeline) -> None:
    """The job's SQL settings on ``spark``, before its query starts. A session that ran another job before keeps none
    of that job's file settings (RocksDB fails on the raw local file system a memory job's session uses)."""
    conf = quiet_raw_local(spark, {**spec.session_conf(), **pipeline.conf})
    for key in RAW_LOCAL_FILES.keys() - conf.keys():
        spark.conf.unset(key)
    if "fs.file.impl" in conf:
        drop_checksums(spec.checkpoint)
    for key, value in conf.items():
        spark.conf.set(key, value)


def initial_state(spark: SparkSession, checkpoint: str) -> DataFrame | None:
    """A state migration's output (``seed_dir``), for a checkpoint whose first batch has not committed: Spark seeds a
    transformWithState operator with it at batch 0 and ignores it after (the state holds it)."""
    root = Path(checkpoint.removeprefix("file:"))
    seed = seed_dir(root)
    if committed_batches(root) or not lineage(root).get("seeded"):
        return None
    if not (seed / "_SUCCESS").exists():  # never start a migrated line empty: that would lose the state quietly
        raise FileNotFoundError(f"the migrated state {seed} is missing: the new version cannot start without it")
    return spark.read.parquet(str(seed))


# What Spark counts as a query interrupted by its stop (StreamExecution.IO_EXCEPTION_NAMES)
INTERRUPTIONS = (
    "java.lang.InterruptedException",
    "java.io.InterruptedIOException",
    "java.nio.channels.ClosedByInterruptException",
)


class StoppedMidBatch(RuntimeError):
    """A foreachBatch's Spark call interrupted by the query's stop, said in a few words (``short_interruptions``)."""


def _interruption(exc: Py4JJavaError) -> str | None:
    """The name of the interruption among ``exc``'s Java exception and its causes, if it is one."""
    try:
        java = exc.java_exception
        for _ in range(8):
            if java is None:
                return None
            if (name := str(java.getClass().getName())) in INTERRUPTIONS:
                return name
            java = java.getCause()
    except Exception:  # the JVM cannot say: taken as no interruption, the error goes up as it came
        return None
    return None


def short_interruptions(sink: Callable[[DataFrame, int], None]) -> Callable[[DataFrame, int], None]:
    """``sink``, but a Spark call it makes that the query's stop interrupts raises ``StoppedMidBatch`` with a short
    message. Spark tells a stop's interruption of a Python foreachBatch by a regular expression over the error's text
    (``StreamExecution.PROXY_ERROR``: ``(.|\\r\\n|\\r|\\n)*``, one stack frame a character). The Py4J error's text
    holds the whole Java stack trace, so the match overflowed the stream thread's stack: every stop during a batch's
    sink write ended its thread with a StackOverflowError and a thousand-line trace in the driver's log (seen on the
    demo stack at an upgrade's stop). The short text still says what Spark looks for, and the stop ends cleanly."""

    def run(frame: DataFrame, batch_id: int) -> None:
        try:
            sink(frame, batch_id)
        except Py4JJavaError as exc:
            if (name := _interruption(exc)) is None:
                raise
            raise StoppedMidBatch(
                f"py4j.protocol.Py4JJavaError: An error occurred while calling Spark in batch {batch_id}'s sink\n"
                f": {name}"
            ) from None

    return run


class RealTimeRefused(ValueError):
    """A job's query that Spark's real-time mode cannot run, and why."""


def real_time_sink_frame(output: DataFrame, sink: KafkaSink, job_name: str) -> DataFrame:
    """The output rows as Spark's Kafka writer takes them: the sink's key column as text, the row (its columns) as
    JSON, as the console's micro-batch writer writes them, and the job's name in the ``statekeeper-job`` header."""
    columns = list(sink.columns or output.columns)
    key = F.col(sink.key).cast("string") if sink.key else F.lit(None).cast("string")
    header = F.array(F.struct(F.lit("statekeeper-job").alias("key"), F.lit(job_name).cast("binary").alias("value")))
    return output.select(
        key.alias("key"), F.to_json(F.struct(*[F.col(c) for c in columns])).alias("value"), header.alias("headers")
    )


def start_real_time(spark: SparkSession, spec: JobSpec, pipeline: Pipeline, sink: KafkaSink) -> StreamingQuery:
    """The job's query in Spark's real-time mode: its Kafka source's records checked in the JVM, the pipeline's
    transform, and the pipeline's Kafka sink written by Spark as each update comes (at least once: a restart replays
    the records after the last checkpoint, and a consumer keeping the latest value per key sees each key's value once
    the replay is through). A checkpoint every ``trigger_seconds``."""
    if spec.source_kind != "kafka":
        raise RealTimeRefused("Spark's real-time mode reads Kafka: the job's source is not a Kafka topic")
    if checks_for(pipeline.payload, Limits(max_future_seconds=spec.max_future_seconds)) is None:
        raise RealTimeRefused(
            f"{pipeline.name}'s payload is checked in Python (a nested schema, or a regex Java may read otherwise), "
            "and real-time mode runs no Python: it runs in micro-batches only"
        )
    # a batch takes what comes during its interval: Spark refuses a bound on its records (maxOffsetsPerTrigger)
    unbounded = replace(spec, max_records=0)
    output = apply(pipeline, events_frame(spark, unbounded, pipeline), json.loads(spec.parameters))
    interval = max(MIN_INTERVAL_SECONDS, spec.trigger_seconds)  # the form refuses less; a job from before, so
    return (
        real_time_sink_frame(output, sink, spec.name)
        .writeStream.queryName(spec.name)
        .format("kafka")
        .outputMode(pipeline.output_mode)
        .option("kafka.bootstrap.servers", sink.servers)
        .option("topic", sink.topic)
        .options(**spark_options(sink.security))
        .option("checkpointLocation", spec.checkpoint)
        .trigger(realTime=f"{interval:g} seconds")  # type: ignore[call-overload]  # new in 4.1
        .start()
    )


def start_query(
    spark: SparkSession,
    spec: JobSpec,
    pipeline: Pipeline,
    sink: Callable[[DataFrame, int], None],
    on_phase: Callable[[float | None], None] | None = None,
    real_time_sink: KafkaSink | None = None,
) -> StreamingQuery:
    """``on_phase``: told where in the interval the query's batches will start, before it starts: ``spec.phase_seconds``
    when it is spread (``spread_trigger``), None when it keeps Spark's tick (the interval's multiples).
    ``real_time_sink``: a real-time job's Kafka sink, its targets and secrets filled in (``sink`` is not called)."""
    session_settings(spark, spec, pipeline)
    if spec.real_time:
        if real_time_sink is None:
            raise RealTimeRefused(f"{pipeline.name} declares no Kafka sink: real-time mode writes only Kafka")
        if on_phase is not None:
            on_phase(None)
        return start_real_time(spark, spec, pipeline, real_time_sink)
    values = json.loads(spec.parameters)
    initial = initial_state(spark, spec.checkpoint)
    output = apply(pipeline, events_frame(spark, spec, pipeline), values, initial)
    spread = spread_trigger(spec, output)
    if on_phase is not None:
        on_phase(spec.phase_seconds if spread else None)
    if spread:
        output = apply(pipeline, events_frame(spark, spec, pipeline, spread=True), values, initial)
    if spec.backend != "memory" and not spec.available_now:  # a query that runs for long: its MANIFEST bounded
        sink = ManifestKeeper(spec.checkpoint, sink)
    sink = short_interruptions(sink)
    writer = (
        output.writeStream.queryName(spec.name)
        .outputMode(pipeline.output_mode)
        .foreachBatch(sink)
        .option("checkpointLocation", spec.checkpoint)
    )
    if spec.available_now:
        return writer.trigger(availableNow=True).start()
    if spec.follow:  # a blue/green upgrade's new version: its source paces it (``RedisStreamReader._paced``)
        return writer.trigger(processingTime="0 seconds").start()
    if spread:
        poll = spread_poll(spec.trigger_seconds)
        log.info("%s: batches start %g s into each %g s interval (trigger polled every %g s)", spec.name,
                 spec.phase_seconds, spec.trigger_seconds, poll)  # fmt: skip
        return writer.trigger(processingTime=f"{poll} seconds").start()
    return writer.trigger(processingTime=f"{spec.trigger_seconds} seconds").start()
