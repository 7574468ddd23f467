"""url-counts: Nginx access-log lines -> requests per URL (a keyed count, the reference articles' example)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from datetime import UTC, datetime

from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F
from statekeeper_sdk import KafkaSink, Parameter, Params, Pipeline, Result, ResultView

from workers.spark.pipelines.access_log import ACCESS_LOG

URLS = ["/api/a", "/api/b", "/api/orders", "/api/users", "/login", "/", "/static/app.js", "/health"]


def transform(events: DataFrame) -> DataFrame:
    return events.groupBy("url").agg(F.count(F.lit(1)).alias("requests")).select("url", "requests")


def results(rows: list[Row]) -> Iterable[Result]:
    for row in rows:
        yield "url", row["url"], {"requests": int(row["requests"])}


def access_log_line(rng: random.Random, now_ms: int, urls: list[str] = URLS) -> str:
    stamp = datetime.fromtimestamp(now_ms / 1000, UTC).strftime("%d/%b/%Y:%H:%M:%S +0000")
    url = urls[min(int(rng.expovariate(0.6)), len(urls) - 1)]
    method = "POST" if url in ("/login", "/api/orders") and rng.random() < 0.5 else "GET"
    status = 200 if rng.random() < 0.95 else rng.choice([404, 500, 302])
    return f'10.0.{rng.randrange(256)}.{rng.randrange(256)} - - [{stamp}] "{method} {url} HTTP/1.1" {status} {rng.randrange(100, 9000)} "-" "demo/1.0"'


def generator(rng: random.Random) -> Callable[[int], str]:
    return lambda now_ms: access_log_line(rng, now_ms)


PIPELINE = Pipeline(
    name="url-counts",
    title="Requests per URL",
    description="Access-log lines → requests per URL (keyed count).",
    payload=ACCESS_LOG,
    transform=transform,
    output_mode="update",
    results=results,
    generator=generator,
    views=(ResultView("url", "Top URLs", (("URL", "key"), ("Requests", "requests")), "requests"),),
)


def live_transform(events: DataFrame, params: Params) -> DataFrame:
    return transform(events)  # its parameters say where the counts go, not how they are made


# The same count in Spark's real-time mode: each request's new count on the topic as it comes (key: the URL, value
# {"url", "requests"}), a consumer keeping the latest per key. A job of this pipeline chooses its mode.
LIVE = Pipeline(
    name="url-counts-live",
    title="Requests per URL, as they come",
    description="Access-log lines → requests per URL (keyed count) into a Kafka topic, in real-time mode.",
    payload=ACCESS_LOG,
    transform=live_transform,
    output_mode="update",
    results=results,
    generator=generator,
    views=(),
    parameters=(
        Parameter("kafka", "str", "127.0.0.1:9092", "the Kafka cluster the counts go to"),
        Parameter("counts_topic", "str", "url-counts", "the topic of the counts, one record per change of a count"),
    ),
    sinks=(KafkaSink("counts", servers="{kafka}", topic="{counts_topic}", key="url"),),
    real_time=True,
)
