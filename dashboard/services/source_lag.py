"""Lag read from the source itself, on a beat (every few seconds), for every job: Redis' entries-added counter
against the job's committed offset, and the age of the oldest entry not yet read. Progress events say nothing while a
job is down or stalled; these samples keep lag true then, on the charts, the job list, /metrics and the alerts."""

from __future__ import annotations

import contextlib
import json
import logging
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeGuard

import redis
from django.conf import settings
from django.utils import timezone

from dashboard import kafka
from dashboard.checkpoint_dir.file_source import file_backlog
from dashboard.checkpoint_dir.files import CheckpointError, batch_offsets, committed_batches
from dashboard.connections import redis_client
from dashboard.engine.live import live_add, live_message
from dashboard.models import Job, SourceLag
from dashboard.selectors.lag import source_error_key
from dashboard.services.secrets import kafka_cluster

log = logging.getLogger(__name__)


def committed(job: Job) -> dict[str, Any]:
    """The job's committed source offset ({"id", "n"}): its latest checkpoint's end; before the job's first batch on
    the checkpoint directory it switched to (a rescale's or an upgrade's fork, a restore: the record is cleared at the
    switch), the newest committed batch's end offset in that directory; else the start of the stream. Without the
    directory's, the whole stream showed as lag from the switch to the new run's first batch (81,111 records and
    405 s on the demo stack, during a rescale)."""
    end = job.latest_checkpoint.end_offset if job.latest_checkpoint else None
    if not _an_offset(end):
        end = _on_disk(job)
    return end if _an_offset(end) else {"id": "0-0", "n": 0}


def _an_offset(end: Any) -> TypeGuard[dict[str, Any]]:
    return isinstance(end, dict) and "n" in end and "id" in end


def _on_disk(job: Job) -> Any:
    root = job.checkpoint_location
    try:
        batches = committed_batches(root)
        return batch_offsets(root, batches[-1])["sources"][0] if batches else None
    except (CheckpointError, OSError, IndexError):  # a damaged directory: the start of the stream, as before
        return None


def source_lag_sample(now: datetime | None = None) -> int:
    """Sample every job's source; two Redis round trips and one insert whatever the number of jobs."""
    now = now or timezone.now()
    every = list(Job.objects.select_related("latest_checkpoint"))
    jobs = [job for job in every if job.reads_redis]
    not_redis = [_file_sample(job, now) for job in every if job.reads_files]
    not_redis += [sample for job in every if job.reads_kafka and (sample := _kafka_sample(job, now))]
    if not_redis:
        SourceLag.objects.bulk_create(not_redis)
        _push(not_redis, now)
    if not jobs:
        return len(not_redis)
    client = redis_client(timeout=5)
    offsets = [committed(job) for job in jobs]
    pipe = client.pipeline(transaction=False)
    for job, offset in zip(jobs, offsets, strict=True):
        pipe.xinfo_stream(job.source_stream)
        pipe.xrange(job.source_stream, min=f"({offset['id']}", count=1)
    try:
        replies = pipe.execute(raise_on_error=False)
    except redis.RedisError as exc:
        log.warning("source lag not sampled: %s", exc)
        return 0
    samples = []
    for i, (job, offset) in enumerate(zip(jobs, offsets, strict=True)):
        info, first = replies[2 * i], replies[2 * i + 1]
        if isinstance(info, Exception):
            if "no such key" not in str(info).lower():
                continue  # the stream cannot be read now: no sample rather than a false one
            info = {"entries-added": 0}
        source_n = int(info["entries-added"])
        lag = max(0, source_n - int(offset["n"]))
        oldest = None
        if lag and isinstance(first, list) and first:
            first_ms = int(str(first[0][0].decode() if isinstance(first[0][0], bytes) else first[0][0]).split("-")[0])
            oldest = max(0.0, round(now.timestamp() - first_ms / 1000, 1))
        sample = SourceLag(
            job=job, sampled_at=now, source_n=source_n, committed_n=int(offset["n"]), lag_records=lag,
            lag_seconds=oldest if lag else 0.0,
        )  # fmt: skip
        samples.append(sample)
    SourceLag.objects.bulk_create(samples)
    _push(samples, now)
    if now.second < 5:  # about once a minute: samples older than the raw checkpoints' retention go
        SourceLag.objects.filter(sampled_at__lt=now - timedelta(hours=settings.CHECKPOINT_RAW_RETENTION_HOURS)).delete()
    return len(samples) + len(not_redis)


def _file_sample(job: Job, now: datetime) -> SourceLag:
    """A file source's backlog: files in its directory that no batch has taken yet, and their bytes."""
    backlog = file_backlog(Path(job.source_path), job.checkpoint_location)
    oldest = backlog.oldest_unread_mtime
    return SourceLag(
        job=job, sampled_at=now, source_n=backlog.files, committed_n=backlog.read, lag_records=backlog.unread,
        lag_seconds=max(0.0, round(now.timestamp() - oldest, 1)) if oldest is not None else 0.0,
        lag_bytes=backlog.unread_bytes,
    )  # fmt: skip


def _kafka_sample(job: Job, now: datetime) -> SourceLag | None:
    """A Kafka topic's backlog, per partition: the broker's end offsets against the newest committed batch's (from its
    checkpoint record, or the checkpoint directory after a switch), and the age of the oldest record not yet read. No
    sample when the broker does not answer or the topic is gone: the job's page says why from the failed sample's log,
    and the lag alerts see no false zero."""
    end = job.latest_checkpoint.end_offset if job.latest_checkpoint else None
    committed_at = kafka.offsets_of(end, job.source_stream) or kafka.offsets_of(_on_disk(job), job.source_stream)
    try:
        ends = kafka.end_offsets(cluster := kafka_cluster(job), job.source_stream, timeout=3)
        lag = kafka.lag_by_partition(ends, committed_at)
        waiting = {p: committed_at.get(p, ends[p][0]) for p, n in lag.items() if n}
        times = kafka.record_times(cluster, job.source_stream, waiting, timeout=3)
    except kafka.KafkaUnavailable as exc:
        log.warning("Kafka lag of %s not sampled: %s", job.name, exc)
        _source_failed(job, str(exc))
        return None
    _source_failed(job, "")
    partitions = {
        str(p): {
            "end": ends[p][1], "committed": committed_at.get(p, ends[p][0]), "lag": lag[p],
            "oldest_s": max(0.0, round(now.timestamp() - times[p], 1)) if p in times else None,
        }
        for p in sorted(ends)
    }  # fmt: skip
    total = sum(lag.values())
    ages = [v["oldest_s"] for v in partitions.values() if v["oldest_s"] is not None]
    return SourceLag(
        job=job, sampled_at=now, source_n=sum(e for _, e in ends.values()),
        committed_n=sum(v["committed"] for v in partitions.values()), lag_records=total,
        lag_seconds=max(ages) if total and ages else 0.0, partitions=partitions,
    )  # fmt: skip


def _source_failed(job: Job, error: str) -> None:
    """Keep why the job's source could not be sampled, and since when (two minutes after the last failure it is
    forgotten); an empty ``error`` clears it. The job's page says so beside the last sample's figures."""
    with contextlib.suppress(redis.RedisError):
        client, key = redis_client(timeout=5), source_error_key(job.id)
        if not error:
            client.delete(key)
            return
        since = json.loads(client.get(key) or "{}").get("since") or timezone.now().isoformat()
        client.set(key, json.dumps({"error": error, "since": since}), ex=120)


def _push(samples: list[SourceLag], now: datetime) -> None:
    """The samples to the live stream; the page reads them from the database on its next load if Redis is down."""
    with contextlib.suppress(redis.RedisError):
        pushed = redis_client(timeout=5).pipeline(transaction=False)
        for sample in samples:
            source = {"t": now.isoformat(), "lag": sample.lag_records, "age": sample.lag_seconds}
            live_add(pushed, settings.LIVE_STREAM, live_message(sample.job_id, source=source))
        pushed.execute()
