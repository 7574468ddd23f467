"""Recording checkpoints: from the progress stream in Redis, and from the drivers' journals for anything it lost."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q

from dashboard.checkpoint_dir.journal import unread_lines
from dashboard.models import Checkpoint, Job, Run
from dashboard.records import parse_time

log = logging.getLogger(__name__)
GROUP = "console"


def checkpoint_record_ingest(*, job_id: int, run_id: int | None, record: dict[str, Any]) -> bool:
    """Store one checkpoint record; False if this batch is already recorded (a replayed entry)."""
    fields = {k: v for k, v in record.items() if k not in ("batch_id", "committed_at")}
    try:
        with transaction.atomic():
            if run_id is not None and not Run.objects.filter(id=run_id).exists():
                run_id = None
            checkpoint = Checkpoint.objects.create(
                job_id=job_id,
                run_id=run_id,
                batch_id=record["batch_id"],
                committed_at=parse_time(record["committed_at"]),
                **fields,
            )
            # the job's latest checkpoint is the newest batch of the directory it runs on now (forks restart lower)
            Job.objects.filter(id=job_id, checkpoint_dir=checkpoint.location).filter(
                Q(latest_checkpoint__isnull=True)
                | ~Q(latest_checkpoint__location=checkpoint.location)
                | Q(latest_checkpoint__batch_id__lt=checkpoint.batch_id)
            ).update(latest_checkpoint=checkpoint)
    except IntegrityError:
        return False
    return True


def _ingest_lines(entries: Iterable[tuple[Any, bytes | str]]) -> tuple[int, list[Any]]:
    created, done = 0, []
    for entry_id, raw in entries:
        try:
            data = json.loads(raw)
            job_id, record = int(data["job"]), data["record"]
        except (ValueError, KeyError, TypeError) as exc:
            log.error("dropping malformed progress entry %s: %s", entry_id, exc)
            done.append(entry_id)
            continue
        if not Job.objects.filter(id=job_id).exists():
            done.append(entry_id)  # the job was deleted: nothing to record it against
            continue
        created += checkpoint_record_ingest(job_id=job_id, run_id=data.get("run"), record=record)
        done.append(entry_id)
    return created, done


def progress_stream_ingest(*, client: Any, consumer: str = "ingest", count: int = 1000) -> int:
    """Ingest what the drivers pushed, oldest first; an entry is acknowledged only after it is stored."""
    stream = settings.PROGRESS_STREAM
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except Exception as exc:
        if "BUSYGROUP" not in str(exc):
            raise
    created = 0
    for start in ("0", ">"):  # first what an earlier ingester read and did not acknowledge, then what is new
        while True:
            reply = client.xreadgroup(GROUP, consumer, {stream: start}, count=count)
            entries = reply[0][1] if reply else []
            entries = [(eid, fields.get(b"data") or fields.get("data") or b"") for eid, fields in entries]
            if not entries:
                break
            made, done = _ingest_lines(entries)
            created += made
            if done:
                client.xack(stream, GROUP, *done)
                client.xdel(stream, *done)
            if start == "0" and len(entries) < count:
                break
    return created


def journal_path(*, job: Job, run_id: int) -> Path:
    return job.directory / "journal" / f"run-{run_id}.jsonl"


def journal_reconcile(*, job: Job, run_id: int) -> int:
    """Ingest the batches a run journaled that the console has not recorded (lost with Redis, say): the lines written
    since the last reconcile, never the whole journal again (see checkpoint_dir/journal.py)."""
    with unread_lines(journal_path(job=job, run_id=run_id)) as lines:
        records = []
        for number, line in enumerate(lines):
            try:
                record = json.loads(line).get("record", {})
                records.append((number, line, record.get("location", "checkpoint"), int(record.get("batch_id"))))
            except (ValueError, TypeError, AttributeError):
                continue  # a damaged line: its batch is in the next line or was never committed
        batches = {batch for _, _, _, batch in records}
        known = set(
            Checkpoint.objects.filter(job=job, batch_id__in=batches).values_list("location", "batch_id")
        ) if batches else set()  # fmt: skip
        created = 0
        for number, line, location, batch in records:
            if (location, batch) not in known:
                made, _ = _ingest_lines([(number, line)])
                created += made
    return created
