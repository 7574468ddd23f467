"""A checkpoint this console never recorded (an earlier console, or one on another database, ran the job in the same
directory): the job does not start on it until the operator decides (``checkpoint_unknown`` says why). Adopt it: the
job resumes from it, and its history is imported run by run from the journals the earlier runs wrote, each as a run
of its own, marked adopted. Or set it aside: the directory and its journals move beside it, kept, and the job starts
from nothing. Either is refused while a driver of the job is alive."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.db import transaction
from django.utils import timezone

from dashboard.checkpoint_dir.files import committed_batches
from dashboard.checkpoint_dir.journal import journal_parts
from dashboard.models import Job, Run, RunStatus
from dashboard.records import parse_time
from dashboard.services.checkpoints import checkpoint_record_ingest
from dashboard.services.errors import ActionRefused
from dashboard.services.run_waits import alive_run
from dashboard.services.runs import checkpoint_unknown


def _refuse_unless_unknown(job: Job) -> None:
    if not checkpoint_unknown(job):
        raise ActionRefused(f"{job.name}'s checkpoint is this console's own: there is nothing to adopt or set aside.")
    if (run := alive_run(job)) is not None:
        raise ActionRefused(f"{job.name} has run #{run.id} alive: stop it first; nothing was changed.")


def _stamp() -> str:
    return timezone.now().strftime("%Y%m%d-%H%M%S")


def checkpoint_adopt(job: Job) -> str:
    """Import the earlier runs' history from their journals (each journal becomes a run, marked adopted, with its
    batches as it recorded them) and let the job start on the checkpoint; the journals move to
    ``journal-adopted-<stamp>`` so that this console's own runs never read them as theirs. Returns what was done."""
    _refuse_unless_unknown(job)
    batches = committed_batches(job.checkpoint_location)
    journals = journal_parts(job.directory / "journal")
    imported = runs = 0
    with transaction.atomic():
        for number, parts in sorted(journals.items()):
            records = [r for part in parts for r in _records(part)]
            if not records:
                continue
            times = [parse_time(r["committed_at"]) for r in records]
            run = Run.objects.create(
                job=job, status=RunStatus.STOPPED, requested_at=min(times), started_at=min(times),
                ended_at=max(times), host="adopted",
                message=f"run #{number} of an earlier console, adopted with its checkpoint: batches "
                f"{records[0]['batch_id']}–{records[-1]['batch_id']} from {', '.join(p.name for p in parts)}",
            )  # fmt: skip
            runs += 1
            imported += sum(checkpoint_record_ingest(job_id=job.id, run_id=run.id, record=r) for r in records)
        if not runs:  # no journal: the history is lost, the checkpoint is still adopted, and that is on record
            now = timezone.now()
            Run.objects.create(
                job=job, status=RunStatus.STOPPED, requested_at=now, started_at=now, ended_at=now, host="adopted",
                message=f"checkpoint adopted without history: batches {batches[0]}–{batches[-1]}, no journal with a batch in it",
            )  # fmt: skip
    if journals:
        (job.directory / "journal").rename(job.directory / f"journal-adopted-{_stamp()}")
    return (
        f"Adopted {job.checkpoint_location} (batches {batches[0]}–{batches[-1]}): {imported} batch record(s) "
        f"imported from {runs} earlier run(s); the job resumes after batch {batches[-1]} at its next start."
    )


def checkpoint_set_aside(job: Job) -> str:
    """Move the unknown checkpoint and its journals beside the job's directory, kept; the job starts from nothing."""
    _refuse_unless_unknown(job)
    stamp = _stamp()
    aside = job.directory / f"{job.checkpoint_dir}-set-aside-{stamp}"
    job.checkpoint_location.rename(aside)
    journal = job.directory / "journal"
    if journal.is_dir():
        journal.rename(job.directory / f"journal-set-aside-{stamp}")
    return f"Set {job.checkpoint_location} aside as {aside}; {job.name} starts from nothing at its next start."


def _records(journal: Path) -> list[dict[str, Any]]:
    """The batch records of one journal, in order; a line cut short by a kill is skipped."""
    found = []
    with open(journal, errors="replace") as lines:
        for line in lines:
            try:
                record = json.loads(line)["record"]
                if isinstance(record, dict) and "batch_id" in record and "committed_at" in record:
                    found.append(record)
            except (ValueError, KeyError, TypeError):
                continue
    return found
