"""No input stops a job: what a broken or hostile producer sends goes to the dead letter with its entry id, the stage
and the reason, and the batch goes on with the rest."""

from __future__ import annotations

import json
import time

import pytest
from statekeeper_sdk import Field, Limits, PayloadFormat
from statekeeper_sdk._runtime.events import MAX_FUTURE_SECONDS, parse_entries

from dashboard.models import ResultRow
from tests.conftest import run_through
from workers.sink import write_results

ORDERS = PayloadFormat(
    "json",
    (Field("order_id", "string"), Field("event", "string"), Field("ts", "long"), Field("amount", "double", False)),
    event_time="ts",
)
NOW = int(time.time() * 1000)
GOOD = json.dumps({"order_id": "o1", "event": "created", "ts": NOW}).encode()

# (payload, stage, the reason's start): one of every class a broken producer sends
POISON = {
    "invalid UTF-8": (b'{"order_id":"\xff\xfe","event":"created","ts":1}', "decode", "not valid UTF-8"),
    "lone surrogate": (b'{"order_id":"\\ud800","event":"created","ts":1}', "parse", "field 'order_id' holds a lone"),
    "not JSON": (b"{oops", "parse", "not valid JSON"),
    "deep JSON": (b'{"order_id":' + b"[" * 5000 + b"]" * 5000 + b"}", "parse", "JSON nested too deeply"),
    "integer out of range": (
        b'{"order_id":"o2","event":"created","ts":100000000000000000000000}',
        "parse",
        "field 'ts' is out of range for a 64-bit integer",
    ),
    "NaN": (b'{"order_id":"o3","event":"created","ts":1,"amount":NaN}', "validate", "field 'amount' is not a finite"),
    "Infinity": (b'{"order_id":"o3","event":"created","ts":1,"amount":-Infinity}', "validate", "field 'amount' is not"),
    "huge key": (
        json.dumps({"order_id": "k" * 5000, "event": "created", "ts": 1}).encode(),
        "validate",
        "field 'order_id' is 5,000 characters (limit 400)",
    ),
    "NUL": (b'{"order_id":"o\\u0000x","event":"created","ts":1}', "validate", "field 'order_id' holds a NUL"),
    "far future": (
        json.dumps({"order_id": "o5", "event": "created", "ts": NOW + 86_400_000}).encode(),
        "validate",
        "event time",
    ),
    "huge payload": (b'{"pad":"' + b"x" * (1 << 21) + b'"}', "decode", "payload is 2,097,162 bytes"),
}


@pytest.mark.parametrize("name", POISON)
def test_each_poison_class_is_rejected_with_its_stage_and_reason_and_the_rest_goes_on(name):
    payload, stage, reason = POISON[name]
    entries = [
        (f"{NOW}-0".encode(), [b"v", GOOD]),
        (f"{NOW}-1".encode(), [b"v", payload]),
        (f"{NOW}-2".encode(), [b"v", GOOD]),
    ]
    batch, dead = parse_entries(entries, ORDERS)
    assert batch.num_rows == 2, "the good entries around it are kept"
    assert [(d.entry, d.stage) for d in dead] == [(f"{NOW}-1", stage)]
    assert dead[0].reason.startswith(reason), dead[0].reason
    assert dead[0].payload == payload, "the payload is kept as sent, for a re-drive"


def test_a_future_event_time_is_judged_against_the_entrys_arrival_so_a_replay_judges_the_same():
    ahead = json.dumps({"order_id": "o", "event": "created", "ts": 10_000_000}).encode()
    arrived_long_ago = [(b"1000-0", [b"v", ahead])]
    assert (
        parse_entries(arrived_long_ago, ORDERS, Limits(max_future_seconds=MAX_FUTURE_SECONDS))[1][0].stage == "validate"
    )
    assert parse_entries(arrived_long_ago, ORDERS, Limits(max_future_seconds=0))[0].num_rows == 1, "0: no limit"
    just_in_time = [(b"9900000-0", [b"v", ahead])]
    assert parse_entries(just_in_time, ORDERS, Limits(max_future_seconds=MAX_FUTURE_SECONDS))[0].num_rows == 1


def test_a_regex_source_rejects_undecodable_lines_and_numbers_out_of_range():
    fmt = PayloadFormat(
        "regex", (Field("url", "string"), Field("status", "long")), r"^GET (?P<url>\S+) (?P<status>\d+)$"
    )
    entries = [(b"1-0", [b"v", b"GET /a 200"]), (b"2-0", [b"v", b"GET /\xff 200"]), (b"3-0", [b"v", b"GET /b 9" * 3])]
    batch, dead = parse_entries(entries, fmt)
    assert batch.num_rows == 1
    assert [(d.entry, d.stage) for d in dead] == [("2-0", "decode"), ("3-0", "parse")]


@pytest.mark.django_db
def test_the_sink_stores_what_it_can_and_rejects_what_postgresql_would_refuse(make_job):
    job = make_job()
    rejected: list = []
    results = [
        ("url", "/fine", {"requests": 1}),
        ("url", "k" * 501, {"requests": 1}),
        ("url", "/nan", {"requests": float("nan")}),
        ("url", "/nul\x00", {"requests": 1}),
        ("url", "/surrogate", {"note": "\ud800"}),
        ("url", "/also-fine", {"requests": 2}),
    ]
    written = write_results(job_id=job.id, token=0, batch_id=3, results=results, rejected=rejected)
    assert written == 2
    assert sorted(ResultRow.objects.filter(job=job).values_list("key", flat=True)) == ["/also-fine", "/fine"]
    reasons = [r.reason for r in rejected]
    assert reasons[0] == "the key is 501 characters (limit 500)"
    assert "not JSON" in reasons[1] and "NUL" in reasons[2] and "lone surrogate" in reasons[3]
    assert all(r.stage == "sink" and r.entry.startswith("batch-3:url:") for r in rejected)


@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_job_fed_every_poison_class_counts_exactly_the_good_events(make_job, start_driver, redis, stream_name):
    job = make_job(pipeline="dedup", max_records_per_batch=300)
    now = int(time.time() * 1000)
    poison = [
        b'{"event_id":"\xff\xfe","ts":1}',
        b'{"event_id":"\\ud800","ts":1}',
        b"{oops",
        b'{"event_id":' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"event_id":"big","ts":100000000000000000000000}',
        b'{"event_id":"nan","ts":NaN}',
        json.dumps({"event_id": "k" * 5000, "ts": now}).encode(),
        b'{"event_id":"n\\u0000l","ts":1}',
        json.dumps({"event_id": "future", "ts": now + 86_400_000}).encode(),
        b'{"event_id":"' + b"x" * (1 << 21) + b'"}',
    ]
    good_ids = set()
    for i in range(400):
        event_id = f"e{i % 300}"  # some repeated upstream
        good_ids.add(event_id)
        redis.xadd(stream_name, {"v": json.dumps({"event_id": event_id, "ts": int(time.time() * 1000)})})
        if i % 100 == 50:
            for payload in poison:
                redis.xadd(stream_name, {"v": payload})
    sent = redis.xlen(stream_name)
    driver = start_driver(job)
    run_through(driver, redis, sent)
    assert driver.status == "stopped", "the job ran to the end and stopped on request: nothing stopped it"

    stored = set(ResultRow.objects.filter(job=job, kind="event").values_list("key", flat=True))
    assert stored == good_ids, "every good event once; the far-future ones moved no watermark"
    dead = redis.xrange(job.dead_letter_stream)
    poison_sent = sent - 400
    assert len(dead) == poison_sent, "every poison entry once, however often its batch was read"
    stages = {entry[b"stage"].decode() for _, entry in dead}
    assert stages == {"decode", "parse", "validate"}
