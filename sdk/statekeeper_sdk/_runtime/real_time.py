"""Whether Spark's real-time mode runs a pipeline's query: the one check the test kit (``testing.check_real_time``) and
the console (a real-time job's start and upgrade preview) both make.

Spark decides at the query's start: its physical plan's operators and its sink must be on real-time mode's allowlist
(``RealTimeModeAllowlist``: projections, filters, streaming aggregations, ``dropDuplicates``, the JVM's
transformWithState, Kafka and ``foreach`` sinks; no Python UDF, no ``mapInPandas``, no ``applyInPandas``). The check
starts the query in real-time mode on an in-memory source of the pipeline's events (Spark's ``LowLatencyMemoryStream``,
no data) and stops it after its first planning: Spark's own refusal, word for word, or None.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from pyspark.sql import DataFrame, SparkSession

REFUSED = "STREAMING_REAL_TIME_MODE"  # the error class of every refusal of real-time mode
# Spark planned the query and its allowlist passed; the task slots of its pipelined stages are the deployment's
# matter (a real-time job's driver has them), not the query's
NO_SLOTS = "CONCURRENT_SCHEDULER_INSUFFICIENT_SLOT"
# the only state store real-time mode takes, in the format that records each commit's files
STATE_STORE = {
    "spark.sql.streaming.stateStore.providerClass":
        "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
    "spark.sql.streaming.stateStore.checkpointFormatVersion": "2",
}  # fmt: skip
MIN_INTERVAL_SECONDS = 5.0  # Spark's least real-time batch (spark.sql.streaming.realTimeMode.minBatchDuration)
CHECK_SECONDS = 60.0  # a query that neither fails nor plans in this long is taken as refused, with this said
DETAIL = re.compile(r"\n=== Streaming Query ===.*", re.S)


def spark_reason(error: Any) -> str:
    """A query's failure in Spark's words, without the query's description Spark appends."""
    text = str(getattr(error, "desc", None) or error)
    return DETAIL.sub("", text).strip()


def memory_events(spark: SparkSession, schema_ddl: str, partitions: int = 1) -> DataFrame:
    """A streaming frame of events in ``schema_ddl``'s columns from Spark's real-time in-memory source, empty."""
    jvm = spark._jvm
    assert jvm is not None
    schema = spark.createDataFrame([], schema_ddl).schema
    encoder = jvm.org.apache.spark.sql.Encoders.row(spark._jsparkSession.parseDataType(schema.json()))
    stream = jvm.org.apache.spark.sql.execution.streaming.sources.LowLatencyMemoryStream.apply(
        spark._jsparkSession, partitions, encoder
    )
    return DataFrame(stream.toDF(), spark)


def refusal(
    spark: SparkSession, pipeline: Any, values: Mapping[str, Any], shuffle_partitions: int = 1,
    settings: Mapping[str, str] | None = None,
) -> str | None:  # fmt: skip
    """Spark's reason for refusing ``pipeline``'s query in real-time mode, or None when it plans it. ``values``: the
    job's parameters, checked; ``settings``: the pipeline's Spark settings; the check's are set on a session of its
    own, the state in RocksDB."""
    from statekeeper_sdk.pipeline import apply

    session = spark.newSession()
    quick = {  # the check's batch ends soon after it starts (a job's interval is 5 s or more)
        "spark.sql.streaming.realTimeMode.minBatchDuration": "200ms",
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        **STATE_STORE,
    }
    for key, value in {**quick, **(settings or {})}.items():
        session.conf.set(key, value)
    checkpoint = tempfile.mkdtemp(prefix="statekeeper-real-time-check-")
    try:
        try:
            output = apply(pipeline, memory_events(session, pipeline.payload.spark_schema()), values)
            query = (
                output.writeStream.outputMode(pipeline.output_mode)
                .format("console")  # a sink on the allowlist that needs no broker and no Python worker
                .option("numRows", "1")
                .option("checkpointLocation", checkpoint)
                .trigger(realTime="200 milliseconds")  # type: ignore[call-overload]  # new in 4.1
                .start()
            )
        except Exception as exc:  # refused as it was declared (an output mode the plan cannot take, …)
            return spark_reason(exc)
        try:
            deadline = time.monotonic() + CHECK_SECONDS
            while query.isActive and query.lastProgress is None and time.monotonic() < deadline:
                try:
                    if query.awaitTermination(0.2):
                        break
                except Exception:  # it failed: its exception below
                    break
            error = query.exception()
            if error is not None:
                reason = spark_reason(error)
                return None if NO_SLOTS in reason else reason
            if query.lastProgress is None and query.isActive:
                return f"Spark neither ran nor refused the query in real-time mode within {CHECK_SECONDS:g} s"
            return None
        finally:
            query.stop()
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)
