"""Timers and TTL in a transformWithState job (the example package's user-sessions-timed): the inspector lists the
registered timers with their firing times and which state variables expire, and the upgrade preview compares both."""

from __future__ import annotations

import copy
import time

import pytest
from statekeeper_sdk._runtime.compatibility import COMPATIBLE, INCOMPATIBLE, compare, operator_schemas

from dashboard import pipelines
from dashboard.checkpoint_dir.files import committed_batches, copy_checkpoint
from tests.conftest import run_through, send_events
from workers.spark.state_tool import inspect


@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("spark_settings_kept")
def test_the_inspector_lists_timers_and_ttl_and_the_preview_compares_them(
    spark, make_job, start_driver, redis, stream_name, tmp_path
):
    job = make_job(pipeline="user-sessions-timed", state_backend="rocksdb", parallelism=1,
                   parameters={"gap_seconds": 600})  # fmt: skip
    sent = send_events(redis, stream_name, "user-sessions-timed", 200, seed=3)
    started = time.time() * 1000
    run_through(start_driver(job), redis, sent)
    batch = committed_batches(job.checkpoint_location)[-1]
    scratch = tmp_path / "copy"
    copy_checkpoint(job.checkpoint_location, scratch, batch)

    operator = inspect(spark, str(scratch), batch, {"mode": "variables"})["operators"][0]
    assert operator["time_mode"] == "ProcessingTime"
    assert {v["name"]: v["ttl"] for v in operator["details"]} == {"open": False, "closed": True}
    assert sorted(operator["variables"]) == ["closed", "open"], "Spark's own timer index is not a variable"
    users = 20  # the demo generator's users, each with a session open and its timer registered
    assert operator["timers"]["count"] == users
    assert started + 590_000 <= operator["timers"]["next_ms"] <= time.time() * 1000 + 600_000, "gap_seconds=600"

    timers = inspect(spark, str(scratch), batch, {"mode": "timers", "limit": 5})
    assert timers["total"] == users and len(timers["rows"]) == 5
    fires = [row["fires_ms"] for row in timers["rows"]]
    assert fires == sorted(fires) and all('"user"' in row["key"] and "UTC" in row["value"] for row in timers["rows"])

    schemas = operator_schemas(spark, str(scratch), batch)
    closed = schemas[0]["variables"]["closed"]
    assert closed["ttl"] and [f["name"] for f in closed["value"]["fields"]] == ["sessions", "events", "amount"]
    assert schemas[0]["timers"] and schemas[0]["time_mode"] == "ProcessingTime"

    timed = pipelines.get("user-sessions-timed")
    same = compare({"before": schemas, "after": schemas}, timed, timed)
    assert all(v.verdict == COMPATIBLE for v in same)
    assert any(v.variable == "timers" and "registered ones are kept" in v.reason for v in same)
    assert any(v.variable == "closed" and "TTL" in v.reason for v in same)

    without_ttl = copy.deepcopy(schemas)
    without_ttl[0]["variables"]["closed"]["ttl"] = False
    verdicts = compare({"before": schemas, "after": without_ttl}, timed, timed)
    assert [(v.variable, v.verdict) for v in verdicts if v.verdict == INCOMPATIBLE] == [("closed", INCOMPATIBLE)]
    assert "its TTL removed" in next(v.reason for v in verdicts if v.variable == "closed")

    untimed = copy.deepcopy(schemas)
    untimed[0].update(time_mode="None", timers=False)
    verdicts = compare({"before": schemas, "after": untimed}, timed, timed)
    assert any(v.variable == "timers" and v.verdict == INCOMPATIBLE and "ProcessingTime → None" in v.reason
               for v in verdicts)  # fmt: skip
