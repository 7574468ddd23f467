"""Checkpoint records survive a console restart and a Redis restart: none lost, none duplicated, in order."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from django.conf import settings

from dashboard.checkpoint_dir.disk import CheckpointDisk, Measurement, file_batch
from dashboard.checkpoint_dir.journal import journal_parts, journals_expire, unread_lines
from dashboard.models import Checkpoint, Run
from dashboard.records import checkpoint_record, is_commit
from dashboard.services.checkpoints import journal_path, journal_reconcile, progress_stream_ingest
from workers.progress import ProgressRecorder

pytestmark = pytest.mark.django_db


def progress(batch: int, rows: int = 10, latest: int = 100) -> dict:
    return {
        "id": "q",
        "batchId": batch,
        "timestamp": f"2026-11-21T10:00:{batch:02d}.000Z",
        "numInputRows": rows,
        "inputRowsPerSecond": 5.0,
        "processedRowsPerSecond": "NaN",
        "durationMs": {"addBatch": 40, "triggerExecution": 90, "walCommit": 10, "commitOffsets": 8},
        "stateOperators": [
            {"numRowsTotal": 7, "numRowsUpdated": 3, "numRowsRemoved": 1, "memoryUsedBytes": 4096, "commitTimeMs": 12}
        ],
        "sources": [
            {
                "startOffset": json.dumps({"id": "1-0", "n": batch * rows}),
                "endOffset": json.dumps({"id": "2-0", "n": (batch + 1) * rows}),
                "latestOffset": json.dumps({"id": "9-0", "n": latest}),
            }
        ],
    }


def recorder_for(job, run, checkpoint: Path, store: bool = False) -> ProgressRecorder:
    """A driver's recorder; by default one that does not store its records itself (as when the console's database
    did not answer it), so that what the ingest does is seen."""
    return ProgressRecorder(
        store=store,
        job_id=job.id,
        run_id=run.id,
        checkpoint=checkpoint,
        journal=journal_path(job=job, run_id=run.id),
        redis_url=settings.REDIS_URL,
        stream=settings.PROGRESS_STREAM,
    )


def test_a_record_carries_lag_durations_and_state(tmp_path):
    record = checkpoint_record(progress(3, rows=10, latest=100), Measurement(120, 4000, False))
    assert record["lag_records"] == 100 - 40
    assert (record["duration_ms"], record["add_batch_ms"], record["state_commit_ms"]) == (90, 40, 12)
    assert record["processed_rate"] == 0.0, "NaN is no rate"
    assert (record["state_rows_total"], record["state_memory_bytes"]) == (7, 4096)
    assert (record["checkpointed_bytes"], record["full_size_bytes"], record["kind"]) == (120, 4000, "incremental")


def test_idle_trigger_progress_is_not_a_checkpoint():
    idle = progress(5)
    idle["durationMs"] = {"latestOffset": 3, "triggerExecution": 3}
    assert not is_commit(idle)


def test_records_are_ingested_once_in_order(make_job, redis, tmp_path):
    job = make_job()
    run = Run.objects.create(job=job, status="running")
    recorder = recorder_for(job, run, tmp_path / "checkpoint")
    for batch in range(5):
        recorder.on_progress(progress(batch))
    recorder.on_progress(progress(4))  # a duplicate event for the same batch
    redis.xadd(settings.PROGRESS_STREAM, {"data": "{not json"})

    assert progress_stream_ingest(client=redis) == 5
    assert progress_stream_ingest(client=redis) == 0
    assert list(Checkpoint.objects.filter(job=job).order_by("id").values_list("batch_id", flat=True)) == [0, 1, 2, 3, 4]
    job.refresh_from_db()
    assert job.latest_checkpoint.batch_id == 4
    assert redis.xlen(settings.PROGRESS_STREAM) == 0, "ingested entries leave the buffer"


def test_a_restart_on_a_blue_green_checkpoint_does_not_record_again_the_batches_the_old_version_ran(
    make_job, redis, tmp_path
):
    """The new version killed just after the handover, before it committed the old version's last batch: its restart
    replays that batch (writing no sink), and the job's history keeps it once, the old version's."""
    from dashboard.checkpoint_dir.files import mark_handed_over

    job = make_job()
    run = Run.objects.create(job=job, status="running")
    fork = tmp_path / "checkpoint-green-7"
    fork.mkdir()
    mark_handed_over(fork, 4)
    recorder = recorder_for(job, run, fork, store=True)
    for batch in (4, 5, 6):
        recorder.on_progress(progress(batch))
    assert list(Checkpoint.objects.filter(job=job).order_by("id").values_list("batch_id", flat=True)) == [5, 6]


def test_a_driver_stores_each_commit_at_once_and_the_ingest_adds_no_duplicate(make_job, redis, tmp_path):
    job = make_job()
    run = Run.objects.create(job=job, status="running")
    recorder = recorder_for(job, run, tmp_path / "checkpoint", store=True)
    for batch in range(3):
        recorder.on_progress(progress(batch))
        assert Checkpoint.objects.filter(job=job, batch_id=batch).exists(), "stored without waiting for the beat"
    recorder.on_progress(progress(2))  # a duplicate event for the same batch
    assert progress_stream_ingest(client=redis) == 0
    assert list(Checkpoint.objects.filter(job=job).order_by("id").values_list("batch_id", flat=True)) == [0, 1, 2]
    job.refresh_from_db()
    assert job.latest_checkpoint.batch_id == 2
    assert redis.xlen(settings.PROGRESS_STREAM) == 0


def test_entries_read_by_a_crashed_ingester_are_ingested_by_the_next(make_job, redis, tmp_path):
    job = make_job()
    run = Run.objects.create(job=job, status="running")
    recorder = recorder_for(job, run, tmp_path / "checkpoint")
    for batch in range(3):
        recorder.on_progress(progress(batch))
    redis.xgroup_create(settings.PROGRESS_STREAM, "console", id="0")
    redis.xreadgroup("console", "crashed", {settings.PROGRESS_STREAM: ">"}, count=10)  # read, never acknowledged

    progress_stream_ingest(client=redis, consumer="crashed")
    assert Checkpoint.objects.filter(job=job).count() == 3


def test_what_redis_lost_is_recovered_from_the_journal(make_job, redis, tmp_path):
    job = make_job()
    run = Run.objects.create(job=job, status="running")
    recorder = recorder_for(job, run, tmp_path / "checkpoint")
    for batch in range(3):
        recorder.on_progress(progress(batch))
    progress_stream_ingest(client=redis)
    for batch in range(3, 6):
        recorder.on_progress(progress(batch))
    redis.flushdb()  # a Redis restart: everything not yet ingested is gone
    with open(journal_path(job=job, run_id=run.id), "a") as journal:
        journal.write('{"job": 1, "run": 1, "rec')  # a line cut short by a kill

    assert journal_reconcile(job=job, run_id=run.id) == 3
    assert journal_reconcile(job=job, run_id=run.id) == 0
    assert list(Checkpoint.objects.filter(job=job).order_by("batch_id").values_list("batch_id", flat=True)) == list(
        range(6)
    )


def test_progress_is_journaled_even_when_redis_is_unreachable(make_job, tmp_path):
    job = make_job()
    run = Run.objects.create(job=job, status="running")
    recorder = ProgressRecorder(
        job_id=job.id,
        run_id=run.id,
        checkpoint=tmp_path / "checkpoint",
        journal=journal_path(job=job, run_id=run.id),
        redis_url="redis://127.0.0.1:1/0",
        stream=settings.PROGRESS_STREAM,
        store=False,  # and the database did not answer either: the journal is what is left
    )
    assert recorder.on_progress(progress(0)) is not None
    assert journal_reconcile(job=job, run_id=run.id) == 1


def test_files_are_attributed_to_the_batch_that_wrote_them(tmp_path):
    assert file_batch("offsets/7") == (7, False)
    assert file_batch("commits/.7.crc") == (7, False)
    assert file_batch("state/0/1/8.delta") == (7, False)
    assert file_batch("state/0/1/11.snapshot") == (10, True)
    assert file_batch("state/0/0/12_0b7f6a1c-33aa-4d1e-9e2f-1234567890ab.zip") == (11, True)
    assert file_batch("state/0/0/SSTs/000123-abcd.sst") == (None, False)
    assert file_batch("metadata") == (None, False)

    disk = CheckpointDisk(tmp_path)
    (tmp_path / "offsets").mkdir()
    (tmp_path / "offsets" / "0").write_bytes(b"x" * 10)
    (tmp_path / "offsets" / "1").write_bytes(b"x" * 5)  # the next batch, already in flight
    (tmp_path / "metadata").write_bytes(b"x" * 3)
    first = disk.measure(0)
    assert (first.added_bytes, first.full_bytes) == (13, 13)
    second = disk.measure(1)
    assert (second.added_bytes, second.full_bytes) == (5, 18)


def test_a_journal_is_read_once_so_an_aged_out_record_is_not_recorded_again_and_rotated_parts_expire(
    make_job, redis, tmp_path
):
    """A run of weeks: each reconcile reads only what was appended since the last; a record the raw retention removed
    is not brought back from the journal (it would be counted twice in the roll-ups); the journal is rotated once read
    past its size and the rotated parts, and ended runs' journals, expire with the raw retention."""
    job = make_job()
    run = Run.objects.create(job=job, status="running")
    recorder = recorder_for(job, run, tmp_path / "checkpoint")
    journal = journal_path(job=job, run_id=run.id)
    for batch in range(3):
        recorder.on_progress(progress(batch))
    assert journal_reconcile(job=job, run_id=run.id) == 3
    Checkpoint.objects.filter(job=job, batch_id__lt=2).delete()  # aged out of the raw retention
    assert journal_reconcile(job=job, run_id=run.id) == 0, "nothing appended since: nothing read, nothing brought back"
    recorder.on_progress(progress(3))
    with open(journal, "a") as out:
        out.write('{"job": 1, "run": 1, "rec')  # the driver is mid-line
    assert journal_reconcile(job=job, run_id=run.id) == 1
    assert sorted(Checkpoint.objects.filter(job=job).values_list("batch_id", flat=True)) == [2, 3]

    # read past its size, the journal is rotated; the driver's next line starts a new part; both are the run's
    with unread_lines(journal, rotate_bytes=10) as lines:
        assert lines == [], "the cut line is not yet whole"
    journal.write_text(journal.read_text().rsplit("\n", 1)[0] + "\n")  # (the cut line gone, as if never written)
    with unread_lines(journal, rotate_bytes=10) as lines:
        assert lines == []
    assert not journal.exists() and len(list(journal.parent.glob("*.jsonl.done"))) == 1
    recorder.on_progress(progress(4))
    parts = journal_parts(journal.parent)[run.id]
    assert [p.name.endswith(".done") for p in parts] == [True, False]
    assert journal_reconcile(job=job, run_id=run.id) == 1

    # the rotated part and an ended run's journal expire after the retention; the running run's current part stays
    ended = journal.with_name("run-999999.jsonl")
    ended.write_text(journal.read_text())
    old = time.time() - 4 * 86400
    for path in (parts[0], ended, journal):
        os.utime(path, (old, old))
    assert journals_expire(journal.parent, 72 * 3600, active_runs={run.id}) == 2
    assert journal.exists() and not parts[0].exists() and not ended.exists()
