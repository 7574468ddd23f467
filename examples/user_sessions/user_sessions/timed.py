"""Sessions closed by timers, with expiring state: ``user-sessions-timed``.

Each user's open session is a state value; every event moves the user's timer to ``gap_seconds`` after it, and when
the timer fires the session is closed: its events and amount move into the user's closed totals, a state value with a
time to live of ``ttl_minutes`` (a user quiet for longer is forgotten). Every event and every closed session emits
the user's row: events and amount over the open and the kept closed sessions, the sessions, and whether one is open.

Spark 4.3 allows TTL only in processing-time mode (``STATEFUL_PROCESSOR_INCORRECT_TIME_MODE_TO_ASSIGN_TTL``), so the
timers here are processing-time timers too; an event-time version would keep its timers and drop the TTL. The
console's inspector lists the registered timers with their firing times and each state variable's TTL, and the
upgrade preview compares both.

``user-sessions-merged`` keeps the same figures in one state variable (``session``: the closed totals and the open
session side by side) instead of two. The upgrade preview refuses the move (two variables removed, one added: their
state would be lost); the version declares a migration that joins ``open`` and ``closed`` per user into ``session``,
and registers the open sessions' timers again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from statekeeper_sdk import Migration, OldState, Parameter, Params, Pipeline, ResultView

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


# user-sessions-merged: one state variable where user-sessions-timed keeps two
SESSION = "sessions bigint, events bigint, amount double, open_events bigint, open_amount double, last_ms bigint"


class MergedSessions(StatefulProcessor):
    def __init__(self, gap_ms: int, ttl_ms: int) -> None:
        self.gap_ms, self.ttl_ms = gap_ms, ttl_ms

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.session = handle.getValueState("session", SESSION, ttlDurationMs=self.ttl_ms)

    def _row(self, key: Any, saved: tuple[Any, ...]) -> Row:
        sessions, events, amount, open_events, open_amount, _ = saved
        is_open = open_events > 0
        return Row(key=key[0], events=events + open_events, amount=amount + open_amount,
                   sessions=sessions + (1 if is_open else 0), open=is_open)  # fmt: skip

    def handleInitialState(self, key: Any, initialState: Row, timerValues: Any) -> None:
        saved = tuple(
            initialState[f] for f in ("sessions", "events", "amount", "open_events", "open_amount", "last_ms")
        )
        self.session.update(saved)
        if saved[3]:  # an open session: its timer again (one whose gap passed meanwhile fires at the next batch)
            self.handle.registerTimer(saved[5] + self.gap_ms)

    def handleInputRows(self, key: Any, rows: Iterator[Row], timerValues: Any) -> Iterator[Row]:
        now = timerValues.getCurrentProcessingTimeInMs()
        sessions, events, amount, open_events, open_amount, _ = _saved(self.session, (0, 0, 0.0, 0, 0.0, 0))
        for row in rows:
            open_events, open_amount = open_events + 1, open_amount + row["amount"]
        saved = (sessions, events, amount, open_events, open_amount, now)
        self.session.update(saved)
        for timer in self.handle.listTimers():
            self.handle.deleteTimer(timer)
        self.handle.registerTimer(now + self.gap_ms)
        yield self._row(key, saved)

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Row]:
        sessions, events, amount, open_events, open_amount, last_ms = _saved(self.session, (0, 0, 0.0, 0, 0.0, 0))
        if open_events:
            sessions, events, amount, open_events, open_amount = (
                sessions + 1,
                events + open_events,
                amount + open_amount,
                0,
                0.0,
            )
            self.session.update((sessions, events, amount, open_events, open_amount, last_ms))
        yield self._row(key, (sessions, events, amount, open_events, open_amount, last_ms))

    def close(self) -> None:
        pass


def merged(events: DataFrame, params: Params, initial_state: DataFrame | None = None) -> DataFrame:
    return events.groupBy("user").transformWithState(
        statefulProcessor=MergedSessions(params.gap_seconds * 1000, params.ttl_minutes * 60_000),
        outputStructType=OUTPUT,
        outputMode="Update",
        timeMode="ProcessingTime",
        initialState=initial_state.groupBy("user") if initial_state is not None else None,
    )


def _value(frame: DataFrame) -> DataFrame:
    """A state variable's value, without the expiry Spark keeps beside a value with a TTL."""
    value: Any = frame.schema["value"].dataType
    fields = [f.name for f in value.fields]
    return frame.select(F.col("key.user").alias("user"),
                        F.col("value.value" if "ttlExpirationMs" in fields else "value").alias("v"))  # fmt: skip


def merged_from_timed(old: OldState, params: Params) -> DataFrame:
    """Each user's open session and closed totals, joined into one value (a user with only one of them gets zeros
    for the other)."""
    opened = _value(old["open"]).select(
        "user",
        F.col("v.events").alias("open_events"),
        F.col("v.amount").alias("open_amount"),
        F.col("v.last_ms").alias("last_ms"),
    )
    closed = _value(old["closed"]).select(
        "user",
        F.col("v.sessions").alias("sessions"),
        F.col("v.events").alias("events"),
        F.col("v.amount").alias("amount"),
    )
    return opened.join(closed, "user", "full_outer").select(
        "user",
        F.coalesce("sessions", F.lit(0)).cast("bigint").alias("sessions"),
        F.coalesce("events", F.lit(0)).cast("bigint").alias("events"),
        F.coalesce("amount", F.lit(0.0)).alias("amount"),
        F.coalesce("open_events", F.lit(0)).cast("bigint").alias("open_events"),
        F.coalesce("open_amount", F.lit(0.0)).alias("open_amount"),
        F.coalesce("last_ms", F.lit(0)).cast("bigint").alias("last_ms"),
    )  # fmt: skip


SESSIONS_MERGED = Pipeline(
    name="user-sessions-merged",
    title="User sessions in one state variable",
    description="user-sessions-timed with its open session and closed totals in one state variable; migrated to from "
    "user-sessions-timed.",
    payload=PAYLOAD,
    transform=merged,
    output_mode="update",
    results=results,
    generator=generator,
    views=SESSIONS_TIMED.views,
    needs_rocksdb=True,
    conf=CONF,
    parameters=PARAMETERS,
    version_of="user-sessions-timed",
    migrations=(
        Migration("user-sessions-timed", ("user",), merged_from_timed, "open and closed joined per user into session"),
    ),
)
