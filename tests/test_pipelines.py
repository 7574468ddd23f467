"""Each pipeline in the catalog, run as a real job: what it promises about its results."""

from __future__ import annotations

import json
import random
import time
import zlib
from collections import Counter, defaultdict

import pytest
from pyspark.sql import Row
from pyspark.sql.streaming.tws_tester import TwsTester

from dashboard.models import Checkpoint, ResultRow
from tests.conftest import run_through
from workers.spark.pipelines import order_state_buckets, order_state_machine
from workers.spark.pipelines.order_state_machine import step

pytestmark = [pytest.mark.spark, pytest.mark.django_db(transaction=True)]


def run_to_completion(job, start_driver, redis, sent: int) -> None:
    run_through(start_driver(job), redis, sent)


def xadd_all(redis, stream: str, payloads: list[str]) -> int:
    pipe = redis.pipeline(transaction=False)
    for payload in payloads:
        pipe.xadd(stream, {"v": payload})
    pipe.execute()
    return len(payloads)


def test_dedup_keeps_each_id_exactly_once(make_job, start_driver, redis, stream_name):
    now = int(time.time() * 1000)
    ids = [f"e{i}" for i in range(150)]
    payloads = [json.dumps({"event_id": i, "ts": now, "user": "u"}) for i in ids]
    payloads += [json.dumps({"event_id": i, "ts": now + 5, "user": "u"}) for i in ids[::3]]  # upstream retries
    job = make_job(pipeline="dedup", max_records_per_batch=60)
    run_to_completion(job, start_driver, redis, xadd_all(redis, stream_name, payloads))
    assert sorted(ResultRow.objects.filter(job=job).values_list("key", flat=True)) == sorted(ids)


def test_count_window_average_emits_the_mean_of_every_two_values(make_job, start_driver, redis, stream_name):
    values = {"a": [1, 3, 5, 7, 9], "b": [10, 20], "c": [4]}
    payloads = [
        json.dumps({"key": k, "value": v}) for i in range(5) for k, vs in values.items() if i < len(vs) for v in [vs[i]]
    ]
    job = make_job(pipeline="count-window-average", state_backend="rocksdb", max_records_per_batch=3)
    run_to_completion(job, start_driver, redis, xadd_all(redis, stream_name, payloads))
    averages = defaultdict(list)
    for row in ResultRow.objects.filter(job=job, kind="average").order_by("key"):
        averages[row.value["key"]].append(row.value["average"])
    assert {k: sorted(v) for k, v in averages.items()} == {"a": [2.0, 6.0], "b": [15.0]}
    latest = Checkpoint.objects.filter(job=job).order_by("-batch_id").first()
    assert latest.state_rows_total == 2, "state holds only the unpaired 9 of a and 4 of c"


def test_minute_windows_count_every_request_once(make_job, start_driver, redis, stream_name):
    minute = 60_000
    base = (int(time.time() * 1000) // minute) * minute - 3 * minute
    lines, expected = [], Counter()
    for i in range(240):
        ts = base + (i // 60) * minute + 1000 + i  # in time order: nothing arrives behind the watermark
        url = ["/a", "/b", "/c"][i % 3]
        stamp = time.strftime("%d/%b/%Y:%H:%M:%S +0000", time.gmtime(ts / 1000))
        lines.append(f'1.2.3.4 - - [{stamp}] "GET {url} HTTP/1.1" 200 10 "-" "t"')
        expected[(time.strftime("%Y-%m-%d %H:%M", time.gmtime(ts / 1000)), url)] += 1
    job = make_job(pipeline="minute-windows", max_records_per_batch=100)
    run_to_completion(job, start_driver, redis, xadd_all(redis, stream_name, lines))
    got = {(r.value["minute"], r.value["url"]): r.value["requests"] for r in ResultRow.objects.filter(job=job)}
    assert got == dict(expected)


def test_the_order_state_machine_rules():
    assert step(None, "created") == ("created", "")
    assert step("accepted", "cancelled") == ("accepted", "illegal transition: cancelled after accepted")
    assert step("shipped", "delivered") == ("delivered", "")
    assert step(None, "paid")[1] == "illegal transition: paid after nothing"


def _order_events(count: int, seed: int) -> list[Row]:
    make = order_state_machine.generator(random.Random(seed))
    events = [json.loads(make(1_700_000_000_000 + i // 3)) for i in range(count)]  # ties in ts: the entry id orders
    return [Row(order_id=e["order_id"], event=e["event"], ts=e["ts"], _id=f"{1_700_000_000_000 + i}-0")
            for i, e in enumerate(events)]  # fmt: skip


@pytest.mark.parametrize("scan_factor", [order_state_buckets.SCAN_FACTOR, 0], ids=["bucket-scan", "per-order-reads"])
def test_the_bucketed_order_state_machine_emits_what_the_per_order_one_does(monkeypatch, scan_factor):
    """Batch by batch, both ways of reading a bucket's saved orders, with PySpark's own in-memory state (no JVM): the
    same alerts and order rows as one key per order, and the bucket's map holds exactly the open orders."""
    monkeypatch.setattr(order_state_buckets, "SCAN_FACTOR", scan_factor)
    per_order = TwsTester(order_state_machine.OrderStateMachine())
    bucketed = TwsTester(order_state_buckets.OrderBuckets())
    events = _order_events(3000, seed=11)
    spans = {}
    for i, e in enumerate(events):
        spans.setdefault(e["order_id"], [i, i])[1] = i
    reopened = next(o for o, (first, last) in spans.items() if first < 500 < last)  # open at the 500th event
    events.insert(500, Row(order_id=reopened, event="created", ts=events[499]["ts"], _id=events[499]["_id"] + "1"))
    alerts = []
    bucket_of = {}
    for start in range(0, len(events), 400):  # a micro-batch: each key once, its rows together
        batch = events[start : start + 400]
        expected, got = [], []
        for order_id in dict.fromkeys(e["order_id"] for e in batch):
            expected += per_order.test(order_id, [e for e in batch if e["order_id"] == order_id])
        for e in batch:
            bucket_of.setdefault(e["order_id"], zlib.crc32(e["order_id"].encode()) % 5)  # few buckets: many orders each
        for b in sorted({bucket_of[e["order_id"]] for e in batch}):
            got += bucketed.test(b, [e for e in batch if bucket_of[e["order_id"]] == b])
        assert sorted(got) == sorted(expected)
        alerts += [r for r in got if r["kind"] == "alert"]
    assert any(
        r["order_id"] == reopened and r["message"].startswith("illegal transition: created after") for r in alerts
    )
    assert any(r["message"] == "illegal transition: cancelled after accepted" for r in alerts)
    open_orders = {o for o in bucket_of if per_order.peekValueState("order", o) is not None}
    held = {k[0] for b in range(5) for k in bucketed.peekMapState("orders", b)}
    assert held == open_orders and len(open_orders) > 0
    for b in range(5):
        size = len(bucketed.peekMapState("orders", b))
        assert bucketed.peekValueState("open", b) == ((size,) if size else None), "the bucket's size, kept exactly"
