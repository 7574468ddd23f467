"""The checks in the JVM (workers/spark/sources/jvm_checks.py) take and refuse what the Python checks do: a hostile
producer's corpus through both, record by record, with the differences the JVM's strict JSON makes named here."""

from __future__ import annotations

import json
import random

import pytest
from statekeeper_sdk import Field, Limits, PayloadFormat
from statekeeper_sdk._runtime.events import parse_entries

from tests.test_poison_events import GOOD, NOW, ORDERS, POISON
from workers.spark.pipelines.access_log import ACCESS_LOG
from workers.spark.pipelines.url_counts import access_log_line
from workers.spark.sources.jvm_checks import SESSION_CONF, checks_for, java_pattern

pytestmark = pytest.mark.spark

HOSTILE_JSON = {
    **{name: payload for name, (payload, _, _) in POISON.items()},
    "good": GOOD,
    "a number for a string": b'{"order_id":5,"event":"created","ts":1}',
    "an integer as text": b'{"order_id":"a","event":"created","ts":"1"}',
    "a fraction for an integer": b'{"order_id":"a","event":"created","ts":1.5}',
    "10.0 for an integer": b'{"order_id":"a","event":"created","ts":10.0}',
    "1e3 for an integer": b'{"order_id":"a","event":"created","ts":1e3}',
    "true for an integer": b'{"order_id":"a","event":"created","ts":true}',
    "text after the object": b'{"order_id":"a","event":"created","ts":1} x',
    "two objects": b'{"order_id":"a","event":"created","ts":1}\n{"order_id":"b","event":"created","ts":1}',
    "the end marker guessed": b'{"order_id":"a","event":"created","ts":1},"statekeeper-end-0"] [',
    "an array": b"[1]",
    "null": b"null",
    "empty": b"",
    "spaces": b"   ",
    "a field missing": b'{"event":"created","ts":1}',
    "a field null": b'{"order_id":null,"event":"created","ts":1}',
    "a key twice": b'{"order_id":"a","event":"created","ts":1,"order_id":"b"}',
    "an optional number as an integer": b'{"order_id":"a","event":"created","ts":1,"amount":3}',
    "an optional number as text": b'{"order_id":"a","event":"created","ts":1,"amount":"3"}',
    "an optional number too large": b'{"order_id":"a","event":"created","ts":1,"amount":1e400}',
    "an emoji": '{"order_id":"\U0001f600","event":"created","ts":1}'.encode(),
    "a surrogate pair": b'{"order_id":"\\ud83d\\ude00","event":"created","ts":1}',
    "a negative time": b'{"order_id":"a","event":"created","ts":-5}',
    "NaN in a field nobody reads": b'{"order_id":"a","event":"created","ts":1,"x":NaN}',
}
# Where the JVM's strict JSON (RFC 8259) parts from Python's: NaN and Infinity are not JSON to it, anywhere
ONLY_THE_JVM_REFUSES = {"NaN in a field nobody reads"}
OTHER_STAGE = {"NaN": ("parse", "not valid JSON"), "Infinity": ("parse", "not valid JSON")}
# Python's reader names more than the JVM's can: these say less, and nothing else
SAYS_LESS = {"lone surrogate": "not valid JSON", "deep JSON": "not valid JSON"}


def both(spark, payload: PayloadFormat, corpus: dict[str, bytes]) -> dict[str, tuple[object, object]]:
    """Each record's outcome through the Python checks and through the JVM's: its row, or (stage, reason)."""
    names = list(corpus)
    ids = [f"{NOW}-{i}" for i in range(len(names))]
    batch, dead = parse_entries(
        [(i.encode(), [b"v", corpus[n]]) for i, n in zip(ids, names, strict=True)], payload, Limits()
    )
    python = {d.entry: (d.stage, d.reason) for d in dead} | {r["_id"]: r for r in batch.to_pylist()}
    for key, value in SESSION_CONF.items():
        spark.conf.set(key, value)
    checks = checks_for(payload, Limits())
    assert checks is not None
    raw = spark.createDataFrame([(i, corpus[n], NOW) for i, n in zip(ids, names, strict=True)],
                                "_id string, value binary, arrival_ms long")  # fmt: skip
    jvm = {r["_id"]: r.asDict() for r in checks.events(raw).collect()}
    jvm |= {r["_id"]: (r["stage"], r["reason"]) for r in checks.rejected(raw).collect()}
    return {n: (python[i], jvm[i]) for n, i in zip(names, ids, strict=True)}


def test_a_hostile_producers_json_is_taken_and_refused_as_the_python_checks_do(spark):
    for name, (python, jvm) in both(spark, ORDERS, HOSTILE_JSON).items():
        if name in ONLY_THE_JVM_REFUSES:
            assert isinstance(python, dict) and jvm == ("parse", "not valid JSON"), (name, jvm)
        elif isinstance(python, dict):
            assert jvm == python, f"{name}: taken by both, with the same values"
        elif name in OTHER_STAGE:
            assert jvm == OTHER_STAGE[name], (name, jvm)
        elif name in SAYS_LESS:
            assert jvm == (python[0], SAYS_LESS[name]), (name, python, jvm)
        else:
            stage, reason = python
            assert jvm[0] == stage and reason.startswith(jvm[1]), f"{name}: {python} in Python, {jvm} in the JVM"


def test_a_hostile_producers_access_log_lines_are_taken_and_refused_as_the_python_checks_do(spark):
    rng = random.Random(3)
    corpus = {f"line {i}": access_log_line(rng, NOW).encode() for i in range(20)} | {
        "garbage": b"garbage",
        "empty": b"",
        "not UTF-8": b'1.2.3.4 - - [x] "GET /\xff HTTP/1.1" 200 5',
        "a four-digit status": b'1.2.3.4 - - [x] "GET /a HTTP/1.1" 2000 5',
        "no size": b'1.2.3.4 - - [x] "GET /a HTTP/1.1" 200 -',
        "accents": 'é1 - - [x] "GET /\u00e9 HTTP/1.1" 200 12'.encode(),
        "a line before": b'prefix\n1.2.3.4 - - [x] "GET /a HTTP/1.1" 200 5',
        "a NUL in the URL": b'1.2.3.4 - - [x] "GET /a\x00b HTTP/1.1" 200 5',
        "a long URL": b'1.2.3.4 - - [x] "GET /' + b"u" * 500 + b' HTTP/1.1" 200 5',
    }
    outcomes = both(spark, ACCESS_LOG, corpus)
    for name, (python, jvm) in outcomes.items():
        if isinstance(python, dict):
            assert jvm == python, name
        else:
            assert jvm[0] == python[0] and python[1].startswith(jvm[1]), (name, python, jvm)
    assert sum(isinstance(p, dict) for p, _ in outcomes.values()) == 22, "the twenty lines, the '-' size and accents"


def test_what_java_may_read_otherwise_stays_with_the_python_checks():
    assert java_pattern(r"^(?P<url>\S+) (?P<n>\d+)$") == r"^(\S+) (\d+)$"
    assert java_pattern(r"\(?P<x>y") == r"\(?P<x>y", "an escaped parenthesis is no group"
    for pattern in (r"^(?P<w>[[:alpha:]]+)$", r"(?U)(?P<w>a+)", r"(?P<w>a)(?P=w)"):
        assert java_pattern(pattern) is None, pattern
    nested = PayloadFormat("json", schema="order_id string NOT NULL, items array<struct<sku: string>>")
    assert checks_for(nested, Limits()) is None, "a nested schema is checked in Python"
    assert checks_for(PayloadFormat("json", (Field("it's", "string"),)), Limits()) is None
    assert checks_for(ORDERS, Limits()) is not None and checks_for(ACCESS_LOG, Limits()) is not None
    assert json.loads(ORDERS.to_option())["kind"] == "json"
