"""minute-windows: requests per URL per event-time minute, with a watermark that closes old windows."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F
from statekeeper_sdk import Pipeline, Result, ResultView

from workers.spark.pipelines.access_log import ACCESS_LOG
from workers.spark.pipelines.url_counts import access_log_line

WATERMARK = "2 minutes"


def transform(events: DataFrame) -> DataFrame:
    timed = events.select("url", F.to_timestamp("time", "dd/MMM/yyyy:HH:mm:ss Z").alias("event_time"))
    return (
        timed.withWatermark("event_time", WATERMARK)
        .groupBy(F.window("event_time", "1 minute"), "url")
        .agg(F.count(F.lit(1)).alias("requests"))
        .select(F.col("window.start").alias("minute"), "url", "requests")
    )


def results(rows: list[Row]) -> Iterable[Result]:
    for row in rows:
        minute = row["minute"].strftime("%Y-%m-%d %H:%M")
        yield (
            "window",
            f"{minute} {row['url']}",
            {"minute": minute, "url": row["url"], "requests": int(row["requests"])},
        )


def generator(rng: random.Random) -> Callable[[int], str]:
    return lambda now_ms: access_log_line(rng, now_ms)


PIPELINE = Pipeline(
    name="minute-windows",
    title="Requests per URL per minute",
    description="Access-log lines → requests per URL per event-time minute (watermark 2 minutes).",
    payload=ACCESS_LOG,
    transform=transform,
    output_mode="update",
    results=results,
    generator=generator,
    views=(
        ResultView(
            "window", "Latest windows", (("Minute", "minute"), ("URL", "url"), ("Requests", "requests")), "minute"
        ),
    ),
)
