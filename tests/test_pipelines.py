"""Each pipeline in the catalog, run as a real job: what it promises about its results."""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict

import pytest

from dashboard.models import Checkpoint, ResultRow
from tests.conftest import run_through
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
