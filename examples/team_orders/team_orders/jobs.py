"""Spend per customer per event-time window, from nested JSON order events: the kind of job a PySpark team already
runs, brought to Statekeeper with light edits (its ``readStream`` is the console's checked source; everything else is
the team's own DataFrame code). Its output goes to three sinks: the console's results table, the team's own
``customer_spend`` table in its database (``orders_dsn``) and a Parquet directory (``lake_dir``).

An order event::

    {"order_id": "o-17", "customer": {"id": "c-3", "region": "eu"}, "placed_at": "2026-11-24T05:00:00Z",
     "express": false, "items": [{"sku": "A1", "qty": 2, "price": "9.99"}, ...]}

- ``customer-spend``: per customer and tumbling window of ``window_minutes`` on ``placed_at`` (watermark
  ``lateness_minutes``), the orders, items and total spent (exact decimals); a window whose total reaches
  ``threshold`` is marked big.
- ``customer-spend-v2``: the same state, and the average order value in the results (a code change the upgrade
  preview finds compatible).
- ``customer-spend-daily``: spend per customer per UTC day, kept by a transformWithState operator keyed by (customer,
  day). Its state cannot be read from ``customer-spend``'s (another operator, another key), so the upgrade preview
  refuses the plain upgrade; it declares a *migration* instead: the hourly (or any length) windows in the old state
  are summed into their days, and the job moves with its totals, not from zero. A window that crosses midnight
  cannot be split between two days and maps to nothing (the preview counts them).

Changing a parameter of a running job (a longer window, a lower threshold) is an upgrade: previewed on the job's
state, savepointed, rolled back by itself if the new run fails.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from datetime import timedelta
from decimal import Decimal
from typing import Any

from pyspark.sql import DataFrame, Row
from pyspark.sql import functions as F
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle
from statekeeper_sdk import (
    FileSink,
    Migration,
    OldState,
    Parameter,
    Params,
    PayloadFormat,
    Pipeline,
    Result,
    ResultsTable,
    ResultView,
    TableSink,
)

from team_orders.money import MONEY, item_count, order_value

ORDER_SCHEMA = """
    order_id string NOT NULL,
    customer struct<id: string NOT NULL, region: string> NOT NULL,
    placed_at timestamp NOT NULL,
    express boolean,
    items array<struct<sku: string NOT NULL, qty: int NOT NULL, price: decimal(10,2) NOT NULL>> NOT NULL
"""
PARAMETERS = (
    Parameter(
        "window_minutes", "int", 60, "length of each customer's spend window", minimum=1, maximum=1440, operational=True
    ),
    Parameter(
        "threshold", "float", 100.0, "a window whose total reaches this is marked big", minimum=0, operational=True
    ),
    Parameter(
        "lateness_minutes",
        "int",
        10,
        "how late an order may arrive for its window",
        minimum=0,
        maximum=1440,
        operational=True,
    ),
    # its password is a secret the console keeps: postgres://team:${secret:team-db-password}@host/team_orders
    Parameter("orders_dsn", "str", "", "the team's PostgreSQL database for customer_spend (empty: not written)"),
    Parameter("lake_dir", "str", "", "the directory of the Parquet copy of customer_spend (empty: not written)"),
)
SPEND_COLUMNS = ("customer", "start", "end", "orders", "items", "total", "big")
# The team's own table, in its own database: one row per customer and window, upserted, with the batch that last
# wrote it (which the sink rewinds by after a restore or a rollback).
TEAM_TABLE = TableSink(
    name="team-db",
    table="customer_spend",
    dsn="{orders_dsn}",
    columns=SPEND_COLUMNS,
    key=("customer", "start", "end"),
    create="""CREATE TABLE IF NOT EXISTS customer_spend (
        customer text NOT NULL, "start" timestamp NOT NULL, "end" timestamp NOT NULL, orders bigint NOT NULL,
        items bigint NOT NULL, total numeric(18, 2) NOT NULL, big boolean NOT NULL, batch_id bigint NOT NULL,
        PRIMARY KEY (customer, "start", "end"))""",
)
# Each batch's updated windows as Parquet, for the lake: a reader takes each window's row of the highest batch_id.
LAKE = FileSink(name="lake", path="{lake_dir}", format="parquet", columns=SPEND_COLUMNS)
SINKS = (ResultsTable(), TEAM_TABLE, LAKE)


def spend(events: DataFrame, params: Params) -> DataFrame:
    orders = events.select(
        F.col("customer.id").alias("customer"),
        F.col("placed_at"),
        order_value(F.col("items")).alias("value"),
        item_count(F.col("items")).alias("items"),
    )
    return (
        orders.withWatermark("placed_at", f"{params.lateness_minutes} minutes")
        .groupBy(F.window("placed_at", f"{params.window_minutes} minutes"), "customer")
        .agg(F.count(F.lit(1)).alias("orders"), F.sum("items").alias("items"), F.sum("value").alias("total"))
        .select(
            "customer",
            F.col("window.start").alias("start"),
            F.col("window.end").alias("end"),
            "orders",
            "items",
            F.col("total").cast(MONEY).alias("total"),
            (F.col("total") >= F.lit(params.threshold)).alias("big"),
        )
    )


def spend_v2(events: DataFrame, params: Params) -> DataFrame:
    return spend(events, params).withColumn("average", (F.col("total") / F.col("orders")).cast(MONEY))


def results(rows: list[Row]) -> Iterable[Result]:
    for row in rows:
        start, end = row["start"].strftime("%Y-%m-%d %H:%M"), row["end"].strftime("%Y-%m-%d %H:%M")
        value = {
            "customer": row["customer"], "start": start, "end": end, "orders": int(row["orders"]),
            "items": int(row["items"]), "total": str(row["total"]), "big": bool(row["big"]),
        }  # fmt: skip
        if "average" in row:
            value["average"] = str(row["average"])
        yield "spend", f"{row['customer']}|{start}|{end}", value


CUSTOMER_SPEND = Pipeline(
    name="customer-spend",
    title="Spend per customer per window",
    description="Nested JSON orders → orders, items and spend per customer per event-time window (parameters: "
    "window, threshold, lateness).",
    payload=PayloadFormat("json", schema=ORDER_SCHEMA, event_time="placed_at"),
    transform=spend,
    output_mode="update",
    results=results,
    views=(
        ResultView(
            "spend",
            "Spend per customer and window",
            (
                ("Customer", "customer"),
                ("From", "start"),
                ("To", "end"),
                ("Orders", "orders"),
                ("Items", "items"),
                ("Total", "total"),
                ("Big", "big"),
            ),
            "start",
        ),
    ),  # fmt: skip
    parameters=PARAMETERS,
    samples="samples.jsonl",
    sinks=SINKS,
)
CUSTOMER_SPEND_V2 = replace(
    CUSTOMER_SPEND,
    name="customer-spend-v2",
    version_of="customer-spend",
    title="Spend per customer per window, with the average order",
    description="customer-spend with the average order value in the results (the same state).",
    transform=spend_v2,
    views=(
        replace(
            CUSTOMER_SPEND.views[0],
            columns=(*CUSTOMER_SPEND.views[0].columns, ("Average", "average")),
        ),
    ),
)


# customer-spend-daily: the day's totals per customer in a transformWithState value, dropped by an event-time timer
# once the watermark passes the day's end (and the lateness allowed).
DAY_STATE = f"orders bigint, items bigint, total {MONEY}"
DAY_OUTPUT = f"customer string, start timestamp, end timestamp, orders bigint, items bigint, total {MONEY}, big boolean"
DAY = timedelta(days=1)


class DailySpend(StatefulProcessor):
    def __init__(self, threshold: float, lateness: timedelta) -> None:
        self.threshold, self.lateness = threshold, lateness

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.handle = handle
        self.spend = handle.getValueState("spend", DAY_STATE)

    def _expires(self, day: Any) -> None:
        """Forget the day once the watermark has passed its end and the lateness allowed."""
        self.handle.registerTimer(int((day + DAY + self.lateness).timestamp() * 1000))

    def handleInitialState(self, key: Any, initialState: Row, timerValues: Any) -> None:
        self.spend.update((initialState["orders"], initialState["items"], initialState["total"]))
        self._expires(key[1])

    def handleInputRows(self, key: Any, rows: Iterator[Row], timerValues: Any) -> Iterator[Row]:
        saved = self.spend.get() if self.spend.exists() else None
        orders, items, total = (saved[0], saved[1], saved[2]) if saved else (0, 0, Decimal("0.00"))
        for row in rows:
            orders, items, total = orders + 1, items + row["items"], total + row["value"]
        self.spend.update((orders, items, total))
        customer, day = key
        if saved is None:  # a day seen for the first time: its timer (registered once; Spark warns of a second)
            self._expires(day)
        yield Row(customer=customer, start=day, end=day + DAY, orders=orders, items=items, total=total,
                  big=float(total) >= self.threshold)  # fmt: skip

    def handleExpiredTimer(self, key: Any, timerValues: Any, expiredTimerInfo: Any) -> Iterator[Row]:
        self.spend.clear()
        return iter(())

    def close(self) -> None:
        pass


def daily(events: DataFrame, params: Params, initial_state: DataFrame | None = None) -> DataFrame:
    orders = events.select(
        F.col("customer.id").alias("customer"),
        F.col("placed_at"),
        F.date_trunc("day", "placed_at").alias("day"),
        order_value(F.col("items")).alias("value"),
        item_count(F.col("items")).alias("items"),
    ).withWatermark("placed_at", f"{params.lateness_minutes} minutes")
    return orders.groupBy("customer", "day").transformWithState(
        statefulProcessor=DailySpend(params.threshold, timedelta(minutes=params.lateness_minutes)),
        outputStructType=DAY_OUTPUT,
        outputMode="Update",
        timeMode="EventTime",
        initialState=initial_state.groupBy("customer", "day") if initial_state is not None else None,
    )


OLD_SPEND = "struct<orders: bigint, items: bigint, total: decimal(28,2), empty: boolean>"


def daily_from_windows(old: OldState, params: Params) -> DataFrame:
    """customer-spend's windows (its aggregation's state: the key's window and customer, the count and the two sums)
    summed into their UTC days. A window that ends on another day than it starts maps to nothing."""
    spend = old["default"].select(
        F.col("key.customer").alias("customer"),
        F.col("key.window.start").alias("start"),
        F.col("key.window.end").alias("end"),
        F.col("value").cast(OLD_SPEND).alias("v"),  # by position: Spark names both sums "sum"
    )
    last = F.col("end") - F.expr("INTERVAL 1 MICROSECOND")
    whole = spend.filter(~F.col("v.empty") & (F.date_trunc("day", "start") == F.date_trunc("day", last)))
    return whole.groupBy("customer", F.date_trunc("day", "start").alias("day")).agg(
        F.sum("v.orders").alias("orders"),
        F.sum("v.items").alias("items"),
        F.sum("v.total").cast(MONEY).alias("total"),
    )


CUSTOMER_SPEND_DAILY = replace(
    CUSTOMER_SPEND,
    name="customer-spend-daily",
    version_of="customer-spend",
    title="Spend per customer per day",
    description="Nested JSON orders → orders, items and spend per customer per UTC day (a transformWithState "
    "operator); moved to from customer-spend with a state migration.",
    transform=daily,
    needs_rocksdb=True,
    migrations=(
        Migration(
            "customer-spend",
            ("customer", "day"),
            daily_from_windows,
            "each window's orders, items and total summed into its UTC day; a window across midnight maps to nothing",
        ),
    ),
)
