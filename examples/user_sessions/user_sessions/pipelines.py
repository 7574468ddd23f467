"""Per-user activity sessions, in three versions, to show how a stateful job is upgraded with its state.

Events are JSON ``{"user": "u3", "region": "eu", "amount": 12.5}`` on a Redis stream. Each user's state is one
transformWithState value: the events and amount so far, the number of sessions (a new session starts after a gap of
``SESSION_GAP_MS`` in the entries' times) and the time of the last event. Every batch emits the users it touched.

- ``user-sessions`` (version 1).
- ``user-sessions-v2``: adds ``largest`` (the largest amount) to the state and the results. Compatible: the state is
  Avro-encoded, so Spark's schema evolution reads version 1's values with the new field empty.
- ``user-sessions-by-region``: keys the state by region instead of user. Incompatible: Spark itself would accept it
  (the key is still one string) and read every user's totals as a region's; Statekeeper's upgrade preview refuses it.

The package depends on the SDK only (``statekeeper-sdk>=1,<2``); registering a pipeline is the
``statekeeper.pipelines`` entry point in ``pyproject.toml``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from typing import Any

from pyspark.sql import DataFrame, Row
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from statekeeper_sdk import Field, PayloadFormat, Pipeline, Result, ResultView, parse_id

PAYLOAD = PayloadFormat("json", (Field("user", "string"), Field("region", "string"), Field("amount", "double")))
SESSION_GAP_MS = 30_000
# Avro-encoded state is what lets Spark evolve a transformWithState value's schema; it is fixed at the first batch.
CONF = {"spark.sql.streaming.stateStore.encodingFormat": "avro"}
STATE_V1 = "events bigint, amount double, sessions bigint, last_ms bigint"
STATE_V2 = STATE_V1 + ", largest double"
OUTPUT_V1 = "key string, events bigint, amount double, sessions bigint"
OUTPUT_V2 = OUTPUT_V1 + ", largest double"


class Sessions(StatefulProcessor):
    """Totals and session counts per key; ``with_largest`` is version 2's added field."""

    def __init__(self, with_largest: bool = False) -> None:
        self.with_largest = with_largest

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.totals = handle.getValueState("totals", STATE_V2 if self.with_largest else STATE_V1)

    def handleInputRows(self, key: Any, rows: Iterator[Row], timerValues: Any) -> Iterator[Row]:
        saved = self.totals.get() if self.totals.exists() else None
        events, amount, sessions, last_ms = (saved[0], saved[1], saved[2], saved[3]) if saved else (0, 0.0, 0, 0)
        largest = saved[4] if saved is not None and len(saved) > 4 and saved[4] is not None else None
        for row in sorted(rows, key=lambda r: parse_id(r["_id"])):
            at = parse_id(row["_id"])[0]
            if not sessions or at - last_ms > SESSION_GAP_MS:
                sessions += 1
            events, amount, last_ms = events + 1, amount + row["amount"], max(last_ms, at)
            largest = row["amount"] if largest is None else max(largest, row["amount"])
        if self.with_largest:
            self.totals.update((events, amount, sessions, last_ms, largest))
            yield Row(key=key[0], events=events, amount=amount, sessions=sessions, largest=largest)
        else:
            self.totals.update((events, amount, sessions, last_ms))
            yield Row(key=key[0], events=events, amount=amount, sessions=sessions)

    def close(self) -> None:
        pass


def _transform(by: str, with_largest: bool) -> Callable[[DataFrame], DataFrame]:
    def transform(events: DataFrame) -> DataFrame:
        return events.groupBy(by).transformWithState(
            statefulProcessor=Sessions(with_largest),
            outputStructType=OUTPUT_V2 if with_largest else OUTPUT_V1,
            outputMode="Update",
            timeMode="None",
        )

    return transform


def results(rows: list[Row]) -> Iterable[Result]:
    for row in rows:
        value = row.asDict()
        yield "totals", str(value.pop("key")), value


def generator(rng: random.Random) -> Callable[[int], str]:
    def event(now_ms: int) -> str:
        user = rng.randrange(20)
        return (
            f'{{"user": "u{user}", "region": "{("eu", "us", "ap")[user % 3]}", "amount": {rng.randrange(1, 500) / 10}}}'
        )

    return event


COLUMNS = (("Key", "key"), ("Events", "events"), ("Amount", "amount"), ("Sessions", "sessions"))

SESSIONS = Pipeline(
    name="user-sessions",
    title="User sessions",
    description="(user, region, amount) events → per-user events, amount and activity sessions (30 s gap).",
    payload=PAYLOAD,
    transform=_transform("user", with_largest=False),
    output_mode="update",
    results=results,
    generator=generator,
    views=(ResultView("totals", "Users", COLUMNS, "events"),),
    needs_rocksdb=True,
    conf=CONF,
)
SESSIONS_V2 = replace(
    SESSIONS,
    name="user-sessions-v2",
    version_of="user-sessions",
    title="User sessions, with the largest amount",
    description=SESSIONS.description + " Version 2: also the largest amount per user.",
    transform=_transform("user", with_largest=True),
    views=(ResultView("totals", "Users", (*COLUMNS, ("Largest", "largest")), "events"),),
)
SESSIONS_BY_REGION = replace(
    SESSIONS,
    name="user-sessions-by-region",
    version_of="user-sessions",
    title="Sessions per region",
    description="The same totals keyed by region instead of user (an incompatible change of the state's key).",
    transform=_transform("region", with_largest=False),
    views=(ResultView("totals", "Regions", COLUMNS, "events"),),
)
