"""A query stopped while its batch's sink is in a Spark call: the stop ends it as Spark expects a stop to."""

from __future__ import annotations

import traceback
from typing import Any

import pytest


def _spark_tells_a_stop(spark: Any, text: str) -> bool:
    """Spark's own test of a Python foreachBatch's error text for a stop's interruption
    (``StreamExecution.isInterruptionException``)."""
    pattern = spark._jvm.org.apache.spark.sql.execution.streaming.runtime.StreamExecution.PROXY_ERROR()
    return bool(pattern.findFirstIn(text).isDefined())


def test_a_sinks_spark_call_interrupted_by_the_stop_says_so_in_the_few_words_spark_looks_for(spark):
    """Every stop during a batch's sink write (an upgrade's, a rescale's) ended the stream thread with a
    StackOverflowError and a thousand-line trace in the driver's log: Spark matches the error's text with a regular
    expression that recurses once a character, and the Py4J error's text holds the whole Java stack trace."""
    from py4j.protocol import Py4JJavaError

    from workers.spark.query import StoppedMidBatch, short_interruptions

    thread = spark._jvm.java.lang.Thread

    def write(frame: Any, batch_id: int) -> None:  # as the stop interrupts the stream thread in the sink's count()
        thread.currentThread().interrupt()
        thread.sleep(1000)

    with pytest.raises(Py4JJavaError) as raw:
        write(None, 7)
    assert str(raw.value.java_exception.getClass().getName()) == "java.lang.InterruptedException"

    with pytest.raises(StoppedMidBatch) as raised:
        short_interruptions(write)(spark.range(1), 7)
    text = "".join(traceback.format_exception(raised.value))  # what py4j hands Spark (``_call_proxy``)
    assert "at java." not in text and len(text) < 2000, "no Java stack trace in it"
    assert "batch 7's sink" in text
    assert _spark_tells_a_stop(spark, text)

    def fails(frame: Any, batch_id: int) -> None:  # any other error of the JVM goes up as it came
        spark._jvm.java.lang.Class.forName("no.such.Sink")

    with pytest.raises(Py4JJavaError, match="ClassNotFoundException: no.such.Sink"):
        short_interruptions(fails)(spark.range(1), 8)
