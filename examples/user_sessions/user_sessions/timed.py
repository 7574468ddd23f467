"""Sessions closed by timers, with expiring state: ``user-sessions-timed``.

Each user's open session is a state value; every event moves the user's timer to ``gap_seconds`` after it, and when
the timer fires the session is closed: its events and amount move into the user's closed totals, a state value with a
time to live of ``ttl_minutes`` (a user quiet for longer is forgotten). Every event and every closed session emits
the user's row: events and amount over the open and the kept closed sessions, the sessions, and whether one is open.

Spark 4.3 allows TTL only in processing-time mode (``STATEFUL_PROCESSOR_INCORRECT_TIME_MODE_TO_ASSIGN_TTL``), so the
timers here are processing-time timers too; an event-time version would keep its timers and drop the TTL. The
console's inspector lists the registered timers with their firing times and each state variable's TTL, and the
upgrade preview compares both.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql import DataFrame, Row
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from statekeeper_sdk import Parameter, Params, Pipeline, ResultView

from user_sessions.pipelines import CONF, PAYLOAD, generator, results

OPEN = "events bigint, amount double, last_ms bigint"
CLOSED = "sessions bigint, events bigint, amount double"
OUTPUT = "key string, events bigint, amount double, sessions bigint, open boolean"
PARAMETERS = (
    Parameter("gap_seconds", "int", 30, "a session closes this long after its last event", minimum=1, maximum=86400,
              operational=True),
    Parameter("ttl_minutes", "int", 60, "a user's closed sessions are kept this long after their last change",
              minimum=1, maximum=525600, operational=True),
)  # fmt: skip


def _saved(state: Any, empty: tuple[Any, ...]) -> tuple[Any, ...]:
    value = state.get() if state.exists() else None
    return tuple(value) if value is not None else empty


class TimedSessions(StatefulProcessor):
    def __init__(self, gap_ms: int, ttl_ms: int) -> None:
        self.gap_ms, self.ttl_ms = gap_ms, ttl_ms

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.open = handle.getValueState("open", OPEN)
        self.closed = handle.getValueState("closed", CLOSED, ttlDurationMs=self.ttl_ms)

    def _row(self, key: Any, is_open: bool) -> Row:
        events, amount, _ = _saved(self.open, (0, 0.0, 0))
        sessions, closed_events, closed_amount = _saved(self.closed, (0, 0, 0.0))
        return Row(key=key[0], events=events + closed_events, amount=amount + closed_amount,
                   sessions=sessions + (1 if is_open else 0), open=is_open)  # fmt: skip

    def handleInputRows(self, key: Any, rows: Iterator[Row], timerValues: Any) -> Iterator[Row]:
        now = timerValues.getCurrentProcessingTimeInMs()
        events, amount, _ = _saved(self.open, (0, 0.0, 0))
        for row in rows:
            events, amount = events + 1, amount + row["amount"]
        self.open.update((events, amount, now))
        for timer in self.handle.listTimers():
            self.handle.deleteTimer(timer)
        self.handle.registerTimer(now + self.gap_ms)
        yield self._row(key, True)

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Row]:
        if self.open.exists():
            events, amount, _ = _saved(self.open, (0, 0.0, 0))
            sessions, closed_events, closed_amount = _saved(self.closed, (0, 0, 0.0))
            self.closed.update((sessions + 1, closed_events + events, closed_amount + amount))
            self.open.clear()
        yield self._row(key, False)

    def close(self) -> None:
        pass


def transform(events: DataFrame, params: Params) -> DataFrame:
    return events.groupBy("user").transformWithState(
        statefulProcessor=TimedSessions(params.gap_seconds * 1000, params.ttl_minutes * 60_000),
        outputStructType=OUTPUT,
        outputMode="Update",
        timeMode="ProcessingTime",
    )


SESSIONS_TIMED = Pipeline(
    name="user-sessions-timed",
    title="User sessions closed by timers",
    description="(user, region, amount) events → per-user sessions closed by a timer after a gap, closed totals kept "
    "with a TTL (parameters: gap, TTL).",
    payload=PAYLOAD,
    transform=transform,
    output_mode="update",
    results=results,
    generator=generator,
    views=(
        ResultView(
            "totals",
            "Users",
            (("Key", "key"), ("Events", "events"), ("Amount", "amount"), ("Sessions", "sessions"), ("Open", "open")),
            "events",
        ),
    ),  # fmt: skip
    needs_rocksdb=True,
    conf=CONF,
    parameters=PARAMETERS,
)
