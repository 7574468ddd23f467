"""A real job on the shared SparkSession, real Redis and PostgreSQL: counts, restarts, dead letters, bytes on disk."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from django.db.models import Sum
from pyspark.sql import Row
from pyspark.sql.streaming.tws_tester import TwsTester

from dashboard.checkpoint_dir.files import closing_file
from dashboard.models import Checkpoint, ResultRow, RunStatus
from dashboard.services.checkpoints import progress_stream_ingest
from dashboard.services.runs import job_request_stop
from tests.conftest import DriverThread, read_through, run_through, send_events, wait_for
from workers.spark.pipelines import order_state_machine
from workers.spark.state_tool import FORMAT_VERSION, answer

pytestmark = [pytest.mark.spark, pytest.mark.django_db(transaction=True)]


def sink_total(job: Any) -> int:
    return sum(row.value["requests"] for row in ResultRow.objects.filter(job=job, kind="url"))


def du_bytes(path: Any) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_checkpoints_add_up_to_the_events_sent(make_job, start_driver, redis, stream_name):
    job = make_job(max_records_per_batch=700)
    sent = send_events(redis, stream_name, "url-counts", 2500)
    assert run_through(start_driver(job), redis, sent) == RunStatus.STOPPED

    checkpoints = list(Checkpoint.objects.filter(job=job).order_by("batch_id"))
    assert sum(c.input_rows for c in checkpoints) == sent
    assert [c.batch_id for c in checkpoints] == list(range(len(checkpoints)))
    assert max(c.input_rows for c in checkpoints) <= 700, "admission control: max records per batch"
    assert len(checkpoints) >= 4
    assert sink_total(job) == sent
    assert checkpoints[-1].lag_records == 0
    assert checkpoints[0].lag_records == sent - checkpoints[0].input_rows
    assert checkpoints[-1].end_offset["n"] == sent
    job.refresh_from_db()
    assert job.latest_checkpoint == checkpoints[-1]
    # the run's heartbeats carried its driver JVM's heap: what live objects held after a collection, of its maximum
    run = job.runs.get()
    assert run.heap_max_bytes is not None and 0.5 * 2**30 <= run.heap_max_bytes <= 2**30, "the driver's 1g heap"
    assert run.heap_after_gc_bytes is not None and 2**20 < run.heap_after_gc_bytes < run.heap_max_bytes


def test_stop_and_restart_resume_exactly(make_job, start_driver, redis, stream_name):
    job = make_job()
    first = send_events(redis, stream_name, "url-counts", 1200, seed=1)
    assert run_through(start_driver(job), redis, 600) == RunStatus.STOPPED
    second = send_events(redis, stream_name, "url-counts", 900, seed=2)

    run_through(start_driver(job), redis, first + second)

    assert sink_total(job) == first + second, "nothing lost, nothing counted twice across the restart"
    batch_ids = list(Checkpoint.objects.filter(job=job).order_by("batch_id").values_list("batch_id", flat=True))
    assert batch_ids == list(range(len(batch_ids)))
    assert Checkpoint.objects.filter(job=job).aggregate(n=Sum("input_rows"))["n"] == first + second
    assert job.runs.count() == 2


def test_a_job_behind_its_trigger_stops_after_the_batch_in_flight_and_its_restart_loses_nothing(
    make_job, start_driver, redis, stream_name
):
    # a backlog read 60 entries a batch, on a 0.1 s trigger: each batch starts as the last commits, so the query is
    # never seen between batches; a stop must not wait for the backlog (or the grace period) to run out
    job = make_job(max_records_per_batch=60, trigger_interval_seconds=0.1)
    sent = send_events(redis, stream_name, "url-counts", 6000)
    driver = start_driver(job)
    wait_for(lambda: read_through(job, redis, 120), 120, what="two batches")

    assert driver.stop() == RunStatus.STOPPED
    driver.run.refresh_from_db()
    assert driver.run.message == "Stopped on request after the batch in flight committed."
    progress_stream_ingest(client=redis)
    read = Checkpoint.objects.filter(job=job).aggregate(n=Sum("input_rows"))["n"]
    assert read < sent / 2, "stopped with the backlog still waiting, not once it ran out"
    assert sink_total(job) == read

    job.max_records_per_batch = 2000
    job.save(update_fields=["max_records_per_batch"])
    run_through(start_driver(job), redis, sent)
    assert sink_total(job) == sent, "the interrupted batch replayed once: nothing lost, nothing counted twice"
    batch_ids = list(Checkpoint.objects.filter(job=job).order_by("batch_id").values_list("batch_id", flat=True))
    assert batch_ids == list(range(len(batch_ids)))


def test_a_stop_reaches_a_driver_of_its_own_without_waiting_for_its_lease_renewal(
    make_job, start_driver, redis, stream_name, settings
):
    # the driver beats and renews its lease every LEASE_RENEW seconds; a stop request (an upgrade's, a rescale's) is
    # looked for far more often, so an action that stops the job does not wait out the renewal interval
    settings.LEASE_RENEW_SECONDS, settings.LEASE_TTL_SECONDS = 60, 180
    job = make_job()
    sent = send_events(redis, stream_name, "url-counts", 50)
    driver = start_driver(job)
    wait_for(lambda: read_through(job, redis, sent), 120, what="the events read")
    job_request_stop(job=job)
    driver.thread.join(20)
    assert not driver.thread.is_alive(), "the stop waited for the lease's renewal (60 s)"
    assert driver.status == RunStatus.STOPPED


def test_a_spread_job_stopped_between_batches_takes_what_arrived_in_a_last_batch(spark, make_job, redis, stream_name):
    # a spread job (the shared driver gives it a phase) admits new entries once an interval, at its phase; stopped
    # between two, it runs one more batch at once over what has arrived, so the next run (an upgrade's, a rescale's)
    # starts right after a commit rather than an interval's worth of events behind
    job = make_job(trigger_interval_seconds=30, parallelism=1)
    first = send_events(redis, stream_name, "url-counts", 40, seed=1)
    driver = DriverThread(spark, job, phase_seconds=0.0)
    try:
        wait_for(lambda: read_through(job, redis, first), 120, what="the first batch")
        assert driver.driver.spread, "a Redis stream job given a phase is spread"
        second = send_events(redis, stream_name, "url-counts", 25, seed=2)
        assert driver.stop() == RunStatus.STOPPED
    finally:
        driver.driver.stop_signal.set()
    progress_stream_ingest(client=redis)
    assert sink_total(job) == first + second, "the events after the last phase were read before the stop"
    assert Checkpoint.objects.filter(job=job).aggregate(n=Sum("input_rows"))["n"] == first + second
    assert not closing_file(job.checkpoint_location).exists()


def test_malformed_events_go_to_the_dead_letter_stream_and_the_job_keeps_running(
    make_job, start_driver, redis, stream_name
):
    job = make_job()
    garbage = ["not a log line", "GET /api/a", '"quoted"']
    sent = send_events(redis, stream_name, "url-counts", 600, malformed=garbage)
    redis.xadd(stream_name, {"other": "no v field"})
    driver = start_driver(job)
    entries = sent + len(garbage) + 1
    wait_for(lambda: read_through(job, redis, entries), 120, what="the bad entries to be read")
    more = send_events(redis, stream_name, "url-counts", 300, seed=3)
    run_through(driver, redis, entries + more)

    dead = redis.xrange(job.dead_letter_stream)
    assert len(dead) == 4
    reasons = {entry[b"payload"].decode(): entry[b"reason"].decode() for _, entry in dead}
    assert reasons["not a log line"] == "line does not match the expected format"
    assert reasons['{"other": "no v field"}'] == "entry has no 'v' field"
    assert sink_total(job) == sent + more


def test_checkpointed_bytes_equal_the_bytes_that_appeared_on_disk(make_job, start_driver, redis, stream_name):
    job = make_job(max_records_per_batch=400)
    sent = send_events(redis, stream_name, "url-counts", 2000)
    run_through(start_driver(job), redis, sent)

    checkpoints = list(Checkpoint.objects.filter(job=job).order_by("batch_id"))
    on_disk = du_bytes(job.checkpoint_location)
    # nothing is deleted within the retained batches: every byte on disk was added by exactly one checkpoint
    assert sum(c.checkpointed_bytes for c in checkpoints) == on_disk
    assert checkpoints[-1].full_size_bytes == on_disk
    for before, after in zip(checkpoints, checkpoints[1:], strict=False):
        assert after.full_size_bytes == before.full_size_bytes + after.checkpointed_bytes
        assert after.checkpointed_bytes > 0

    # per state partition: every partition of the aggregation, its bytes those of its directory, and a commit time
    # within the batch
    last = checkpoints[-1]
    assert [(p["op"], p["part"]) for p in last.partitions] == [(0, n) for n in range(job.state_partitions)]
    for p in last.partitions:
        assert p["bytes"] == du_bytes(job.checkpoint_location / "state" / "0" / str(p["part"]))
    committed = [p["commit_ms"] for p in last.partitions if p["commit_ms"] is not None]
    assert len(committed) == job.state_partitions, "each partition wrote this batch's state version"
    assert all(0 <= ms <= last.duration_ms + 1000 for ms in committed)


def per_order_results(redis: Any, stream: str) -> dict[tuple[str, str], Any]:
    """What order-state-machine's processor makes of the stream, one key per order, on PySpark's in-memory state."""
    tester = TwsTester(order_state_machine.OrderStateMachine())
    rows = []
    for entry_id, fields in redis.xrange(stream):
        event = json.loads(fields[b"v"])
        rows.append(Row(order_id=event["order_id"], event=event["event"], ts=event["ts"], _id=entry_id.decode()))
    out = []
    for order_id in dict.fromkeys(r["order_id"] for r in rows):
        out += tester.test(order_id, [r for r in rows if r["order_id"] == order_id])
    return {(kind, key): value for kind, key, value in order_state_machine.results(out)}


def test_the_bucketed_order_state_machine_writes_what_the_per_order_one_does(
    make_job, start_driver, redis, stream_name, spark
):
    """order-state-machine-v2 keeps orders in MapStates of hash buckets: on real RocksDB state, over batches, the same
    results as one key per order, and the inspector finds an open order by its id inside its bucket."""
    sent = send_events(redis, stream_name, "order-state-machine", 1200, seed=5)
    job = make_job(pipeline="order-state-machine-v2", state_backend="rocksdb", max_records_per_batch=200)
    run_through(start_driver(job), redis, sent)

    results = {(r.kind, r.key): r.value for r in ResultRow.objects.filter(job=job)}
    expected = per_order_results(redis, stream_name)
    assert results == expected
    assert any(kind == "alert" for kind, _ in results)
    open_orders = sorted(key for (kind, key), v in expected.items()
                         if kind == "order" and v["state"] not in ("delivered", "cancelled"))  # fmt: skip
    assert open_orders, "the generator leaves orders open"
    last = Checkpoint.objects.filter(job=job).order_by("-batch_id").first()
    assert last.batch_id >= 5, "several batches: orders carried from one to the next"
    before = spark.conf.get(FORMAT_VERSION, None)
    try:
        found = answer(spark, "inspect", str(job.checkpoint_location), last.batch_id,
                       {"mode": "lookup", "operator": 0, "variable": "orders", "text": f'"{open_orders[0]}"'})  # fmt: skip
        held = answer(spark, "inspect", str(job.checkpoint_location), last.batch_id,
                      {"mode": "keys", "operator": 0, "variable": "orders", "limit": 500})  # fmt: skip
    finally:
        if before is not None:
            spark.conf.set(FORMAT_VERSION, before)
    assert found["total"] == 1 and json.loads(found["rows"][0]["key"])["order_id"] == open_orders[0]
    assert sorted(json.loads(r["key"])["order_id"] for r in held["rows"]) == open_orders


def test_rocksdb_incremental_job_records_full_and_incremental_checkpoints(make_job, start_driver, redis, stream_name):
    job = make_job(pipeline="order-state-machine", state_backend="rocksdb-incremental", max_records_per_batch=300)
    sent = send_events(redis, stream_name, "order-state-machine", 1500)
    run_through(start_driver(job), redis, sent)

    checkpoints = list(Checkpoint.objects.filter(job=job).order_by("batch_id"))
    assert sum(c.input_rows for c in checkpoints) == sent
    assert {c.kind for c in checkpoints} == {"full", "incremental"}
    assert checkpoints[0].kind == "full", "the first RocksDB version is a snapshot; changelogs follow"
    assert ResultRow.objects.filter(job=job, kind="alert").exists(), "cancel after accepted raises alerts"
    assert checkpoints[-1].state_rows_total > 0, "the open orders are in the state, and the record says how many"
    orders = ResultRow.objects.filter(job=job, kind="order")
    closed = orders.filter(value__state__in=["delivered", "cancelled"]).count()
    assert checkpoints[-1].state_rows_total == orders.count() - closed, "terminal orders clear their state"


def stale_checksum(spark: Any, path: Any) -> None:
    """Give ``path`` a `.crc` side file that Hadoop's checksummed local file system writes, for other content: what a
    file rewritten without its side file (a replayed batch's state delta) is left with."""
    content = path.read_bytes()
    jvm = spark._jvm
    conf = spark._jsc.hadoopConfiguration()
    local = jvm.org.apache.hadoop.fs.FileSystem.getLocal(conf)
    out = local.create(jvm.org.apache.hadoop.fs.Path(f"file:{path}"), True)
    out.write(bytearray(content + b"older content"))
    out.close()
    path.write_bytes(content)
    assert (path.parent / f".{path.name}.crc").exists()


def test_a_memory_job_drops_stale_checksums_so_its_checkpoint_reads_through_hadoop_checksums(
    make_job, start_driver, redis, stream_name, spark
):
    """A memory-backend job writes its checkpoint without `.crc` side files; one left from before (a checkpoint written
    by an earlier version, or restored) no longer matches a file rewritten since, and a read through Hadoop's
    checksummed file system (the state reader's, a savepoint verification's) fails on it. The driver removes them
    before its query starts."""
    job = make_job()
    first = send_events(redis, stream_name, "url-counts", 300, seed=1)
    run_through(start_driver(job), redis, first)
    root = job.checkpoint_location
    files = [p for p in (root / "state").rglob("*.delta") if p.stat().st_size] + sorted(
        (root / "offsets").glob("[0-9]*")
    )
    for path in files:
        stale_checksum(spark, path)
    reader = spark.newSession()  # the context's file system: checksummed
    with pytest.raises(Exception, match="FAILED_READ_FILE"):
        reader.read.text(str(files[-1])).collect()

    second = send_events(redis, stream_name, "url-counts", 200, seed=2)
    run_through(start_driver(job), redis, first + second)

    assert not list(root.rglob("*.crc"))
    assert reader.read.text(str(files[-1])).collect(), "the rewritten checkpoint reads through Hadoop's checksums"
    rows = reader.read.format("statestore").load(str(root)).collect()
    assert sum(r["value"][0] for r in rows) == first + second == sink_total(job)
