"""order-state-machine: order events -> per-order state in a ValueState (transformWithState).

An illegal transition (e.g. cancel after accepted) becomes an alert and leaves the state as it was; a terminal order
(delivered, cancelled) clears its state, so state holds open orders only.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from pyspark.sql import DataFrame, Row
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from statekeeper_sdk import Field, PayloadFormat, Pipeline, Result, ResultView, parse_id

PAYLOAD = PayloadFormat(
    "json", (Field("order_id", "string"), Field("event", "string"), Field("ts", "long")), event_time="ts"
)

# state -> events allowed from it; None is "no state yet"
TRANSITIONS: dict[str | None, dict[str, str]] = {
    None: {"created": "created"},
    "created": {"paid": "paid", "cancelled": "cancelled"},
    "paid": {"accepted": "accepted", "cancelled": "cancelled"},
    "accepted": {"shipped": "shipped"},
    "shipped": {"delivered": "delivered"},
}
TERMINAL = {"delivered", "cancelled"}
OUTPUT = "order_id string, entry string, kind string, state string, event string, message string, ts bigint"


def step(state: str | None, event: str) -> tuple[str | None, str]:
    """The next state and, for an illegal transition, the alert text (the state is then unchanged)."""
    allowed = TRANSITIONS.get(state, {})
    if event in allowed:
        return allowed[event], ""
    return state, f"illegal transition: {event} after {state or 'nothing'}"


def advance(order_id: str, saved: Any, rows: Iterable[Row]) -> tuple[list[Row], tuple[Any, int] | None]:
    """An order's new rows, in event-time order, applied to its saved (state, events): the rows to emit (an alert per
    illegal transition, then the order's latest state) and what to save (None: clear, the order is done)."""
    current, seen = (saved[0], saved[1]) if saved else (None, 0)
    out: list[Row] = []
    last: Row | None = None
    for row in sorted(rows, key=lambda r: (r["ts"], parse_id(r["_id"]))):
        seen += 1
        nxt, alert = step(current, row["event"])
        if alert:
            out.append(
                Row(
                    order_id=order_id,
                    entry=row["_id"],
                    kind="alert",
                    state=current or "",
                    event=row["event"],
                    message=alert,
                    ts=row["ts"],
                )
            )
        current, last = nxt, row
    last_ts, last_id = (last["ts"], last["_id"]) if last is not None else (0, "")
    out.append(
        Row(
            order_id=order_id,
            entry=last_id,
            kind="order",
            state=current or "",
            event="",
            message=f"{seen} events",
            ts=last_ts,
        )
    )
    return out, (None if current in TERMINAL else (current, seen))


class OrderStateMachine(StatefulProcessor):
    def init(self, handle: StatefulProcessorHandle) -> None:
        self.state = handle.getValueState("order", "state string, events bigint")

    def handleInputRows(self, key: Any, rows: Iterator[Row], timerValues: Any) -> Iterator[Row]:
        saved = self.state.get()  # None when there is none: one round trip to the state store, not two
        out, keep = advance(key[0], saved, rows)
        if keep is None:
            self.state.clear()
        else:
            self.state.update(keep)
        return iter(out)

    def close(self) -> None:
        pass


def transform(events: DataFrame) -> DataFrame:
    return events.groupBy("order_id").transformWithState(
        statefulProcessor=OrderStateMachine(), outputStructType=OUTPUT, outputMode="Append", timeMode="None"
    )


def results(rows: list[Row]) -> Iterable[Result]:
    for row in rows:
        if row["kind"] == "alert":
            yield (
                "alert",
                f"{row['order_id']}:{row['entry']}",
                {
                    "order_id": row["order_id"],
                    "state": row["state"],
                    "event": row["event"],
                    "message": row["message"],
                    "ts": row["ts"],
                },
            )
        else:
            yield "order", row["order_id"], {"state": row["state"], "events": row["message"], "ts": row["ts"]}


def generator(rng: random.Random) -> Callable[[int], str]:
    open_orders: dict[str, str | None] = {}
    counter = iter(range(1 << 62))

    def make(now_ms: int) -> str:
        if len(open_orders) < 20 or rng.random() < 0.3:
            order_id, event = f"o{next(counter)}", "created"
            open_orders[order_id] = "created"
        else:
            order_id = rng.choice(list(open_orders))
            state = open_orders[order_id]
            choices = list(TRANSITIONS.get(state, {}))
            if state == "accepted" and rng.random() < 0.1:
                choices = ["cancelled"]  # the illegal transition the alerts are for
            event = rng.choice(choices)
            nxt, _ = step(state, event)
            if nxt in TERMINAL:
                del open_orders[order_id]
            else:
                open_orders[order_id] = nxt
        return f'{{"order_id": "{order_id}", "event": "{event}", "ts": {now_ms}}}'

    return make


PIPELINE = Pipeline(
    name="order-state-machine",
    title="Order state machine",
    description="Order events → per-order state (ValueState); illegal transitions become alerts.",
    payload=PAYLOAD,
    transform=transform,
    output_mode="append",
    results=results,
    generator=generator,
    views=(
        ResultView(
            "alert",
            "Alerts",
            (("Order", "order_id"), ("State", "state"), ("Event", "event"), ("Alert", "message")),
            "ts",
        ),
        # one row per order: the newest 50,000 orders are shown, the rest of the history is the job's own business
        ResultView(
            "order", "Orders", (("Order", "key"), ("State", "state"), ("Events", "events")), "ts", keep_rows=50_000
        ),
    ),
    needs_rocksdb=True,
)
