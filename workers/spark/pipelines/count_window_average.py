"""count-window-average: (key, value) events -> the average of every 2 values per key; state cleared after emit.

Flink's CountWindowAverage example, with a ValueState of (count, sum) in transformWithState.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pyspark.sql import DataFrame, Row
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from statekeeper_sdk import Field, PayloadFormat, Pipeline, Result, ResultView, parse_id

PAYLOAD = PayloadFormat("json", (Field("key", "string"), Field("value", "double")))
WINDOW = 2
OUTPUT = "key string, entry string, average double"


class CountWindowAverage(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        self.acc = handle.getValueState("count_sum", "count bigint, total double")

    def handleInputRows(self, key: Any, rows: Iterator[Row], timerValues: Any) -> Iterator[Row]:
        saved = self.acc.get() if self.acc.exists() else None
        count, total = (saved[0], saved[1]) if saved else (0, 0.0)
        for row in sorted(rows, key=lambda r: parse_id(r["_id"])):
            count, total = count + 1, total + row["value"]
            if count == WINDOW:
                yield Row(key=key[0], entry=row["_id"], average=total / count)
                count, total = 0, 0.0
        if count:
            self.acc.update((count, total))
        else:
            self.acc.clear()

    def close(self) -> None:
        pass


def transform(events: DataFrame) -> DataFrame:
    return events.groupBy("key").transformWithState(
        statefulProcessor=CountWindowAverage(), outputStructType=OUTPUT, outputMode="Append", timeMode="None"
    )


def results(rows: list[Row]) -> Iterable[Result]:
    for row in rows:
        yield (
            "average",
            f"{row['key']}:{row['entry']}",
            {"key": row["key"], "average": row["average"], "entry": row["entry"]},
        )


def generator(rng: random.Random) -> Callable[[int], str]:
    return lambda now_ms: f'{{"key": "k{rng.randrange(10)}", "value": {rng.randrange(1, 100)}}}'


PIPELINE = Pipeline(
    name="count-window-average",
    title="Average of every 2 values",
    description="(key, value) events → the average of every 2 values per key; state cleared after each emit.",
    payload=PAYLOAD,
    transform=transform,
    output_mode="append",
    results=results,
    generator=generator,
    views=(
        ResultView("average", "Latest averages", (("Key", "key"), ("Average", "average"), ("Entry", "entry")), "entry"),
    ),
    needs_rocksdb=True,
)
