"""Checkpoint storage accounting: every byte under a job's directory, in exactly one category, so the total equals
`du -sb` of the directory; what each retention setting would reclaim; and orphans, with a confirmed clean-up.

Categories: the live checkpoint's newest batch (and its metadata), the older batches it retains, savepoints, forks
left by restores, rollbacks and rescales, the progress journals, and orphans (what no checkpoint, savepoint or journal
refers to: a savepoint folder without a savepoint, a disposed savepoint's leftovers, stray files)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings

from dashboard.checkpoint_dir.disk import file_batch, scan
from dashboard.checkpoint_dir.files import CheckpointError, directory_bytes, latest_committed, remove_tree
from dashboard.models import Action, Job, SavepointStatus
from dashboard.services.errors import ActionFailed
from dashboard.services.run_waits import refuse_while_alive


@dataclass
class Entry:
    name: str  # relative to the job's directory
    size: int
    note: str = ""


@dataclass
class JobStorage:
    job: Job
    latest_batch: int | None
    live_bytes: int = 0  # the newest batch's files and the checkpoint's metadata
    retained_bytes: int = 0  # files of older batches the checkpoint keeps
    savepoints: list[Entry] = field(default_factory=list)
    forks: list[Entry] = field(default_factory=list)
    journal_bytes: int = 0
    orphans: list[Entry] = field(default_factory=list)
    by_batch: dict[int, int] = field(default_factory=dict)  # bytes of the live checkpoint per batch

    @property
    def total(self) -> int:
        return (
            self.live_bytes
            + self.retained_bytes
            + sum(e.size for e in self.savepoints)
            + sum(e.size for e in self.forks)
            + self.journal_bytes
            + sum(e.size for e in self.orphans)
        )

    def retention_reclaims(self, batches: int) -> int:
        """Bytes the live checkpoint would free keeping only the newest `batches` batches (files of a batch older
        than that; a memory-backend job's state also needs its newest snapshot, so this is an upper bound there)."""
        if self.latest_batch is None:
            return 0
        oldest_kept = self.latest_batch - batches + 1
        return sum(size for batch, size in self.by_batch.items() if batch < oldest_kept)

    def savepoint_reclaims(self, keep: int) -> int:
        """Bytes freed keeping only the newest `keep` savepoints."""
        kept = sorted((e for e in self.savepoints), key=lambda e: e.note, reverse=True)
        return sum(e.size for e in kept[keep:])


def job_storage(job: Job) -> JobStorage:
    root = job.directory
    live = job.checkpoint_location
    try:
        latest = latest_committed(live)
    except CheckpointError:
        latest = None
    result = JobStorage(job, latest)
    for relative, size in scan(live, temporaries=True).items():
        owner, _ = file_batch(relative.replace(os.sep, "/"))
        if owner is None or latest is None or owner >= latest:
            result.live_bytes += size
        else:
            result.retained_bytes += size
        if owner is not None:
            result.by_batch[owner] = result.by_batch.get(owner, 0) + size
    kept = {Path(sp.path).resolve(): sp for sp in job.savepoints.exclude(status=SavepointStatus.DISPOSED) if sp.path}
    if not root.is_dir():
        return result
    for entry in sorted(root.iterdir()):
        name = entry.name
        if entry.resolve() == live.resolve():
            continue
        if name == "journal":
            result.journal_bytes += directory_bytes(entry)
        elif name == "savepoints" and entry.is_dir():
            for folder in sorted(entry.iterdir()):
                savepoint = kept.get(folder.resolve())
                size = directory_bytes(folder)
                if savepoint is not None:
                    result.savepoints.append(Entry(f"savepoints/{folder.name}", size, savepoint.created_at.isoformat()))
                else:
                    result.orphans.append(Entry(f"savepoints/{folder.name}", size, "no savepoint refers to it"))
        elif name.startswith("checkpoint") and entry.is_dir() and (entry / "commits").is_dir():
            result.forks.append(Entry(name, directory_bytes(entry), "left by a restore, rollback or rescale"))
        else:
            result.orphans.append(Entry(name, directory_bytes(entry), "not a checkpoint, savepoint or journal"))
    return result


def orphan_jobs() -> list[Entry]:
    """Directories under the checkpoint root of jobs that no longer exist."""
    root = settings.CHECKPOINT_ROOT
    if not root.is_dir():
        return []
    names = set(Job.objects.values_list("name", flat=True))
    return [
        Entry(p.name, directory_bytes(p), "no job of this name") for p in sorted(root.iterdir()) if p.name not in names
    ]


def clean_orphans_action(action: Action) -> str:
    """Delete the orphans the operator confirmed, each only if it is still an orphan now and inside the job's
    directory."""
    job = action.job
    refuse_while_alive(job, "removing orphaned files")
    confirmed = [str(n) for n in action.params.get("orphans", [])]
    if not confirmed:
        raise ActionFailed("No orphan was confirmed; nothing was deleted.")
    now = {e.name: e for e in job_storage(job).orphans}
    freed, removed, skipped = 0, [], []
    for name in confirmed:
        entry = now.get(name)
        target = (job.directory / name).resolve()
        if entry is None or job.directory.resolve() not in target.parents:
            skipped.append(name)
            continue
        if target.is_dir():
            remove_tree(target)
        else:
            target.unlink(missing_ok=True)
        freed += entry.size
        removed.append(name)
    text = f"Removed {len(removed)} orphan(s), {freed} bytes: {', '.join(removed) or 'none'}."
    if skipped:
        text += f" Left alone (no longer orphans, or outside the job's directory): {', '.join(skipped)}."
    return text
