"""dedup: events with ids, some repeated upstream -> each id exactly once (within a watermark)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F
from statekeeper_sdk import Field, PayloadFormat, Pipeline, Result, ResultView

PAYLOAD = PayloadFormat(
    "json", (Field("event_id", "string"), Field("ts", "long"), Field("user", "string", False)), event_time="ts"
)
WATERMARK = "10 minutes"


def transform(events: DataFrame) -> DataFrame:
    return (
        events.select("event_id", "user", F.timestamp_millis("ts").alias("event_time"))
        .withWatermark("event_time", WATERMARK)
        .dropDuplicatesWithinWatermark(["event_id"])
        .select("event_id", "user", "event_time")
    )


def results(rows: list[Row]) -> Iterable[Result]:
    for row in rows:
        yield "event", row["event_id"], {"user": row["user"], "event_time": row["event_time"].isoformat()}


def generator(rng: random.Random) -> Callable[[int], str]:
    recent: list[str] = []
    counter = iter(range(1 << 62))

    def make(now_ms: int) -> str:
        if recent and rng.random() < 0.2:  # upstream retries: the same id again
            event_id = rng.choice(recent)
        else:
            event_id = f"e{rng.getrandbits(32):08x}{next(counter)}"
            recent.append(event_id)
            del recent[:-500]
        return f'{{"event_id": "{event_id}", "ts": {now_ms}, "user": "u{rng.randrange(50)}"}}'

    return make


PIPELINE = Pipeline(
    name="dedup",
    title="Deduplicated events",
    description="Events with ids, some repeated upstream → each id exactly once (watermark 10 minutes).",
    payload=PAYLOAD,
    transform=transform,
    output_mode="append",
    results=results,
    generator=generator,
    views=(
        ResultView(
            "event",
            "Latest unique events",
            (("Event id", "key"), ("User", "user"), ("Event time", "event_time")),
            "event_time",
        ),
    ),
)
