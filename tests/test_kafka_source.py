"""A Kafka source is accepted only where Spark's Kafka connector is on the class path (the pyspark wheel does not ship
it), and its lag is read from the progress events' offsets."""

from __future__ import annotations

import pytest

from dashboard.checkpoint_dir.disk import Measurement
from dashboard.models import Job
from dashboard.records import checkpoint_record
from tests.support import VALID

KAFKA = {
    **VALID,
    "pipeline": "dedup",
    "source_kind": "kafka",
    "source_stream": "clicks",
    "source_path": "k1:9092,k2:9092",
}


@pytest.mark.django_db
def test_kafka_is_refused_without_the_connector_and_accepted_with_it(as_role, monkeypatch):
    operator_client = as_role("admin")
    monkeypatch.delenv("STATEKEEPER_SPARK_JARS", raising=False)
    refused = operator_client.post("/jobs/new", KAFKA).content.decode()
    assert "Spark&#x27;s Kafka connector is not on the class path" in refused and not Job.objects.exists()
    monkeypatch.setenv(
        "STATEKEEPER_SPARK_JARS", "/opt/jars/spark-sql-kafka-0-10_2.13-4.3.0.jar,/opt/jars/kafka-clients.jar"
    )
    bad_servers = operator_client.post("/jobs/new", {**KAFKA, "source_path": "k1"}).content.decode()
    assert "host:port" in bad_servers and not Job.objects.exists()
    operator_client.post("/jobs/new", KAFKA)
    job = Job.objects.get(name="clicks")
    assert (job.source_kind, job.source_stream, job.source_path, job.reads_redis) == (
        "kafka",
        "clicks",
        "k1:9092,k2:9092",
        False,
    )


def test_a_kafka_batch_lag_is_the_latest_offsets_minus_its_end_over_every_partition():
    progress = {
        "batchId": 3, "timestamp": "2026-11-22T12:00:00.000Z",
        "sources": [{
            "startOffset": {"clicks": {"0": 10, "1": 5}},
            "endOffset": '{"clicks": {"0": 20, "1": 7}}',
            "latestOffset": {"clicks": {"0": 25, "1": 7, "2": 4}},
        }],
    }  # fmt: skip
    record = checkpoint_record(progress, Measurement(0, 0, False))
    assert record["lag_records"] == 5 + 0 + 4
    assert record["end_offset"] == {"clicks": {"0": 20, "1": 7}}
