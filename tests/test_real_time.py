"""Spark's real-time mode: a pipeline declared for it, its check in the team's kit, a job of it on the real broker."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from pyspark.sql import functions as F
from statekeeper_sdk import KafkaSink, Pipeline
from statekeeper_sdk.testing import check_real_time

from dashboard import kafka
from dashboard.engine.samples import sample_events
from dashboard.forms import JobForm
from dashboard.models import ActionKind, RunStatus
from dashboard.pipelines import get as get_pipeline
from dashboard.services.actions import action_request
from dashboard.services.runs import job_request_start, job_request_stop
from tests.conftest import wait_for
from tests.support import execute, finished, running_with_progress
from tests.test_kafka_jobs import BAD, Sent, kafka_job, read_to_end, topic_records, truth_by_url
from workers.spark.pipelines.url_counts import LIVE


def test_the_kit_says_spark_runs_a_keyed_count_in_real_time_and_refuses_a_python_udf_in_sparks_words(spark):
    assert check_real_time(LIVE, spark=spark) is None
    upper = F.udf(lambda text: text.upper(), "string")
    with_udf = dataclasses.replace(
        LIVE, transform=lambda events, params: events.select(upper("url").alias("url")).groupBy("url").count()
    )
    reason = check_real_time(with_udf, spark=spark)
    assert reason is not None
    assert "STREAMING_REAL_TIME_MODE.OPERATOR_OR_SINK_NOT_IN_ALLOWLIST" in reason
    assert "ArrowEvalPythonExec" in reason and "=== Streaming Query ===" not in reason


def test_a_pipeline_declared_real_time_takes_update_mode_and_one_kafka_sink():
    with pytest.raises(ValueError, match="takes output_mode 'update'"):
        dataclasses.replace(LIVE, output_mode="append")
    with pytest.raises(ValueError, match="one sink, a KafkaSink"):
        dataclasses.replace(LIVE, sinks=())
    with pytest.raises(ValueError, match="one sink, a KafkaSink"):
        dataclasses.replace(LIVE, sinks=(*LIVE.sinks, KafkaSink("again", servers="{kafka}", topic="again")))
    assert isinstance(dataclasses.replace(LIVE, real_time=False, sinks=()), Pipeline)  # micro-batch: as before


def real_time_form(**fields: Any) -> JobForm:
    data = {
        "name": f"live-{uuid.uuid4().hex[:6]}", "pipeline": "url-counts-live", "source_kind": "kafka",
        "source_stream": "access-log", "source_path": settings.KAFKA_BOOTSTRAP, "state_backend": "rocksdb",
        "trigger_interval_seconds": 5, "state_partitions": 2, "parallelism": 1, "batches_retained": 100,
        "max_records_per_batch": 1000, "memory_budget_mb": 1024, "disk_budget_gb": 5, "autoscale_mode": "off",
        "autoscale_max_per_day": 2, "autoscale_window_minutes": 15, "driver": "own", "real_time": "on",
    }  # fmt: skip
    return JobForm(data={**data, **fields})


@pytest.mark.django_db
def test_the_form_takes_a_real_time_job_only_as_spark_can_run_it():
    assert real_time_form().is_valid(), real_time_form().errors
    not_declared = real_time_form(pipeline="url-counts")
    assert not not_declared.is_valid()
    assert "not declared for real-time mode" in str(not_declared.errors["real_time"])
    on_redis = real_time_form(source_kind="redis-stream", source_stream="events:x")
    assert not on_redis.is_valid() and "reads Kafka" in str(on_redis.errors["real_time"])
    shared = real_time_form(driver="shared")
    assert not shared.is_valid() and "a driver of its own" in str(shared.errors["driver"])
    too_often = real_time_form(trigger_interval_seconds=2)
    assert not too_often.is_valid() and "5 s at least" in str(too_often.errors["trigger_interval_seconds"])
    in_memory = real_time_form(state_backend="memory")
    assert not in_memory.is_valid() and "RocksDB" in str(in_memory.errors["state_backend"])


@pytest.fixture
def source_topic() -> Iterator[str]:
    name = f"live-{uuid.uuid4().hex[:8]}"
    kafka.ensure_topic(settings.KAFKA_BOOTSTRAP, name, 3)
    yield name
    kafka.delete_topic(settings.KAFKA_BOOTSTRAP, name)


def latest_counts(topic: str) -> dict[str, int]:
    """What a consumer keeping the latest value per key holds: the newest count per URL in the topic."""
    latest: dict[str, int] = {}
    for message in topic_records(topic):
        value = json.loads(message.value())
        assert message.key().decode() == value["url"]
        assert dict(message.headers() or [])["statekeeper-job"] == message_job[topic].encode()
        latest[value["url"]] = value["requests"]
    return latest


message_job: dict[str, str] = {}  # the job each output topic's records name


@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_real_time_job_on_kafka_holds_every_count_per_key_through_kill_minus_nine(
    make_job, source_topic, celery_worker, redis, monkeypatch, settings
):
    """A keyed count in real-time mode, its driver killed while records flow: after each restart (from its
    last checkpoint) the newest count per URL in the output topic is the truth, checkpoints are recorded, and each
    bad record is in the dead letters once with its place. Then a savepoint and a restore to it, every count the truth
    again; and the preview of an upgrade to a version real-time mode cannot run refuses it with Spark's reason."""
    monkeypatch.setenv("STATEKEEPER_PIPELINES", "tests.user_pipelines:URLS_LIVE_WITH_UDF")
    settings.PIPELINES = [*settings.BUILTIN_PIPELINES, "tests.user_pipelines:URLS_LIVE_WITH_UDF"]
    celery_worker.kill()
    celery_worker.start()  # with the test's pipeline registered
    topic, out = source_topic, f"{source_topic}-counts"
    kafka.ensure_topic(settings.KAFKA_BOOTSTRAP, out, 2)
    job = kafka_job(make_job, topic, pipeline="url-counts-live", parallelism=1, trigger_interval_seconds=5,
                    state_backend="rocksdb", driver="own", real_time=True, restart_strategy="fixed-delay",
                    restart_delay_seconds=1, parameters={"kafka": settings.KAFKA_BOOTSTRAP, "counts_topic": out})  # fmt: skip
    message_job[out] = job.name
    lines: list[str] = []
    make, producing = (
        sample_events(get_pipeline("url-counts"), random.Random(7)),
        kafka.producer(settings.KAFKA_BOOTSTRAP),
    )

    def send(count: int) -> None:
        batch = [make(int(time.time() * 1000)) for _ in range(count)]
        lines.extend(batch)
        kafka.send_all(producing, topic, [(None, line.encode()) for line in batch])
        kafka.send_all(producing, topic, [(None, BAD[len(lines) % len(BAD)])])

    send(500)
    job_request_start(job=job)
    run = wait_for(lambda: running_with_progress(job), 180, 0.5, "the first checkpoint of the real-time run")
    wait_for(lambda: latest_counts(out) == truth_by_url(lines), 60, 1, "the counts of the first records")
    send(300)
    time.sleep(0.8)
    os.killpg(run.pid, signal.SIGKILL)  # while records flow
    send(200)
    run = wait_for(lambda last=run.id: running_with_progress(job, last), 240, 0.5, "the recovery after the kill")
    wait_for(lambda: latest_counts(out) == truth_by_url(lines), 90, 1, "every count, after the restarts")
    sent = Sent(topic)
    wait_for(lambda: read_to_end(job, sent), 60, 1, "a checkpoint at the topic's end")
    bad_sent = sent.total() - len(lines)
    wait_for(lambda: redis.xlen(job.dead_letter_stream) >= bad_sent, 60, 1, "the bad records' dead letters")
    dead = [f for _, f in redis.xrange(job.dead_letter_stream)]
    places = {re.search(rb"partition \d+, offset \d+", f[b"reason"]).group() for f in dead}
    assert len(dead) == len(places) == bad_sent == 3, "each bad record once, with its place"
    batches = list(job.checkpoints.order_by("batch_id").values_list("batch_id", flat=True))
    assert len(batches) >= 2 and batches == sorted(set(batches))

    # a savepoint of the running job, records after it, then the job restored to it: the records after the savepoint
    # are read again, and each count comes back to the truth
    execute(job, ActionKind.SAVEPOINT)
    savepoint = job.savepoints.get()
    send(300)
    wait_for(lambda: latest_counts(out) == truth_by_url(lines), 90, 1, "the counts after the savepoint")
    run = job.runs.get(status=RunStatus.RUNNING)
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, 0.5, "the stop")
    execute(job, ActionKind.RESTORE, savepoint=savepoint.id)
    send(100)
    wait_for(lambda: running_with_progress(job, run.id), 240, 0.5, "the restored run's first checkpoint")
    wait_for(lambda: latest_counts(out) == truth_by_url(lines), 90, 1, "every count, after the restore")
    preview = finished(
        action_request(job=job, kind=ActionKind.UPGRADE_PREVIEW, params={"pipeline": "url-counts-live-udf"})
    )
    plan = preview.params["plan"]
    assert plan["incompatible"], plan
    assert "real-time mode refuses the new version" in plan["summary"] or any(
        "real-time mode refuses" in v["reason"] for v in plan["verdicts"]
    ), plan
    assert "OPERATOR_OR_SINK_NOT_IN_ALLOWLIST" in json.dumps(plan) and "ArrowEvalPythonExec" in json.dumps(plan)
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, 0.5, "the stop")
    kafka.delete_topic(settings.KAFKA_BOOTSTRAP, out)


@pytest.mark.django_db
def test_a_spec_declares_a_real_time_job_with_true_and_nothing_else():
    from dashboard.specs import SpecError, checked

    spec = {"name": "live-spec", "pipeline": "url-counts-live", "source_kind": "kafka", "source_stream": "access-log",
            "source_path": settings.KAFKA_BOOTSTRAP, "state_backend": "rocksdb", "trigger_interval_seconds": 5,
            "driver": "own", "real_time": True}  # fmt: skip
    assert checked(spec).cleaned_data["real_time"] is True
    with pytest.raises(SpecError) as refused:
        checked(spec | {"real_time": "yes"})
    assert refused.value.problems == {"real_time": ["must be true or false"]}
    with pytest.raises(SpecError) as shared:
        checked(spec | {"driver": "shared"})
    assert "a driver of its own" in str(shared.value.problems["driver"])
