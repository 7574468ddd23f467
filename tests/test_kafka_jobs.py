"""Kafka jobs against the real broker the set-up starts (bin/lib.sh, ensure_kafka), with Spark's own Kafka source: each
record counted once through savepoint, restore, rollback, rescale and kill -9; lag per partition from the broker while
the job is down; bad records in the dead letters with their topic, partition and offset."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from confluent_kafka.admin import AdminClient
from django.conf import settings

from dashboard import kafka
from dashboard.engine.samples import sample_events
from dashboard.models import (
    Action,
    ActionKind,
    ActionStatus,
    Job,
    Run,
    RunStatus,
    SourceLag,
    StandbyDriver,
    StandbyStatus,
)
from dashboard.pipelines import get as get_pipeline
from dashboard.records import kafka_offsets, source_position
from dashboard.services.actions import action_request
from dashboard.services.blue_green import green_request
from dashboard.services.checkpoints import progress_stream_ingest
from dashboard.services.forks import rollback_preview, savepoint_preview
from dashboard.services.runs import job_request_start, job_request_stop
from dashboard.services.source_lag import source_lag_sample
from dashboard.templatetags.console import offset_id
from tests.conftest import DriverThread, wait_for
from tests.support import Orders, every_sink_exact, execute, finished, running_with_progress, sink_total, switched_to
from tests.test_state_migration import daily_totals_go_on, truth

pytestmark = [pytest.mark.spark, pytest.mark.django_db(transaction=True)]

PARTITIONS = 3
# what a broken producer writes among the access-log lines (Kafka's own limit refuses a record over 1 MiB: the broker,
# not the job, stops that one)
BAD = [b"GET /oops", b"{oops", b"", '10.0.0.1 - - [x] "GET /\xff HTTP/1.1" 200 1'.encode("latin-1")]


@pytest.fixture
def topic() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:8]}"
    kafka.ensure_topic(settings.KAFKA_BOOTSTRAP, name, PARTITIONS)
    yield name
    kafka.delete_topic(settings.KAFKA_BOOTSTRAP, name)


class Sent:
    """What the test produced: good records, and the place (partition, offset) of every bad one."""

    def __init__(self, topic: str) -> None:
        self.topic, self.good, self.bad = topic, 0, set[tuple[int, int]]()
        self.producer = kafka.producer(settings.KAFKA_BOOTSTRAP)

    def send(self, count: int, seed: int, bad: list[bytes] = ()) -> int:
        make, rng = sample_events(get_pipeline("url-counts"), random.Random(seed)), random.Random(seed)

        def placed(error, message) -> None:
            assert error is None, error
            if message.value() in bad:
                self.bad.add((message.partition(), message.offset()))

        for n in range(count):
            self.producer.produce(
                self.topic, make(int(time.time() * 1000)).encode(), rng.randbytes(4), on_delivery=placed
            )
            if bad and n % max(1, count // len(bad)) == 0:
                self.producer.produce(self.topic, bad[(n // max(1, count // len(bad))) % len(bad)], on_delivery=placed)
            self.producer.poll(0)
        self.producer.flush()
        self.good += count
        return count

    def total(self) -> int:
        """Every record in the topic: the sum of its partitions' end offsets."""
        return sum(end for _, end in kafka.end_offsets(settings.KAFKA_BOOTSTRAP, self.topic).values())


def read_to_end(job: Job, sent: Sent) -> bool:
    progress_stream_ingest(client=redis_lib.Redis.from_url(settings.REDIS_URL))
    job.refresh_from_db()
    latest = job.checkpoints.filter(location=job.checkpoint_dir).order_by("-batch_id").first()
    return latest is not None and source_position(latest.end_offset) == sent.total()


def run_to_end(spark, job: Job, sent: Sent) -> None:
    driver = DriverThread(spark, job)
    wait_for(lambda: read_to_end(job, sent), 180, what=f"{job.name} to read {sent.total()} records")
    assert driver.stop() == RunStatus.STOPPED
    read_to_end(job, sent)


def kafka_job(make_job, topic: str, **fields) -> Job:
    return make_job(source_kind="kafka", source_stream=topic, source_path=settings.KAFKA_BOOTSTRAP, **fields)


def take_pending_start(job) -> None:
    job.runs.filter(status=RunStatus.PENDING).update(status=RunStatus.STOPPED)


def test_a_kafka_job_counts_every_record_once_through_savepoint_restore_rollback_and_rescale(
    spark, make_job, topic, redis
):
    job = kafka_job(make_job, topic, max_records_per_batch=300, state_backend="rocksdb", state_partitions=2)
    sent = Sent(topic)
    sent.send(900, seed=1, bad=BAD)
    run_to_end(spark, job, sent)
    assert sink_total(job) == sent.good == 900

    # the checkpoint history holds each partition's offsets, as the broker has them
    ends = kafka.end_offsets(settings.KAFKA_BOOTSTRAP, topic)
    latest = job.checkpoints.order_by("-batch_id").first()
    assert kafka_offsets(latest.end_offset) == {topic: {p: end for p, (_, end) in ends.items()}}
    assert offset_id(latest.end_offset) == f"{topic} " + " ".join(f"{p}:{ends[p][1]}" for p in range(PARTITIONS))
    assert all(end > 0 for _, end in ends.values()), "every partition got records"
    # admission control over all partitions together: maxOffsetsPerTrigger
    assert max(c.input_rows for c in job.checkpoints.all()) <= 300

    # every bad record in the dead letters, once, with its topic, partition and offset
    dead = [f for _, f in redis.xrange(job.dead_letter_stream)]
    places = {tuple(map(int, re.search(rb"partition (\d+), offset (\d+)", f[b"reason"]).groups())) for f in dead}
    assert len(dead) == len(sent.bad) == len(BAD) and places == sent.bad
    assert all(f"topic {topic}".encode() in f[b"reason"] for f in dead)

    execute(job, ActionKind.SAVEPOINT)
    savepoint = job.savepoints.get()
    sent.send(600, seed=2)
    # the preview counts the records to replay from the broker
    assert (savepoint_preview(job, savepoint).replay_records, savepoint_preview(job, savepoint).refusal) == (600, "")

    # while the job is down its lag comes from the broker, per partition
    before = SourceLag.objects.count()
    source_lag_sample()
    sample = SourceLag.objects.filter(job=job).latest("sampled_at")
    assert SourceLag.objects.count() == before + 1
    assert sample.lag_records == 600 == sum(p["lag"] for p in sample.partitions.values())
    assert sorted(sample.partitions) == ["0", "1", "2"] and sample.lag_seconds is not None and sample.lag_seconds >= 0
    assert all(p["end"] == ends_now for p, ends_now in zip(
        sample.partitions.values(), [e for _, e in kafka.end_offsets(settings.KAFKA_BOOTSTRAP, topic).values()],
        strict=True))  # fmt: skip

    run_to_end(spark, job, sent)
    assert sink_total(job) == 1500

    execute(job, ActionKind.RESTORE, savepoint=savepoint.id)
    take_pending_start(job)
    job.refresh_from_db()
    assert job.checkpoint_dir.startswith("checkpoint-restore-")
    run_to_end(spark, job, sent)
    assert sink_total(job) == 1500, "the replay from the broker overwrites, never adds"

    first = job.checkpoints.filter(location=job.checkpoint_dir).order_by("batch_id").first()
    preview = rollback_preview(job, first.batch_id)
    assert preview.refusal == "" and preview.replay_records == sent.total() - source_position(first.end_offset)
    execute(job, ActionKind.ROLLBACK, batch=first.batch_id)
    take_pending_start(job)
    run_to_end(spark, job, sent)
    assert sink_total(job) == 1500

    execute(job, ActionKind.RESCALE, parallelism=1, state_partitions=3)
    take_pending_start(job)
    job.refresh_from_db()
    assert job.state_partitions == 3
    sent.send(300, seed=3)
    run_to_end(spark, job, sent)
    assert sink_total(job) == sent.good == 1800
    latest = job.checkpoints.filter(location=job.checkpoint_dir).order_by("-batch_id").first()
    assert latest.state_operators[0]["numShufflePartitions"] == 3


def test_a_restore_past_the_topics_retention_is_refused_with_the_count(spark, make_job, topic):
    job = kafka_job(make_job, topic, max_records_per_batch=500)
    sent = Sent(topic)
    sent.send(300, seed=1)
    run_to_end(spark, job, sent)
    execute(job, ActionKind.SAVEPOINT)
    savepoint = job.savepoints.get()
    sent.send(300, seed=2)
    # retention deletes every partition's records up to its end (what a short retention.ms does over time)
    from confluent_kafka import TopicPartition

    admin = AdminClient({"bootstrap.servers": settings.KAFKA_BOOTSTRAP})
    ends = kafka.end_offsets(settings.KAFKA_BOOTSTRAP, topic)
    deleted = admin.delete_records([TopicPartition(topic, p, end) for p, (_, end) in ends.items()])
    for future in deleted.values():
        future.result(10)
    preview = savepoint_preview(job, savepoint)
    assert preview.refusal.startswith(f"Refused: 300 records after this batch were already deleted from {topic}")


@pytest.mark.chaos  # the default run kills a Kafka job's driver twice in the sink's test below
@pytest.mark.browser
def test_a_kafka_job_through_a_standbys_takeover_and_a_kill_of_driver_and_worker_counts_every_record_once(
    make_job, topic, redis, celery_worker
):
    """kill -9 of the driver with a warm standby (which takes over: the cold restart waits 30 s), then of the next
    driver and the Celery worker together (a new worker picks up the restart), while records flow with bad ones."""
    job = kafka_job(
        make_job, topic, parallelism=1, trigger_interval_seconds=1, standby=True, restart_strategy="fixed-delay",
        restart_delay_seconds=30,
    )  # fmt: skip
    sent, halt = Sent(topic), threading.Event()

    def produce() -> None:
        seed = 0
        while not halt.wait(0.2):
            seed += 1
            sent.send(30, seed=seed, bad=BAD[:1] if seed % 5 == 0 else [])

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    job_request_start(job=job)
    first = wait_for(lambda: running_with_progress(job), 120, 0.5, "the first run to commit")
    standby = wait_for(lambda: StandbyDriver.objects.filter(job=job, status=StandbyStatus.READY).first(), 180, 0.5,
                       "a standby to be warm")  # fmt: skip
    os.killpg(first.pid, signal.SIGKILL)
    successor = wait_for(lambda: running_with_progress(job, first.id), 25, 0.1, "the standby to commit a batch")
    assert successor.pid == standby.pid, "the warm standby took over, not a cold restart"

    Job.objects.filter(id=job.id).update(standby=False, restart_delay_seconds=1)
    time.sleep(random.Random(1).uniform(0.5, 2))
    os.killpg(successor.pid, signal.SIGKILL)
    celery_worker.kill()
    time.sleep(2)
    celery_worker.start()
    wait_for(lambda: running_with_progress(job, successor.id), 180, 0.5, "a restart after the worker came back")
    halt.set()
    producer.join()
    wait_for(lambda: read_to_end(job, sent), 180, 1, "the job to catch up")
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, 0.5, "the stop")
    assert sink_total(job) == sent.good, "every good record counted exactly once"
    assert redis.xlen(job.dead_letter_stream) == len(sent.bad), "every bad record in the dead letters, once"


@pytest.mark.chaos  # a team job on Kafka through a savepoint upgrade, a migration with its preview, and its rollback
def test_a_kafka_team_job_upgraded_then_migrated_and_rolled_back_keeps_every_total_in_every_sink(
    make_job, redis, topic, celery_worker, spark, team_database, tmp_path
):
    lake = tmp_path / "lake"
    values = {"orders_dsn": team_database, "lake_dir": str(lake)}
    job = kafka_job(make_job, topic, pipeline="customer-spend", parallelism=1, trigger_interval_seconds=1,
                    parameters=values)  # fmt: skip
    orders = Orders(redis, topic, settings.KAFKA_BOOTSTRAP)
    orders.send(60, seed=1)
    job_request_start(job=job)
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5, "the first orders")

    # the savepoint upgrade to new parameters: the new run goes on from the savepoint's offsets in the broker
    upgrade = finished(action_request(job=job, kind=ActionKind.UPGRADE, params={
        "pipeline": "customer-spend", "parameters": {**values, "window_minutes": 60, "threshold": 2_000_000}}))  # fmt: skip
    assert upgrade.status == ActionStatus.SUCCEEDED, upgrade.outcome
    orders.send(20, seed=2)
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5, "the orders after it")

    # the migration's preview runs the new version's first batch from the batch's Kafka offsets
    preview = finished(action_request(job=job, kind=ActionKind.UPGRADE_PREVIEW,
                                      params={"pipeline": "customer-spend-daily", "migrate": 1}))  # fmt: skip
    assert preview.status == ActionStatus.SUCCEEDED, preview.outcome
    windows = truth(orders)
    assert preview.params["migration"]["keys_in"] == len(windows)

    before_migration = len(orders.sent)
    migrated = finished(action_request(job=job, kind=ActionKind.UPGRADE,
                                       params={"pipeline": "customer-spend-daily", "migrate": 1}))  # fmt: skip
    assert migrated.status == ActionStatus.SUCCEEDED and switched_to(job, "customer-spend-daily"), migrated.outcome
    job.refresh_from_db()
    savepoint = job.savepoints.get(id=migrated.params["savepoint"])
    assert job.start_offset == {topic: {str(p): o for p, o in kafka_offsets(
        savepoint.manifest["source_offsets"][0])[topic].items()}}, "the new line starts where the savepoint's batch ended"  # fmt: skip
    daily_totals_go_on(spark, job, orders, team_database, lake, before_migration)

    back = finished(action_request(job=job, kind=ActionKind.UPGRADE_ROLLBACK, params={"upgrade": migrated.id}))
    assert back.status == ActionStatus.SUCCEEDED and switched_to(job, "customer-spend"), back.outcome
    orders.send(10, seed=4)
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5,
             "every order in its hour after the rollback, in every sink")  # fmt: skip
    job_request_stop(job=job)


def topic_records(topic: str, cluster: kafka.Cluster | None = None) -> list[Any]:
    """Every record of the topic as a team's consumer reading ``read_committed`` gets it, partition by partition."""
    from confluent_kafka import Consumer, TopicPartition

    cluster = cluster or kafka.Cluster(settings.KAFKA_BOOTSTRAP)
    consumer = Consumer({"bootstrap.servers": cluster.servers, "group.id": f"team-{uuid.uuid4().hex[:6]}",
                         "isolation.level": "read_committed", "enable.partition.eof": True,
                         **kafka.client_config(cluster.security)})  # fmt: skip
    parts = kafka.partitions(cluster, topic)
    consumer.assign([TopicPartition(topic, p, 0) for p in parts])
    records: list[Any] = []
    ended: set[int] = set()
    deadline = time.monotonic() + 30
    while len(ended) < len(parts) and time.monotonic() < deadline:
        message = consumer.poll(1)
        if message is None:
            continue
        if message.error():
            ended.add(message.partition())
            continue
        records.append(message)
    consumer.close()
    return records


def committed_counts(
    topic: str, cluster: kafka.Cluster | None = None
) -> tuple[dict[str, int], list[tuple[str, str, str]]]:
    """What a team's consumer reading ``read_committed`` holds: the newest count per URL, and every record's
    (url, batch, lineage) in the order it came, to find a batch seen twice in one lineage."""
    latest: dict[str, int] = {}
    seen: list[tuple[str, str, str]] = []
    for message in topic_records(topic, cluster):
        headers = dict(message.headers() or [])
        value = json.loads(message.value())
        latest[value["url"]] = value["requests"]
        seen.append((value["url"], headers["statekeeper-batch"].decode(), headers["statekeeper-lineage"].decode()))
    return latest, seen


def truth_by_url(sent_lines: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for line in sent_lines:
        url = line.split('"')[1].split()[1]
        counts[url] = counts.get(url, 0) + 1
    return counts


@pytest.mark.browser
def test_a_kafka_sink_read_committed_holds_every_count_once_through_kill_minus_nine_and_a_restore(
    make_job, topic, redis, celery_worker, monkeypatch, settings
):
    """Each batch one Kafka transaction with its marker: a consumer reading read_committed never sees a batch twice in
    one lineage, nor a batch a killed driver left half-written, and its newest count per URL is the truth; after a
    restore, the batches after the savepoint come again under a new lineage, and the newest counts are still true."""
    out = f"{topic}-counts"
    kafka.ensure_topic(settings.KAFKA_BOOTSTRAP, out, 2)
    monkeypatch.setenv("STATEKEEPER_PIPELINES", "tests.user_pipelines:URLS_TO_KAFKA")
    settings.PIPELINES = [*settings.BUILTIN_PIPELINES, "tests.user_pipelines:URLS_TO_KAFKA"]
    celery_worker.kill()
    celery_worker.start()  # with the test's pipeline registered
    job = kafka_job(make_job, topic, pipeline="urls-to-kafka", parallelism=1, trigger_interval_seconds=1,
                    restart_strategy="fixed-delay", restart_delay_seconds=1, max_records_per_batch=200,
                    parameters={"servers": settings.KAFKA_BOOTSTRAP, "topic": out})  # fmt: skip
    lines: list[str] = []
    make, producing = (
        sample_events(get_pipeline("url-counts"), random.Random(1)),
        kafka.producer(settings.KAFKA_BOOTSTRAP),
    )

    def send(count: int) -> None:
        batch = [make(int(time.time() * 1000)) for _ in range(count)]
        lines.extend(batch)
        kafka.send_all(producing, topic, [(None, line.encode()) for line in batch])

    send(600)
    job_request_start(job=job)
    run = wait_for(lambda: running_with_progress(job), 120, 0.5, "the first run to commit")
    for kill in range(2):
        send(300)
        time.sleep(random.Random(kill).uniform(0.3, 1.5))
        os.killpg(run.pid, signal.SIGKILL)
        run = wait_for(lambda last=run.id: running_with_progress(job, last), 180, 0.5, f"recovery after kill {kill}")
    sent = Sent(topic)
    wait_for(lambda: read_to_end(job, sent), 180, 1, "the job to catch up")
    latest, seen = committed_counts(out)
    assert latest == truth_by_url(lines), "the consumer's newest counts are the truth"
    per_batch = {(url, batch, lineage) for url, batch, lineage in seen}
    assert len(per_batch) == len(seen), "no batch twice in one lineage: a replayed batch was skipped"

    execute(job, ActionKind.SAVEPOINT)
    savepoint = job.savepoints.get()
    send(400)
    wait_for(lambda: read_to_end(job, sent), 180, 1, "the job to read the records after the savepoint")
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, 0.5, "the stop")
    execute(job, ActionKind.RESTORE, savepoint=savepoint.id)
    wait_for(lambda: running_with_progress(job, run.id) and read_to_end(job, sent), 240, 1, "the restored job")
    latest, seen = committed_counts(out)
    assert latest == truth_by_url(lines), "after the restore, the newest counts are still the truth"
    again = {b for _, b, _ in seen if len({lin for _, b2, lin in seen if b2 == b}) > 1}
    assert again and min(map(int, again)) == savepoint.batch_id + 1, "the batches after the savepoint came again"
    job_request_stop(job=job)


def test_a_broker_that_does_not_answer_is_said_on_the_jobs_page_and_no_lag_is_made_up(make_job, topic, as_role):
    job = kafka_job(make_job, topic)
    Job.objects.filter(id=job.id).update(source_path="127.0.0.1:9")  # nothing listens there
    source_lag_sample()
    assert not SourceLag.objects.filter(job=job).exists(), "no sample rather than a false zero"
    viewer = as_role("viewer")
    page = viewer.get(f"/jobs/{job.name}/").content.decode()
    assert 'id="source-down"' in page and "did not answer" in page
    assert f'statekeeper_source_up{{job="{job.name}"}} 0' in viewer.get("/metrics").content.decode()

    Job.objects.filter(id=job.id).update(source_path=settings.KAFKA_BOOTSTRAP)
    Sent(topic).send(30, seed=1)
    source_lag_sample()
    assert SourceLag.objects.get(job=job).lag_records == 30
    assert 'id="source-down"' not in viewer.get(f"/jobs/{job.name}/").content.decode()
    scraped = viewer.get("/metrics").content.decode()
    assert f'statekeeper_source_up{{job="{job.name}"}} 1' in scraped
    assert f'statekeeper_job_lag_records{{job="{job.name}"}} 30' in scraped


def test_a_partition_added_while_the_job_runs_is_read_from_its_start_and_sampled(spark, make_job, topic):
    from confluent_kafka.admin import NewPartitions

    job = kafka_job(make_job, topic, max_records_per_batch=500)
    sent = Sent(topic)
    sent.send(300, seed=1)
    driver = DriverThread(spark, job)
    wait_for(lambda: read_to_end(job, sent), 180, what="the first records")
    admin = AdminClient({"bootstrap.servers": settings.KAFKA_BOOTSTRAP})
    admin.create_partitions([NewPartitions(topic, PARTITIONS + 1)])[topic].result(10)
    wait_for(lambda: len(kafka.partitions(settings.KAFKA_BOOTSTRAP, topic)) == PARTITIONS + 1, 30, what="the partition")
    sent.producer = kafka.producer(settings.KAFKA_BOOTSTRAP)  # one that knows the new partition already
    sent.send(400, seed=2)  # keyed at random: the new partition gets its share
    assert kafka.end_offsets(settings.KAFKA_BOOTSTRAP, topic)[PARTITIONS][1] > 0
    wait_for(lambda: read_to_end(job, sent), 180, what="every record, the new partition's too")
    assert driver.stop() == RunStatus.STOPPED
    assert sink_total(job) == sent.good == 700
    source_lag_sample()
    sample = SourceLag.objects.filter(job=job).latest("sampled_at")
    assert sorted(sample.partitions) == [str(p) for p in range(PARTITIONS + 1)] and sample.lag_records == 0


def test_a_topic_deleted_under_a_running_job_fails_its_run_with_the_reason_and_the_lag_card_says_so(
    spark, make_job, topic, as_role
):
    job = kafka_job(make_job, topic, max_records_per_batch=500)
    sent = Sent(topic)
    sent.send(200, seed=1)
    driver = DriverThread(spark, job)
    wait_for(lambda: read_to_end(job, sent), 180, what="the first records")
    kafka.delete_topic(settings.KAFKA_BOOTSTRAP, topic)
    driver.thread.join(120)
    assert not driver.thread.is_alive(), "the run ended"
    driver.run.refresh_from_db()
    assert driver.run.status == RunStatus.FAILED and topic in driver.run.message, driver.run.message
    assert sink_total(job) == 200, "what was read before stays counted once"
    source_lag_sample()
    page = as_role("viewer").get(f"/jobs/{job.name}/").content.decode()
    assert 'id="source-down"' in page and f"topic &#x27;{topic}&#x27; cannot be read" in page


def security_form(name: str, topic: str, servers: str, lines: str) -> Any:
    """The New job form for a Kafka job with these security settings (``name = value`` lines)."""
    from dashboard.forms import JobForm

    return JobForm(data={"name": name, "pipeline": "url-counts", "source_kind": "kafka", "source_stream": topic,
                         "source_path": servers, "state_backend": "memory", "trigger_interval_seconds": 1,
                         "state_partitions": 2, "parallelism": 1, "batches_retained": 10,
                         "max_records_per_batch": 100, "autoscale_mode": "off", "autoscale_max_per_day": 4,
                         "autoscale_window_minutes": 15, "source_security": lines})  # fmt: skip


def read_through(spark, make_job, topic: str, servers: str, security: dict[str, str], count: int, seed: int) -> Job:
    """A job that reads ``topic`` at ``servers`` with these security settings, run over ``count`` records the test
    writes through the plain listener: each counted once, and the console's lag sampled through the same login."""
    job = make_job(source_kind="kafka", source_stream=topic, source_path=servers, source_security=security,
                   max_records_per_batch=200)  # fmt: skip
    sent = Sent(topic)
    sent.send(count, seed=seed)
    run_to_end(spark, job, sent)
    assert sink_total(job) == sent.good == count
    source_lag_sample()
    assert SourceLag.objects.get(job=job).lag_records == 0, "the console's client logged in too"
    return job


def sasl_listener() -> tuple[str, str]:
    """The set-up's broker's second listener, which asks for a SASL login (PLAIN, the user statekeeper), and its
    password (bin/lib.sh, ensure_kafka: STATEKEEPER_KAFKA_SASL_PASSWORD_FILE)."""
    if settings.KAFKA_BOOTSTRAP != "127.0.0.1:9092":
        pytest.skip("a site's own cluster (STATEKEEPER_KAFKA_BOOTSTRAP): the set-up's SASL listener is not there")
    default = Path.home() / ".config" / "statekeeper" / "kafka-sasl-password"
    return "127.0.0.1:9094", Path(os.environ.get("STATEKEEPER_KAFKA_SASL_PASSWORD_FILE", default)).read_text().strip()


def test_a_kafka_job_reads_a_cluster_that_asks_for_a_login_its_password_a_secret_never_shown(
    spark, make_job, topic, as_role
):
    """A cluster that needs SASL: the job's source names a secret for the password; the driver (Spark's Java client)
    and the console's own client (lag) both log in with it; no page, spec or API answer holds the password; a wrong
    one is named as the broker's refusal of the login on the job's page, and no lag is made up."""
    from dashboard.services.secrets import secret_set
    from dashboard.specs import spec_of

    servers, password = sasl_listener()
    secret_set(name="kafka-login", value=password, username="admin")
    security = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN", "sasl_username": "statekeeper",
                "sasl_password": "${secret:kafka-login}"}  # fmt: skip
    lines = (
        "security_protocol = SASL_PLAINTEXT\nsasl_mechanism = PLAIN\nsasl_username = statekeeper\n"
        f"sasl_password = {password}"
    )
    form = security_form("sasl-refused", topic, servers, lines)
    assert not form.is_valid() and "never the password" in str(form.errors["source_security"])
    form = security_form("sasl-refused", topic, servers, lines.replace(password, "${secret:no-such-login}"))
    assert not form.is_valid() and "there is no secret named 'no-such-login'" in " ".join(
        form.errors["source_security"]
    )

    job = read_through(spark, make_job, topic, servers, security, 600, seed=3)  # written through the plain listener
    sent = Sent(topic)

    viewer = as_role("viewer")
    page = viewer.get(f"/jobs/{job.name}/").content.decode()
    assert 'id="kafka-security"' in page and "PLAIN as <code>statekeeper</code>" in page
    spec = json.dumps(spec_of(job))  # what the API and the CLI answer for the job
    assert spec_of(job)["source_security"]["sasl_password"] == "${secret:kafka-login}"
    edit = as_role("admin", "an-admin").get(f"/jobs/{job.name}/edit").content.decode()
    for shown in (page, spec, edit):
        assert password not in shown
    assert "${secret:kafka-login}" in edit

    secret_set(name="kafka-login", value="not-the-password", username="admin")
    sent.send(50, seed=4)
    SourceLag.objects.filter(job=job).delete()
    source_lag_sample()
    assert not SourceLag.objects.filter(job=job).exists(), "no sample rather than a false zero"
    page = viewer.get(f"/jobs/{job.name}/").content.decode()
    assert 'id="source-down"' in page and "Authentication failed" in page and password not in page
    failing = DriverThread(spark, job)  # and the driver, whose Java client the broker refuses too
    failing.thread.join(180)
    failing.run.refresh_from_db()
    assert failing.status == RunStatus.FAILED and failing.run.status == RunStatus.FAILED
    assert "Authentication failed" in failing.run.message and password not in failing.run.message
    assert "not-the-password" not in failing.run.message


def tls_listener(tmp_path: Path) -> tuple[str, str, str, str]:
    """The set-up's broker's third listener, SASL over TLS (bin/lib.sh, ensure_kafka and kafka_tls): its address, the
    login's password, the CA that signed the broker's certificate, and another CA that did not."""
    servers, password = sasl_listener()
    default = Path.home() / ".config" / "statekeeper" / "kafka-tls"
    ca = Path(os.environ.get("STATEKEEPER_KAFKA_TLS_DIR", default)) / "ca.pem"
    other = tmp_path / "other-ca.pem"
    made = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=not the broker's CA",
         "-keyout", str(tmp_path / "other-key.pem"), "-out", str(other)],
        capture_output=True, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    return servers.replace("9094", "9095"), password, str(ca), str(other)


def test_the_range_reader_reads_a_fixed_range_over_tls_and_a_ca_it_cannot_trust_fails_it_without_the_password(
    spark, topic, redis, tmp_path
):
    """The console's range reader (a shadow run's, a migration preview's, a green's) over SASL_SSL: exactly the range's
    records, once; with a CA that did not sign the broker's certificate, the read fails with the handshake's reason,
    and neither the failure nor the query's description holds the password it was given."""
    from workers.spark.sources.kafka_range import kafka_range_events

    servers, password, ca, other_ca = tls_listener(tmp_path)
    sent = Sent(topic)
    sent.send(300, seed=8)
    ends = {str(p): end for p, (_, end) in kafka.end_offsets(settings.KAFKA_BOOTSTRAP, topic).items()}
    ending = {p: end * 2 // 3 for p, end in ends.items()}
    login = {"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "statekeeper",
             "sasl_password": password}  # fmt: skip
    payload = get_pipeline("url-counts").payload

    def run(security: dict[str, str], name: str) -> tuple[int, str]:
        frame = kafka_range_events(spark, servers, topic, payload, f"{topic}:dead", settings.REDIS_URL, 300, 100,
                                   json.dumps({topic: {p: 0 for p in ends}}), json.dumps({topic: ending}), security)  # fmt: skip
        rows: list[int] = []
        query = (
            frame.writeStream.foreachBatch(lambda batch, _: rows.append(batch.count()))
            .option("checkpointLocation", str(tmp_path / name)).trigger(availableNow=True).start()
        )  # fmt: skip
        try:
            query.awaitTermination(120)
        except Exception as exc:  # the query failed: what it says, with its plan and offsets
            return sum(rows), str(exc)
        return sum(rows), ""

    read, said = run({**login, "ssl_ca_file": ca}, "trusted")
    assert read == sum(ending.values()), "the range's records, each once, and none after it"
    refused, said = run({**login, "ssl_ca_file": other_ca}, "untrusted")
    assert refused == 0 and "certificate verify failed" in said, said[:3000]
    assert password not in said


def test_a_kafka_job_reads_a_cluster_over_tls_checked_against_its_ca_and_a_certificate_it_does_not_trust_is_named(
    spark, make_job, topic, as_role, tmp_path
):
    """SASL_SSL, as managed clusters serve it: both clients check the broker's certificate against the job's CA file
    (Spark's Java client as a PEM truststore, the console's librdkafka as its CA location) and its name against the
    address. Every record is counted once and the lag sampled through TLS; a file that holds no certificate is refused
    at the form; a CA that did not sign the broker's certificate is named as such on the job's page and in the
    driver's failed run, and no lag is made up."""
    from dashboard.services.secrets import secret_set

    servers, password, ca, other_ca = tls_listener(tmp_path)
    secret_set(name="kafka-tls-login", value=password, username="admin")
    security = {"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "statekeeper",
                "sasl_password": "${secret:kafka-tls-login}", "ssl_ca_file": ca}  # fmt: skip
    lines = "\n".join(f"{k} = {v}" for k, v in {**security, "ssl_ca_file": str(tmp_path / "other-key.pem")}.items())
    form = security_form("tls-refused", topic, servers, lines)
    assert not form.is_valid() and "holds no certificate in PEM" in " ".join(form.errors["source_security"])

    job = read_through(spark, make_job, topic, servers, security, 500, seed=5)
    sent = Sent(topic)
    viewer = as_role("viewer")
    page = viewer.get(f"/jobs/{job.name}/").content.decode()
    assert 'id="kafka-security"' in page and "SASL_SSL" in page and password not in page

    job.source_security = {**security, "ssl_ca_file": other_ca}
    job.save(update_fields=["source_security"])
    sent.send(50, seed=6)
    SourceLag.objects.filter(job=job).delete()
    source_lag_sample()
    assert not SourceLag.objects.filter(job=job).exists(), "no sample rather than a false zero"
    page = viewer.get(f"/jobs/{job.name}/").content.decode()
    assert 'id="source-down"' in page and "certificate verify failed" in page, page[page.find("source-down") :][:600]
    failing = DriverThread(spark, job)
    failing.thread.join(180)
    failing.run.refresh_from_db()
    assert failing.status == RunStatus.FAILED and failing.run.status == RunStatus.FAILED
    assert "unable to find valid certification path" in failing.run.message, failing.run.error[-6000:]
    assert password not in failing.run.message
    assert sink_total(job) == 500, "nothing was counted through a broker the job could not trust"


@pytest.fixture
def tls_sink_pipeline(monkeypatch, settings) -> Iterator[None]:
    """urls-to-kafka-tls registered here and in the processes the test starts."""
    from dashboard import pipelines

    reference = "tests.user_pipelines:URLS_TO_KAFKA_TLS"
    monkeypatch.setenv("STATEKEEPER_PIPELINES", reference)
    settings.PIPELINES = [*settings.BUILTIN_PIPELINES, reference]
    pipelines.registry.cache_clear()
    yield
    pipelines.registry.cache_clear()


def test_a_kafka_sink_writes_to_a_cluster_over_tls_with_a_login_its_password_a_secret_parameter(
    spark, make_job, topic, tls_sink_pipeline, settings, tmp_path
):
    """A pipeline's KafkaSink into a cluster that asks for SASL over TLS: its password a secret parameter, its CA a
    parameter. A consumer reading read_committed through TLS holds every count once; a CA that did not sign the
    broker's certificate stops the batch with the handshake's reason, and nothing is counted twice after."""
    from dataclasses import replace

    from statekeeper_sdk import KafkaSink as Sink
    from statekeeper_sdk import Parameter

    from dashboard import pipelines
    from dashboard.services.secrets import secret_set

    servers, password, ca, other_ca = tls_listener(tmp_path)
    out = f"{topic}-counts"
    kafka.ensure_topic(settings.KAFKA_BOOTSTRAP, out, 2)
    secret_set(name="kafka-sink-login", value=password, username="admin")
    values = {"servers": servers, "topic": out, "ca_file": ca, "kafka_password": "${secret:kafka-sink-login}"}
    assert pipelines.sink_problems("urls-to-kafka-tls", {**values, "ca_file": "etc/ca.pem"}) == [
        "sink counts: ssl_ca_file: the absolute path of the CA's certificates (PEM) the brokers' certificates are "
        "checked against"
    ]
    with pytest.raises(ValueError, match="sasl_password from a parameter declared secret=True"):
        replace(get_pipeline("url-counts"), name="leaky", parameters=(Parameter("pw", "str", ""),),
                sinks=(Sink("out", servers="s:1", topic="t", security={"sasl_password": "{pw}"}),))  # fmt: skip

    lines: list[str] = []
    make = sample_events(get_pipeline("url-counts"), random.Random(7))
    producing = kafka.producer(settings.KAFKA_BOOTSTRAP)

    def send(count: int) -> None:
        batch = [make(int(time.time() * 1000)) for _ in range(count)]
        lines.extend(batch)
        kafka.send_all(producing, topic, [(None, line.encode()) for line in batch])

    job = kafka_job(make_job, topic, pipeline="urls-to-kafka-tls", parallelism=1, max_records_per_batch=200,
                    parameters=values)  # fmt: skip
    sent = Sent(topic)
    send(600)
    run_to_end(spark, job, sent)
    cluster = kafka.Cluster(servers, {"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN",
                                      "sasl_username": "statekeeper", "sasl_password": password, "ssl_ca_file": ca})  # fmt: skip
    latest, seen = committed_counts(out, cluster)
    assert latest == truth_by_url(lines), "the consumer's newest counts are the truth"
    assert len({*seen}) == len(seen), "no batch twice in one lineage"

    job.parameters = {**values, "ca_file": other_ca}
    job.save(update_fields=["parameters"])
    send(100)
    failing = DriverThread(spark, job)
    failing.thread.join(180)
    failing.run.refresh_from_db()
    assert failing.status == RunStatus.FAILED, "a sink it cannot trust stops the job rather than dropping output"
    assert "certificate verify failed" in failing.run.message, failing.run.message
    assert password not in failing.run.message and password not in (failing.run.error or "")

    job.parameters = values
    job.save(update_fields=["parameters"])
    run_to_end(spark, job, sent)
    latest, seen = committed_counts(out, cluster)
    assert latest == truth_by_url(lines), "the batch the handshake stopped was written once, after"
    assert len({*seen}) == len(seen)


def test_a_shadow_run_of_a_kafka_job_reads_one_fixed_offset_range_with_both_versions(
    make_job, topic, celery_worker, as_role
):
    """An upgrade's shadow run on a Kafka job: both versions from a copy of the newest savepoint over the same records
    after it (offsets fixed per partition when it starts, read by the console's range reader, since Spark's Kafka
    source reads on to the newest record), beside the live job. The old version's figures are the truth over every
    record up to the range's end; records sent during the run are not read."""
    from dashboard.models import ResultRow

    job = kafka_job(make_job, topic, pipeline="user-sessions", state_backend="rocksdb", parallelism=1,
                    trigger_interval_seconds=1)  # fmt: skip
    producing, sent = kafka.producer(settings.KAFKA_BOOTSTRAP), Sent(topic)
    per_user: dict[str, int] = {}

    def send(count: int, seed: int, users: list[str]) -> None:
        rng = random.Random(seed)
        values = []
        for _ in range(count):
            user = rng.choice(users)
            per_user[user] = per_user.get(user, 0) + 1
            values.append((user.encode(), json.dumps({"user": user, "region": "eu", "amount": rng.randrange(1, 99)})))
        kafka.send_all(producing, topic, [(k, v.encode()) for k, v in values])

    def counted() -> int:
        return sum(int(r.value["events"]) for r in ResultRow.objects.filter(job=job, kind="totals"))

    send(300, 1, [f"u{i}" for i in range(20)])
    job_request_start(job=job)
    live = wait_for(lambda: running_with_progress(job), 180, 0.5, "the first commit")
    wait_for(lambda: counted() == 300, 120, 0.5, "the job to count every event")
    assert finished(action_request(job=job, kind=ActionKind.SAVEPOINT)).status == ActionStatus.SUCCEEDED
    shadow_users = ["u1", "u2", "u3"]
    send(200, 5, shadow_users)
    wait_for(lambda: counted() == 500 and read_to_end(job, sent), 120, 0.5, "the job to count the range")
    truth = {user: per_user[user] for user in shadow_users}

    shadow = action_request(job=job, kind=ActionKind.UPGRADE_SHADOW,
                            params={"pipeline": "user-sessions-v2", "records": 200})  # fmt: skip
    wait_for(lambda: Action.objects.get(id=shadow.id).params.get("ending"), 60, 0.2, "the range to be fixed")
    send(50, 6, ["u4"])  # after the range was fixed: neither version reads these
    shadow = finished(shadow)
    assert shadow.status == ActionStatus.SUCCEEDED, shadow.outcome
    assert shadow.params["records"] == 200 and shadow.params["start"]["kind"] == "savepoint"
    result = shadow.params["shadow"]
    assert (result["counts"]["added"], result["counts"]["removed"]) == (0, 0)
    changed = {row["key"]: row for row in result["rows"]["changed"]}
    assert sorted(changed) == shadow_users, "each user of the range gains the new field; nobody else is read"
    assert {user: row["before"]["events"] for user, row in changed.items()} == truth, "every record of the range once"
    for row in changed.values():
        assert {k: v for k, v in row["after"].items() if k != "largest"} == row["before"]
    live.refresh_from_db()
    assert live.status == RunStatus.RUNNING, "the live job ran through the shadow run"
    page = as_role("viewer").get(f"/jobs/{job.name}/deploys").content.decode()
    assert 'data-shadow="0/0/3"' in page
    job_request_stop(job=job)


@pytest.mark.usefixtures("celery_worker")
def test_a_blue_green_upgrade_of_a_kafka_team_job_follows_its_offsets_hands_over_and_its_next_run_reads_on(
    make_job, redis, topic, spark, team_database, tmp_path
):
    """Green follows the job's batches on Kafka through the range reader (each batch exactly the job's offsets, a
    no-data batch of the job's watermark run as one), through a kill -9 of the shared driver that runs both (blue
    restarts on Spark's Kafka source, green on the range reader from its fork), is compared key by key, and takes
    over at a committed batch; the job's next run reads green's checkpoint with Spark's own Kafka source again.
    Every order once in every sink throughout."""
    from tests.test_blue_green import Flow, beside, green_running, one_line, promoted, team_job

    lake = tmp_path / "lake"
    job = team_job(make_job, team_database, lake, source_kind="kafka", source_stream=topic,
                   source_path=settings.KAFKA_BOOTSTRAP, driver="shared")  # fmt: skip
    orders = Orders(redis, topic, settings.KAFKA_BOOTSTRAP)
    orders.send(40, seed=1)
    job_request_start(job=job)
    blue = wait_for(lambda: running_with_progress(job), 240, 0.5, "the job to run")
    flow = Flow(orders)
    flow.start()
    try:
        action = beside(job, {"pipeline": "customer-spend", "parameters": {"threshold": 50}})
        killed = Run.objects.get(id=action.params["green_run"])
        os.killpg(blue.pid, signal.SIGKILL)  # the shared driver: blue and green die together
        wait_for(lambda: running_with_progress(job, blue.id), 240, 0.5, "the job's restart")
        wait_for(lambda: (r := green_running(action)) and r.id != killed.id, 240, 0.5, "green again on its fork")
        action = promoted(action, 240)
    finally:
        flow.stop()
    job.refresh_from_db()
    assert job.checkpoint_dir == action.params["fork"] and job.parameters["threshold"] == 50
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5, "every order in every sink")
    assert not (why := one_line(job, action)), why

    green = job.runs.get(id=action.params["green_run"])
    offsets = Path(str(job.checkpoint_location).removeprefix("file:")) / "offsets"
    marked = [f.name for f in offsets.iterdir() if f.name.isdigit() and '"followed"' in f.read_text()]
    print(f"green ran {len(marked)} of the job's no-data batches: {sorted(marked, key=int)}")
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, 0.5, "the stop")
    orders.send(30, seed=7)
    job_request_start(job=job)
    again = wait_for(lambda: running_with_progress(job, green.id), 240, 0.5, "the job's next run")
    assert again.id != green.id
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5,
             "the orders after the restart, read by Spark's Kafka source from green's checkpoint")  # fmt: skip
    assert not [f for f in offsets.iterdir() if f.name.isdigit() and '"followed"' in f.read_text()]
    job_request_stop(job=job)


def test_dead_letters_are_re_driven_into_the_topic_once_also_when_a_re_drive_was_cut_short(make_job, topic, redis):
    """A Kafka job's dead letters go back into its topic as new records, each with its dead letter's id in a header,
    and leave the dead letters; a sink's refusal stays. A re-drive cut short after sending part of a chunk sends only
    the rest when retried: the topic holds each re-driven record once."""
    from confluent_kafka import Consumer
    from statekeeper_sdk import Rejected

    from dashboard.services.actions import action_execute
    from dashboard.services.dead_letters import REDRIVE_HEADER
    from workers.spark.sources.redis_streams import dead_letter

    job = kafka_job(make_job, topic)
    letters = [Rejected(f"{1000 + i}-{i}", "validate", f"reason {i}", b'{"n": %d}' % i) for i in range(40)]
    dead_letter(redis, job.dead_letter_stream, [*letters, Rejected("batch-3:url:x", "sink", "too long", b"x")])
    ids = [i.decode() for i, _ in redis.xrange(job.dead_letter_stream)]

    def records() -> list[tuple[str, bytes]]:
        consumer = Consumer({"bootstrap.servers": settings.KAFKA_BOOTSTRAP, "group.id": f"t-{uuid.uuid4().hex}",
                             "auto.offset.reset": "earliest", "enable.partition.eof": True})  # fmt: skip
        consumer.subscribe([topic])
        found, ended, deadline = [], set(), time.monotonic() + 30
        while len(ended) < PARTITIONS and time.monotonic() < deadline:
            m = consumer.poll(1)
            if m is None:
                continue
            if m.error():
                ended.add(m.partition())
                continue
            found.append((dict(m.headers() or [])[REDRIVE_HEADER].decode(), m.value()))
        consumer.close()
        return found

    # a first re-drive of ten, cut short: taken out of the dead letters, four of them sent, then the worker died
    action = action_request(job=job, kind=ActionKind.REDRIVE_DEAD_LETTERS, params={"ids": ids[:10]})
    pending = f"{job.dead_letter_stream}:redriving:{action.id}"
    redis.set(f"{pending}:from", json.dumps(kafka.end_offsets(settings.KAFKA_BOOTSTRAP, topic)))
    for entry in ids[:10]:
        payload = dict(redis.xrange(job.dead_letter_stream, entry, entry)[0][1])[b"payload"]
        redis.hset(pending, entry, payload)
        redis.xdel(job.dead_letter_stream, entry)
    producing = kafka.producer(settings.KAFKA_BOOTSTRAP)
    for entry in ids[:4]:
        producing.produce(topic, value=redis.hget(pending, entry), headers=[(REDRIVE_HEADER, entry.encode())])
    producing.flush()

    done = action_execute(action_id=action.id)  # the retry
    assert done.status == ActionStatus.SUCCEEDED, done.outcome
    sent = records()
    assert sorted(e for e, _ in sent) == sorted(ids[:10]), "each of the ten once: the four sent before, six now"
    assert not redis.exists(pending) and redis.xlen(job.dead_letter_stream) == 31

    everything = action_request(job=job, kind=ActionKind.REDRIVE_DEAD_LETTERS, params={"all": True})
    done = action_execute(action_id=everything.id)
    assert done.outcome.startswith(f"30 dead letters re-driven into the Kafka topic {topic}"), done.outcome
    assert "1 stayed" in done.outcome and redis.xlen(job.dead_letter_stream) == 1, "the sink's refusal stays"
    sent = records()
    assert sorted(e for e, _ in sent) == sorted(ids[:40]) and len(sent) == 40
    assert {v for _, v in sent} == {b'{"n": %d}' % i for i in range(40)}, "each payload as it was sent"


def test_records_checked_in_the_jvm_reach_the_dead_letters_also_when_the_driver_died_before_writing_them(
    spark, make_job, topic, redis
):
    """A Kafka job's records pass their checks in the JVM: no Python step in the query's plan. The records they refuse
    are written to the dead letters after their batch; a driver gone before it wrote them (here: its writes taken
    back and its marker set back, as a kill -9 between the commit and the write leaves them) leaves them to the next
    start, which reads those batches' ranges again from the checkpoint's offset log."""
    from workers.driver import job_spec
    from workers.spark.query import events_frame, rejected_records
    from workers.spark.sources.kafka_rejected import MARKER_PREFIX

    job = kafka_job(make_job, topic, max_records_per_batch=200)
    spec, pipeline = job_spec(job), get_pipeline(job.pipeline)
    plan = events_frame(spark, spec, pipeline)._jdf.queryExecution().analyzed().toString()
    assert "MapInArrow" not in plan and "Python" not in plan, plan
    assert rejected_records(spark, spec, pipeline) is not None

    sent = Sent(topic)
    sent.send(600, seed=4, bad=BAD)
    run_to_end(spark, job, sent)
    assert sink_total(job) == sent.good == 600

    def places() -> set[tuple[int, int]]:
        dead = [f for _, f in redis.xrange(job.dead_letter_stream)]
        found = [tuple(map(int, re.search(rb"partition (\d+), offset (\d+)", f[b"reason"]).groups())) for f in dead]
        assert len(found) == len(set(found)), "each once"
        return set(found)

    stages = {f[b"payload"]: f[b"stage"] for _, f in redis.xrange(job.dead_letter_stream)}
    assert places() == sent.bad and len(sent.bad) == len(BAD)
    assert stages == {b"GET /oops": b"parse", b"{oops": b"parse", b"": b"parse", BAD[3]: b"decode"}

    # as a driver killed after its batches committed and before their dead letters were written leaves them
    redis.delete(job.dead_letter_stream, f"{job.dead_letter_stream}:seen")
    checkpoint = spec.checkpoint.removeprefix("file:")
    redis.set(MARKER_PREFIX + checkpoint, 0)
    sent.send(100, seed=5)
    run_to_end(spark, job, sent)
    assert sink_total(job) == sent.good == 700
    first = job.checkpoints.order_by("batch_id").first()
    missed = {p for p in sent.bad if p[1] >= kafka_offsets(first.end_offset)[topic][p[0]]}
    assert missed and places() == missed, "the batches after the marker were read again, and only those"
    assert int(redis.get(MARKER_PREFIX + checkpoint)) == job.checkpoints.order_by("-batch_id").first().batch_id


@pytest.mark.chaos
def test_a_kafka_team_job_rescaled_by_blue_green_hands_over_through_a_kill_of_green_alone_and_of_the_driver(
    make_job, redis, topic, celery_worker, spark, team_database, tmp_path
):
    """State partitions 2 → 3 on Kafka without stopping the output, green in a driver of its own: green killed with
    kill -9 while it follows (started again on its fork, it reads on through the range reader), an automatic handover
    once caught up, then kill -9 of green's driver, now the job's run (the job restarts on the repartitioned
    checkpoint with Spark's Kafka source). Every order once in every sink."""
    from tests.test_blue_green import ended, green_running, handed_over, one_line, running_team_job, state

    lake = tmp_path / "lake"
    job, orders, blue, flow = running_team_job(
        make_job, redis, topic, team_database, lake, "own", settings.KAFKA_BOOTSTRAP
    )
    try:
        action = action_request(job=job, kind=ActionKind.BLUE_GREEN,
                                params={"pipeline": job.pipeline, "state_partitions": 3, "auto": 1})  # fmt: skip
        first = wait_for(lambda: green_running(action), 300, 0.5, "green to follow the job")
        assert first.driver_host_id is None and first.pid, "green in a driver of its own"
        os.killpg(first.pid, signal.SIGKILL)
        again = wait_for(lambda: (r := green_running(action)) and r.id != first.id and r, 300, 0.5, "green again")
        handed_over(action, 900)
        os.killpg(again.pid, signal.SIGKILL)
        action = ended(action, 240)
    finally:
        flow.stop()
    assert action.status == ActionStatus.SUCCEEDED, state(action)
    job.refresh_from_db()
    assert job.state_partitions == 3 and job.checkpoint_dir == action.params["fork"] and blue.id != again.id
    wait_for(lambda: running_with_progress(job, again.id), 300, 0.5, "the job's restart on the new checkpoint")
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5, "every order in every sink")
    assert not (why := one_line(job, action)), why


@pytest.mark.chaos
def test_a_kafka_team_job_migrated_by_blue_green_keeps_its_hours_and_goes_on_in_days(
    make_job, redis, topic, celery_worker, spark, team_database, tmp_path
):
    """customer-spend → customer-spend-daily by blue/green on Kafka: green's migrated state, its batch 0 reading on
    from the savepoint's offsets per partition, promoted while the topic is quiet (no batch of blue's to compare: the
    handover comes after blue's newest); the hours blue wrote stay, and each day the orders after the handover touch
    holds its total over every order."""
    from tests.test_blue_green import ended, handed_over, running_team_job, state

    lake = tmp_path / "lake"
    job, orders, blue, flow = running_team_job(
        make_job, redis, topic, team_database, lake, "shared", settings.KAFKA_BOOTSTRAP
    )
    flow.stop()  # every order before the migration read by blue: the hours are theirs, the days every order's
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5, "blue to read every order")
    before = len(orders.sent)
    action = action_request(job=job, kind=ActionKind.BLUE_GREEN,
                            params={"pipeline": "customer-spend-daily", "migrate": 1})  # fmt: skip
    try:  # a quiet topic: green follows, with no batch of blue's to compare
        wait_for(lambda: Action.objects.get(id=action.id).step == "follow", 300, 0.5, "green to follow the job")
    except TimeoutError:
        raise AssertionError(state(action)) from None
    action.refresh_from_db()
    savepoint = job.savepoints.get(id=action.params["savepoint"])
    assert action.params["shift"] == -(savepoint.batch_id + 1)
    start = action.params["green_start"]
    assert kafka_offsets(json.loads(start) if isinstance(start, str) else start), start
    green_request(action, "promote")
    handed_over(action, 300)
    job.refresh_from_db()
    assert job.pipeline == "customer-spend-daily" and job.checkpoint_dir == action.params["fork"]
    assert Run.objects.get(id=blue.id).status != RunStatus.RUNNING
    daily_totals_go_on(spark, job, orders, team_database, lake, before)  # 30 orders more: green's first batches
    action = ended(action, 240)
    assert action.status == ActionStatus.SUCCEEDED, state(action)
