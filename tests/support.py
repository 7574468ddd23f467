"""Helpers the test modules share: a producer of events, the team job's orders and its sinks' checks, actions run to
their end, a driver's processes. Fixtures stay in conftest.py."""

from __future__ import annotations

import base64
import json
import os
import random
import threading
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg

from dashboard import kafka
from dashboard.checkpoint_dir.files import (
    committed_batches,
)
from dashboard.engine.sinks import COMMITS
from dashboard.models import (
    ENDED_ACTIONS,
    Action,
    ActionStatus,
    Checkpoint,
    Job,
    ResultRow,
    Run,
    RunStatus,
)
from dashboard.services.actions import action_execute, action_request
from dashboard.services.enqueue import RUN_ACTION
from dashboard.services.runs import job_request_stop
from tests.conftest import send_events, wait_for

GOOD_LINE = '10.0.0.1 - - [22/Nov/2026:10:00:00 +0000] "GET {url} HTTP/1.1" 200 512 "-" "demo/1.0"'
POISON = [
    GOOD_LINE.format(url="/\xff\xfe").encode("latin-1"),  # invalid UTF-8
    GOOD_LINE.format(url="/surrogate").encode().replace(b"surrogate", b"\xed\xa0\x80"),  # a lone surrogate, encoded
    b'{"order_id":"\\ud800","event":"created","ts":1}',  # JSON with a lone surrogate escape
    b"{oops",  # not even JSON
    b'{"k":' + b"[" * 5000 + b"]" * 5000 + b"}",  # deep JSON
    GOOD_LINE.format(url="/" + "k" * 5000).encode(),  # a key the sink cannot store
    GOOD_LINE.format(url="/nul\x00x").encode(),  # a NUL
    GOOD_LINE.replace(" 200 ", " 99999999999999999999999 ").format(url="/big").encode(),  # a number out of range
    b"x" * (2 << 20),  # a payload over the limit
]


CUSTOMERS = [f"c-{n}" for n in range(6)]


def table(dsn: str, sql: str) -> list[tuple]:
    with psycopg.connect(dsn) as db:
        return db.execute(sql).fetchall()


def lake_rows(spark: Any, path: Path) -> list[dict[str, Any]]:
    return [r.asDict() for r in spark.read.parquet(str(path)).collect()]


def lake_latest(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each window's row of the highest batch, as the lake's reader takes it, keyed as the results table is."""
    latest: dict[str, dict[str, Any]] = {}
    for row in sorted(rows, key=lambda r: r["batch_id"]):
        start, end = (row[f].strftime("%Y-%m-%d %H:%M") for f in ("start", "end"))
        latest[f"{row['customer']}|{start}|{end}"] = {
            "customer": row["customer"], "start": start, "end": end, "orders": row["orders"],
            "items": row["items"], "total": str(row["total"]),
        }  # fmt: skip
    return latest


def team_rows(dsn: str) -> dict[str, dict[str, Any]]:
    found = {}
    for customer, start, end, orders, items, total in table(
        dsn, 'SELECT customer, "start", "end", orders, items, total FROM customer_spend'
    ):
        start, end = start.strftime("%Y-%m-%d %H:%M"), end.strftime("%Y-%m-%d %H:%M")
        found[f"{customer}|{start}|{end}"] = {"customer": customer, "start": start, "end": end, "orders": orders,
                                              "items": items, "total": str(total)}  # fmt: skip
    return found


class Producer(threading.Thread):
    """Writes url-counts events at a steady rate until stopped, with a poison entry every ``poison_every`` ticks;
    ``sent`` (good events) and ``poison`` (entry ids) are exact."""

    def __init__(self, redis, stream: str, rate: int = 150, poison_every: int = 0) -> None:
        super().__init__(daemon=True)
        self.redis, self.stream, self.rate, self.poison_every = redis, stream, rate, poison_every
        self.sent, self.halt, self.poison = 0, threading.Event(), []

    def run(self) -> None:
        seed = 0
        while not self.halt.wait(0.2):
            seed += 1
            self.sent += send_events(self.redis, self.stream, "url-counts", self.rate // 5, seed=seed)
            if self.poison_every and seed % self.poison_every == 0:
                payload = POISON[len(self.poison) % len(POISON)]
                self.poison.append(self.redis.xadd(self.stream, {"v": payload}).decode())


def sink_total(job) -> int:
    return sum(row.value["requests"] for row in ResultRow.objects.filter(job=job, kind="url"))


def running_with_progress(job, after_run: int = 0) -> Run | None:
    run = job.runs.filter(status=RunStatus.RUNNING, id__gt=after_run).first()
    if run and Checkpoint.objects.filter(run=run).exists():
        return run
    return None


def drain_and_stop(job, producer: Producer, redis) -> None:
    """Stop the producer, let the job read every entry written (poison included), and stop it."""
    producer.halt.set()
    producer.join()
    entries = redis.xlen(job.source_stream)
    wait_for(
        lambda: (c := job.checkpoints.order_by("-committed_at").first()) and c.end_offset["n"] >= entries,
        180,
        1,
        "the job to catch up",
    )
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, 0.5, "the stop")


def execute(job, kind: str, **params) -> Action:
    action = action_request(job=job, kind=kind, params=params)
    done = action_execute(action_id=action.id)
    assert done.status == ActionStatus.SUCCEEDED, done.outcome
    return done


VALID = {
    "name": "clicks",
    "pipeline": "url-counts",
    "source_stream": "events:clicks",
    "state_backend": "memory",
    "trigger_interval_seconds": "2",
    "state_partitions": "4",
    "parallelism": "2",
    "batches_retained": "100",
    "max_records_per_batch": "5000",
    "memory_budget_mb": "1024",
    "disk_budget_gb": "50",
    "autoscale_mode": "recommend",
    "autoscale_max_per_day": "2",
    "autoscale_window_minutes": "15",
}


class Orders:
    """Orders sent to a stream, kept so that every expected figure comes from them, not from the job."""

    def __init__(self, redis: Any, stream: str, kafka_servers: str = "") -> None:
        """``kafka_servers``: the orders go to the Kafka topic ``stream`` there, keyed by customer, not to Redis."""
        self.redis, self.stream = redis, stream
        self.sent: list[dict[str, Any]] = []
        self.poison: dict[str, str] = {}  # entry id -> the path its dead letter must name
        self.kafka = kafka.producer(kafka_servers) if kafka_servers else None

    def send(self, count: int, seed: int, customers: list[str] = CUSTOMERS) -> int:
        rng, now = random.Random(seed), time.time()
        pipe = self.redis.pipeline(transaction=False) if self.kafka is None else None
        for n in range(count):
            items = [
                # prices as JSON text and as JSON numbers: both are exact decimals to the job
                {"sku": f"S{rng.randrange(40)}", "qty": rng.randint(1, 5),
                 "price": f"{rng.randint(1, 20000) / 100:.2f}" if rng.random() < 0.7 else rng.randint(1, 300) / 4}
                for _ in range(rng.randint(1, 4))
            ]  # fmt: skip
            order = {
                "order_id": f"o-{seed}-{n}",
                "customer": {"id": rng.choice(customers), "region": rng.choice(["eu", "us", None])},
                "placed_at": datetime.fromtimestamp(now - rng.uniform(0, 20), UTC).isoformat(),
                "express": rng.random() < 0.3,
                "items": items,
            }
            self.sent.append(order)
            if pipe is not None:
                pipe.xadd(self.stream, {"v": json.dumps(order)})
            else:
                kafka.send_all(
                    self.kafka, self.stream, [(order["customer"]["id"].encode(), json.dumps(order).encode())]
                )
        if pipe is not None:
            pipe.execute()
        return count

    def send_poison(self) -> None:
        now = datetime.now(UTC).isoformat()
        good = {
            "order_id": "p",
            "customer": {"id": "c-0"},
            "placed_at": now,
            "items": [{"sku": "a", "qty": 1, "price": "1"}],
        }
        broken = [
            (dict(good, items=[good["items"][0], {"sku": "b", "qty": 2, "price": "abc"}]), "items[1].price"),
            (dict(good, customer={"region": "eu"}), "customer.id"),
            (dict(good, items=[{"sku": "a", "qty": 2**40, "price": "1"}]), "items[0].qty"),
            (dict(good, express="yes"), "express"),
            (dict(good, placed_at="2099-01-01T00:00:00Z"), "placed_at"),
            (dict(good, items=[{"sku": "a", "qty": 1, "price": "123456789012.5"}]), "items[0].price"),
            (dict(good, items=[{"sku": "\ud800", "qty": 1, "price": "1"}]), "items[0].sku"),
            (dict(good, items={"sku": "a"}), "items"),
        ]
        for order, path in broken:
            entry = self.redis.xadd(self.stream, {"v": json.dumps(order)})
            self.poison[entry.decode()] = path

    def expected(self, window_minutes: int = 60, threshold: float = 100.0) -> dict[str, dict[str, Any]]:
        """The results the job must hold: orders, items and total per customer and window, from what was sent."""
        width = window_minutes * 60
        found: dict[str, dict[str, Any]] = {}
        for order in self.sent:
            placed = datetime.fromisoformat(order["placed_at"]).timestamp()
            start = int(placed // width * width)
            shown = [datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M") for t in (start, start + width)]
            key = f"{order['customer']['id']}|{shown[0]}|{shown[1]}"
            row = found.setdefault(key, {"customer": order["customer"]["id"], "start": shown[0], "end": shown[1],
                                         "orders": 0, "items": 0, "total": Decimal(0)})  # fmt: skip
            row["orders"] += 1
            row["items"] += sum(i["qty"] for i in order["items"])
            row["total"] += sum(i["qty"] * Decimal(str(i["price"])) for i in order["items"])
        for row in found.values():
            row["big"] = float(row["total"]) >= threshold
            row["total"] = str(row["total"].quantize(Decimal("0.01")))
        return found


def sink(job: Job, fields: tuple[str, ...] = ("customer", "start", "end", "orders", "items", "total")) -> dict:
    return {r.key: {f: r.value[f] for f in fields} for r in ResultRow.objects.filter(job=job, kind="spend")}


def children_of(pid: int) -> list[tuple[int, bytes]]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append((int(entry), cmdline.read()))
        except (OSError, ValueError):
            continue
    return found


def send(redis, stream: str, count: int, seed: int, users: list[str] | None = None) -> int:
    rng = random.Random(seed)
    pipe = redis.pipeline(transaction=False)
    for _ in range(count):
        user = rng.choice(users) if users else f"u{rng.randrange(20)}"
        pipe.xadd(stream, {"v": json.dumps({"user": user, "region": "eu", "amount": rng.randrange(1, 100)})})
    pipe.execute()
    return count


def events_counted(job: Job) -> int:
    return sum(int(row.value["events"]) for row in ResultRow.objects.filter(job=job, kind="totals"))


def finished(action: Action, timeout: float = 400) -> Action:
    wait_for(
        lambda: Action.objects.filter(id=action.id, status__in=ENDED_ACTIONS).exists(),
        timeout, 0.5, f"{action.get_kind_display()} #{action.id} to finish",
    )  # fmt: skip
    action.refresh_from_db()
    return action


def switched_to(job: Job, pipeline: str) -> bool:
    return Job.objects.get(id=job.id).pipeline == pipeline


SPEND = ("customer", "start", "end", "orders", "items", "total")


def assert_every_sink_exact(spark: Any, job: Job, orders: Orders, dsn: str, lake: Path) -> None:
    """Each sink holds every order's effect once: the totals the orders give, no batch twice in the files, and no
    sink ahead of the checkpoint it belongs to."""
    want = {k: {f: v[f] for f in SPEND} for k, v in orders.expected().items()}
    assert sink(job) == want, "the results table"
    assert team_rows(dsn) == want, "the team's table"
    rows = lake_rows(spark, lake)
    assert lake_latest(rows) == want, "the Parquet files, each window's latest row"
    pairs = [(r["batch_id"], r["customer"], r["start"]) for r in rows]
    assert len(pairs) == len(set(pairs)), "no batch's row written twice into the files"
    job.refresh_from_db()
    last = committed_batches(job.checkpoint_location)[-1]
    commits = [b for (b,) in table(dsn, f"SELECT batch_id FROM {COMMITS} WHERE job = '{job.name}' ORDER BY 1")]
    assert commits and commits[-1] <= last and len(commits) == len(set(commits))
    assert max(r["batch_id"] for r in rows) <= last


def every_sink_exact(spark: Any, job: Job, orders: Orders, dsn: str, lake: Path) -> bool:
    """``assert_every_sink_exact`` as a condition to wait for (a sink read mid-write, or mid-rewind, is retried)."""
    try:
        assert_every_sink_exact(spark, job, orders, dsn, lake)
    except Exception:
        return False
    return True


def visits_sent(redis: Any, action_id: int) -> int:
    """How many visits of the action wait in the Celery broker's default queue (no worker consumes it here)."""
    found = 0
    for raw in redis.lrange("celery", 0, -1):
        message = json.loads(raw)
        args = json.loads(base64.b64decode(message["body"]))[0]
        found += message["headers"]["task"] == RUN_ACTION and args == [action_id]
    return found
