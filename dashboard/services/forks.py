"""Restore from a savepoint and roll back to a committed batch. Both fork into a new checkpoint directory and switch
the job to it; the original directory stays untouched until the operator discards it."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from django.db.models import Avg
from django.utils import timezone

from dashboard import kafka
from dashboard.checkpoint_dir.disk import state_version
from dashboard.checkpoint_dir.files import (
    CheckpointError,
    batch_offsets,
    committed_batches,
    copy_checkpoint,
    directory_bytes,
    remove_tree,
    verify_files,
)
from dashboard.models import Action, Checkpoint, Job, Run, Savepoint, SavepointStatus
from dashboard.selectors.lag import stream_head
from dashboard.services.action_keys import SPARK_READS, STARTED, Keys, action_progress, memo_save, remember
from dashboard.services.action_steps import Done, Next, NoneType, Outcome, Steps, Wait
from dashboard.services.errors import ActionFailed
from dashboard.services.run_waits import active_run, refuse_while_alive, settled, start_once
from dashboard.services.savepoints import MANIFEST
from dashboard.services.secrets import kafka_cluster
from dashboard.services.state_reader_client import state_read


@dataclass
class Preview:
    """What a restore or rollback would do, shown before the operator confirms."""

    batch_id: int
    committed_at: datetime | None
    resume_offset: dict[str, Any] | None
    replay_records: int | None
    catch_up_seconds: float | None
    refusal: str = ""

    @property
    def age_seconds(self) -> float | None:
        return (timezone.now() - self.committed_at).total_seconds() if self.committed_at else None


def fork_name(action: Action, purpose: str) -> str:
    """The directory an action forks the job's checkpoint into, under the job's directory: ``checkpoint-<purpose>-<id>``
    (restore, rollback, rescale, upgrade, upgrade-rollback), one per action, so that a retried step finds its own."""
    return f"checkpoint-{purpose}-{action.id}"


def preview(job: Job, batch_id: int, offset: dict[str, Any] | None, committed_at: datetime | None) -> Preview:
    result = Preview(batch_id, committed_at, offset, None, None)
    if job.reads_kafka:
        _kafka_replay(job, offset, result)
    elif not job.reads_redis:  # files stay in their directory: nothing to count here
        return result
    else:
        numbers = stream_head(job.source_stream)
        if numbers is None or not isinstance(offset, dict) or "n" not in offset:
            result.refusal = "" if numbers is not None else "Redis cannot be reached: the replay cannot be checked now."
            return result
        added, trimmed = numbers
        result.replay_records = max(0, added - int(offset["n"]))
        if trimmed > int(offset["n"]):
            gone = trimmed - int(offset["n"])
            result.refusal = (
                f"Refused: {gone} records after this batch were already trimmed from {job.source_stream}; restoring "
                f"here would lose them."
            )
    if result.replay_records is None:
        return result
    rate = (
        Checkpoint.objects.filter(job=job, input_rows__gt=0, processed_rate__gt=0)
        .order_by("-id")[:20]
        .aggregate(rate=Avg("processed_rate"))["rate"]
    )
    if rate:
        result.catch_up_seconds = result.replay_records / rate
    return result


def _kafka_replay(job: Job, offset: Any, result: Preview) -> None:
    """A Kafka job's replay from ``offset``: the records after it in every partition, as the broker holds them now;
    refused when retention already deleted some of them (Spark would stop on the gap: failOnDataLoss)."""
    at = kafka.offsets_of(offset, job.source_stream)
    try:
        ends = kafka.end_offsets(kafka_cluster(job), job.source_stream)
    except kafka.KafkaUnavailable as exc:
        result.refusal = f"Kafka cannot be reached, so the replay cannot be checked now: {exc}"
        return
    result.replay_records = sum(kafka.lag_by_partition(ends, at).values())
    gone = {p: earliest - at.get(p, 0) for p, (earliest, _) in ends.items() if earliest > at.get(p, 0)}
    if gone:
        where = ", ".join(f"{n} in partition {p}" for p, n in sorted(gone.items()))
        result.refusal = (
            f"Refused: {sum(gone.values())} records after this batch were already deleted from {job.source_stream} by "
            f"the topic's retention ({where}); restoring here would lose them."
        )


RUNNING = "Refused: {job} is running. Stop it first (Stop with savepoint keeps its latest state too)."


def savepoint_preview(job: Job, savepoint: Savepoint) -> Preview:
    offsets = savepoint.manifest.get("source_offsets") or [None]
    result = preview(job, int(savepoint.batch_id or 0), offsets[0], savepoint.created_at)
    if savepoint.status != SavepointStatus.VERIFIED:
        result.refusal = "Refused: only a verified savepoint can be restored."
    elif active_run(job) is not None:
        result.refusal = RUNNING.format(job=job.name)
    return result


def restorable_batches(job: Job) -> list[int]:
    """Committed batches of the live checkpoint whose state Spark still keeps (the retained batches)."""
    root = job.checkpoint_location
    batches = committed_batches(root)
    state = root / "state" / "0" / "0"
    if not state.is_dir():
        return batches
    versions = {v for name in state.iterdir() if (v := state_version(name.name)) is not None}
    oldest = min(versions) if versions else 0
    return [b for b in batches if b + 1 >= oldest]


def rollback_preview(job: Job, batch_id: int) -> Preview:
    record = Checkpoint.objects.filter(job=job, location=job.checkpoint_dir, batch_id=batch_id).first()
    try:
        offsets = batch_offsets(job.checkpoint_location, batch_id)["sources"]
    except CheckpointError:
        offsets = [None]
    result = preview(job, batch_id, offsets[0], record.committed_at if record else None)
    retained = restorable_batches(job)
    if batch_id not in retained:
        span = f"{retained[0]}–{retained[-1]}" if retained else "none"
        result.refusal = f"Refused: batch {batch_id} is not among the retained batches ({span})."
    elif active_run(job) is not None:
        result.refusal = RUNNING.format(job=job.name)
    return result


def switch_to_fork(job: Job, fork: str) -> None:
    """From now on the job runs on this checkpoint directory; the previous one is kept."""
    Job.objects.filter(id=job.id).update(checkpoint_dir=fork, latest_checkpoint=None)
    job.checkpoint_dir, job.latest_checkpoint = fork, None


def _started_on_fork(action: Action, fork: str) -> tuple[Run, str]:
    """Switch the job to the fork (once) and request its start; the run and the directory left behind."""
    job = action.job
    previous = action.memo.get("previous")
    if previous is None:
        previous = job.checkpoint_dir
        memo_save(action, previous=previous)
    if job.checkpoint_dir != fork:
        switch_to_fork(job, fork)
    return start_once(action), previous


def savepoint_fork(action: Action, savepoint: Savepoint, fork: str) -> None:
    """Copy the savepoint into a new checkpoint directory of the job and check every file against its manifest."""
    target = action.job.directory / fork
    action_progress(action, f"copying savepoint #{savepoint.id} into {fork}")
    remove_tree(target)
    shutil.copytree(Path(savepoint.path) / "checkpoint", target)
    manifest = json.loads((Path(savepoint.path) / MANIFEST).read_text())
    problems = verify_files(target, manifest["files"])
    if problems:
        remove_tree(target)
        raise ActionFailed(f"The savepoint's files do not match its manifest: {'; '.join(problems[:5])}")


def _restore_savepoint(action: Action) -> Savepoint:
    savepoint = action.job.savepoints.filter(id=action.params.get("savepoint")).first()
    if savepoint is None:
        raise ActionFailed("That savepoint does not exist.")
    return savepoint


def _restore_fork(action: Action) -> Outcome:
    job = action.job
    if (waiting := settled(action, job, "restoring a savepoint (or stop it with a savepoint)")) is not None:
        return waiting
    savepoint = _restore_savepoint(action)
    check = savepoint_preview(job, savepoint)
    if check.refusal:
        raise ActionFailed(check.refusal)
    remember(action, replay_records=check.replay_records)
    savepoint_fork(action, savepoint, fork_name(action, "restore"))
    return Next("start")


def _restore_start(action: Action) -> Done:
    savepoint = _restore_savepoint(action)
    fork = fork_name(action, "restore")
    run, previous = _started_on_fork(action, fork)
    return Done(
        f"Restored savepoint #{savepoint.id} (batch {savepoint.batch_id}) into {fork}; run #{run.id} starting. "
        f"{_replay(action)} to replay. The previous checkpoint {previous} is kept."
    )


def _replay(action: Action) -> str:
    count = action.params.get("replay_records")
    return f"{count if count is not None else '?'} records"


# A restore's and a rollback's: the checkpoint directory the fork replaced, the records the replay reads, the run
FORK_KEYS = STARTED + Keys(memo={"previous": str}, params={"replay_records": (int, NoneType)})
RESTORE_KEYS = FORK_KEYS
ROLLBACK_KEYS = FORK_KEYS + SPARK_READS  # it verifies the savepoint it rolls back to
RESTORE_STEPS: Steps = {
    "fork": ("copy the savepoint into a new checkpoint directory", _restore_fork),
    "start": ("switch and start", _restore_start),
}


def _rollback_copy(action: Action) -> Outcome:
    job = action.job
    if (waiting := settled(action, job, "rolling back")) is not None:
        return waiting
    batch = int(action.params["batch"])
    check = rollback_preview(job, batch)
    if check.refusal:
        raise ActionFailed(check.refusal)
    remember(action, replay_records=check.replay_records)
    fork = fork_name(action, "rollback")
    target = job.directory / fork
    remove_tree(target)
    action_progress(action, f"copying the checkpoint as of batch {batch} into {fork}")
    try:
        copy_checkpoint(job.checkpoint_location, target, batch)
    except CheckpointError as exc:
        remove_tree(target)
        raise ActionFailed(f"Rollback to batch {batch} is not possible: {exc}") from None
    return Next("verify")


def _rollback_verify(action: Action) -> Outcome:
    batch = int(action.params["batch"])
    target = action.job.directory / fork_name(action, "rollback")
    action_progress(action, f"checking that Spark loads the state at batch {batch}")
    try:
        if state_read(action, "verify", "verify", target, batch) is None:
            return Wait(f"checking that Spark loads the state at batch {batch}", 0.5)
    except ActionFailed as exc:
        remove_tree(target)
        raise ActionFailed(f"Rollback to batch {batch} is not possible: {exc}") from None
    return Next("start")


def _rollback_start(action: Action) -> Done:
    batch = int(action.params["batch"])
    fork = fork_name(action, "rollback")
    run, previous = _started_on_fork(action, fork)
    return Done(
        f"Rolled back to batch {batch} in {fork}; run #{run.id} starting and replays {_replay(action)}. "
        f"{previous} is kept."
    )


ROLLBACK_STEPS: Steps = {
    "copy": ("copy the checkpoint as of the batch", _rollback_copy),
    "verify": ("Spark loads the state", _rollback_verify),
    "start": ("switch and start", _rollback_start),
}


@dataclass
class OldCheckpoint:
    name: str
    size_bytes: int
    batches: int


def old_checkpoints(job: Job) -> list[OldCheckpoint]:
    """Checkpoint directories the job no longer runs on: left behind by restores, rollbacks and rescales."""
    if not job.directory.is_dir():
        return []
    found = []
    for path in sorted(job.directory.iterdir()):
        current = path.name in (job.checkpoint_dir, f"{job.checkpoint_dir}.seed")  # a migration's seed of the current
        if path.is_dir() and path.name.startswith("checkpoint") and not current:
            found.append(OldCheckpoint(path.name, directory_bytes(path), len(committed_batches(path))))
    return found


def discard_action(action: Action) -> str:
    job = action.job
    refuse_while_alive(job, "discarding a checkpoint directory")
    name = str(action.params.get("directory", ""))
    if name not in {old.name for old in old_checkpoints(job)}:
        raise ActionFailed(f"{name!r} is not an old checkpoint directory of {job.name}; nothing was deleted.")
    remove_tree(job.directory / name)
    return f"Discarded {name}."
