"""Savepoints: a self-contained copy of the checkpoint at a committed batch, listed as usable only once verified."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import pyspark
from django.utils import timezone

from dashboard import kafka
from dashboard.checkpoint_dir.files import (
    CheckpointError,
    batch_offsets,
    copy_checkpoint,
    entries_json,
    frozen_settings,
    latest_committed,
    remove_tree,
    verify_files,
)
from dashboard.models import Action, Job, Savepoint, SavepointStatus
from dashboard.selectors.lag import stream_head
from dashboard.selectors.savepoints import savepoint_newest_verified
from dashboard.selectors.sinks import job_sinks
from dashboard.services.action_keys import SAVEPOINT_TAKEN, SPARK_READS, action_progress, remember
from dashboard.services.action_steps import Done, Next, Outcome, Step, Steps, Wait, step_seconds
from dashboard.services.deploys import deploy_of_batch
from dashboard.services.errors import ActionFailed
from dashboard.services.run_waits import stop_step
from dashboard.services.secrets import kafka_cluster
from dashboard.services.state_reader_client import run_state_tool, state_read

MANIFEST = "_manifest.json"


def savepoint_copy(
    *,
    job: Job,
    action: Action,
    origin: str,
    batch: int | None = None,
    source: Path | None = None,
    sinks: dict[str, int | None] | None = None,
) -> Savepoint:
    """Copy the checkpoint as of its latest committed batch (or ``batch``, a retained one) with its manifest; the job
    may keep running. The copy is listed once ``savepoint_check`` has verified it. A copy this action began before
    (its worker killed mid-copy) is disposed of first. ``source``: a checkpoint directory of the job other than the
    one it runs on (a rescale's, which it left), with ``sinks``, each sink's last batch as the job stopped on it."""
    for unfinished in job.savepoints.filter(action=action, status=SavepointStatus.IN_PROGRESS):
        savepoint_dispose(savepoint=unfinished, status=SavepointStatus.FAILED)
    started = time.monotonic()
    savepoint = Savepoint.objects.create(job=job, action=action, origin=origin)
    try:
        source = job.checkpoint_location if source is None else source
        batch = latest_committed(source) if batch is None else batch
        folder = job.savepoint_root / f"sp-{savepoint.id}-batch-{batch}"
        savepoint.batch_id, savepoint.path = batch, str(folder)
        savepoint.deploy = deploy_of_batch(job, batch)
        savepoint.save(update_fields=["batch_id", "path", "deploy"])
        action_progress(action, f"copying the checkpoint as of batch {batch}")
        entries = copy_checkpoint(source, folder / "checkpoint", batch, batch_only=True)
        copied = time.monotonic()
        offsets = batch_offsets(folder / "checkpoint", batch)
        manifest = {
            "job": job.name,
            "pipeline": job.pipeline,
            "deploy": savepoint.deploy_id,
            "batch_id": batch,
            "source_stream": job.source_stream,
            "source_offsets": offsets["sources"],
            "watermark_ms": offsets["metadata"].get("batchWatermarkMs"),
            "backend": job.state_backend,
            "state_partitions": int(
                frozen_settings(folder / "checkpoint", batch)["partitions"] or job.state_partitions
            ),
            "state_provider": frozen_settings(folder / "checkpoint", batch)["provider"],
            "spark_version": pyspark.__version__,
            "created_at": timezone.now().isoformat(),
            "files": entries_json(entries),
            "copy_ms": int((copied - started) * 1000),
            # each of the job's sinks' last batch, read as the copy ends
            "sinks": sinks_last_batches(job) if sinks is None else sinks,
        }
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    except CheckpointError as exc:
        _savepoint_failed(savepoint, str(exc), started)
    savepoint.duration_ms = int((time.monotonic() - started) * 1000)
    savepoint.save(update_fields=["duration_ms"])
    remember(action, savepoint=savepoint.id)
    return savepoint


def sinks_last_batches(job: Job) -> dict[str, int | None]:
    """Each of the job's sinks' last batch written, by name."""
    return {s.name: s.position.last_batch for s in job_sinks(job) if not s.off}


def _savepoint_failed(savepoint: Savepoint, reason: str, started: float | None = None) -> NoReturn:
    savepoint.status, savepoint.error = SavepointStatus.FAILED, reason
    if started is not None:
        savepoint.duration_ms = int((time.monotonic() - started) * 1000)
    savepoint.save()
    raise ActionFailed(f"Savepoint failed: {reason}")


def savepoint_check(action: Action) -> Savepoint | Wait:
    """The step after ``savepoint_copy``: the action's savepoint verified (checksums, and Spark's state reader loads
    its state), or a Wait while the warm reader starts. Verified savepoints are kept by retention from then on."""
    savepoint = Savepoint.objects.get(id=action.params["savepoint"])
    if savepoint.status == SavepointStatus.VERIFIED:
        return savepoint
    key = f"verify-{savepoint.id}"
    started = time.monotonic()
    try:
        folder = Path(savepoint.path)
        manifest = json.loads((folder / MANIFEST).read_text())
        # the checksums once, on the first visit, unless an upgrade checked them before its switch
        if key not in action.memo and not savepoint.manifest:
            action_progress(action, f"verifying {len(manifest['files'])} files against their checksums")
            _files_match(folder, manifest)
            action_progress(action, "verifying: Spark's state reader loads the state")
        reading = state_read(action, key, "verify", folder / "checkpoint", int(manifest["batch_id"]))
        if reading is None:
            return Wait("verifying: Spark's state reader loads the savepoint's state", 0.5)
        savepoint_verified(savepoint, folder, manifest, reading, int(step_seconds(action) * 1000))
    except (OSError, ValueError, ActionFailed) as exc:
        _savepoint_failed(savepoint, str(exc))
    savepoint.duration_ms += int((time.monotonic() - started) * 1000)
    savepoint.save()
    savepoints_retain(job=action.job)
    return savepoint


def savepoint_files_checked(action: Action) -> Savepoint:
    """The action's savepoint's files against their checksums, and its manifest (where its batch ended in the source,
    its partitions) kept on its record before Spark reads its state: an upgrade switches on that, and the reading
    follows its new version's first batch (``savepoint_check``). Marked failed (ActionFailed) when a file differs."""
    savepoint = Savepoint.objects.get(id=action.params["savepoint"])
    if savepoint.status == SavepointStatus.VERIFIED or savepoint.manifest:
        return savepoint
    try:
        manifest = json.loads((Path(savepoint.path) / MANIFEST).read_text())
        _files_match(Path(savepoint.path), manifest)
    except (OSError, ValueError, ActionFailed) as exc:
        _savepoint_failed(savepoint, str(exc))
    _manifest_kept(savepoint, manifest)
    savepoint.save(update_fields=["manifest", "size_bytes"])
    return savepoint


# The label of a "verify" step that checks the savepoint's files now and leaves Spark's reading to
# ``savepoint_read_after`` (an upgrade's, a rescale's)
FILES_NOW_READ_LATER = "verify the savepoint's files (Spark reads its state after the first batch)"


def savepoint_read_after(action: Action) -> Wait | str:
    """The reading by Spark of the action's savepoint (``savepoint_check``), asked for once the job's new run has its
    first batch (or was found quiet), so that it does not share the cores with that batch while the output is stopped:
    a Wait while Spark reads its state, then '' when it is verified, or why it failed (the savepoint is marked
    failed). Its checksums were checked before the switch (``savepoint_files_checked``)."""
    if action.params.get("savepoint") is None:
        return ""
    try:
        checked = savepoint_check(action)
    except ActionFailed as exc:
        return str(exc)
    return checked if isinstance(checked, Wait) else ""


def records_after_savepoint(action: Action) -> bool:
    """Whether the job's source holds records after where the action's savepoint (or, without one, the job) starts:
    then the new run's first batch will come, and the action waits for it; a quiet job's returns once its run is
    up."""
    savepoint = Savepoint.objects.filter(id=action.params.get("savepoint")).first()
    return records_after(action.job, (savepoint.manifest.get("source_offsets") or [None])[0] if savepoint else None)


def records_after(job: Job, offset: dict[str, Any] | None) -> bool:
    """Whether the job's source holds records after ``offset`` (where a batch ended in it; None: from its start)."""
    if job.reads_kafka:
        try:
            ends = kafka.end_offsets(kafka_cluster(job), job.source_stream)
        except kafka.KafkaUnavailable:
            return False
        return sum(kafka.lag_by_partition(ends, kafka.offsets_of(offset, job.source_stream)).values()) > 0
    if not job.reads_redis:
        return False
    numbers = stream_head(job.source_stream)
    if numbers is None:
        return False
    added = numbers[0]
    return added > int(offset["n"]) if isinstance(offset, dict) and "n" in offset else added > 0


def _files_match(folder: Path, manifest: dict) -> None:
    if problems := verify_files(folder / "checkpoint", manifest["files"]):
        raise ActionFailed(f"the copy is not complete: {'; '.join(problems[:5])}")


def _manifest_kept(savepoint: Savepoint, manifest: dict) -> None:
    """The manifest on the savepoint's record, without its file list (its count instead), and the savepoint's size."""
    savepoint.manifest = {k: v for k, v in manifest.items() if k != "files"} | {"file_count": len(manifest["files"])}
    savepoint.size_bytes = sum(int(f["size"]) for f in manifest["files"])


def savepoint_steps(
    origin: str | None, then: str, batch: Callable[[Action], int | None] = lambda action: None
) -> Steps:
    """Two steps, "savepoint" (copy) and "verify", that take a savepoint of the job for an action and go on to
    ``then``; ``origin`` None takes the action's own origin (a person's, or periodic); ``batch`` picks a retained
    batch other than the newest."""

    def verify(action: Action) -> Outcome:
        checked = savepoint_check(action)
        return checked if isinstance(checked, Wait) else Next(then)

    return {"savepoint": savepoint_copy_step(origin, batch), "verify": ("verify the savepoint", verify)}


def savepoint_copy_step(
    origin: str | None, batch: Callable[[Action], int | None] = lambda action: None
) -> tuple[str, Step]:
    """The step "savepoint" of ``savepoint_steps`` alone, for an action that verifies the copy its own way."""

    def copy(action: Action) -> Next:
        savepoint_copy(job=action.job, action=action, origin=origin or action.origin, batch=batch(action))
        return Next("verify")

    return "copy the checkpoint", copy


def _verified(action: Action) -> Done:
    savepoint = Savepoint.objects.get(id=action.params["savepoint"])
    return Done(f"Savepoint #{savepoint.id} at batch {savepoint.batch_id} verified ({savepoint.size_bytes} bytes).")


def _stopped_and_verified(action: Action) -> Done:
    savepoint = Savepoint.objects.get(id=action.params["savepoint"])
    return Done(f"Stopped; savepoint #{savepoint.id} at batch {savepoint.batch_id} verified.")


SAVEPOINT_KEYS = SPARK_READS + SAVEPOINT_TAKEN  # a savepoint's and a stop with one's: its verification, its id
SAVEPOINT_STEPS: Steps = {**savepoint_steps(None, then="done"), "done": ("listed", _verified)}
STOP_WITH_SAVEPOINT_STEPS: Steps = {
    "stop": stop_step(then="savepoint"),
    **savepoint_steps("stop", then="done"),
    "done": ("listed", _stopped_and_verified),
}


class SavepointDamaged(ActionFailed):
    def __init__(self, problems: list[str]) -> None:
        super().__init__(f"{len(problems)} file(s) differ from the manifest: {'; '.join(problems[:5])}")
        self.problems = problems


def savepoint_read_back(folder: Path, manifest: dict, on_step: Callable[[str], None] | None = None) -> tuple[dict, int]:
    """The savepoint's files against the manifest's checksums (SavepointDamaged otherwise), then Spark's state reader
    on its state at its batch: what the reader found, and how long the reader took (ms). Verification and restore
    drills both read a savepoint so."""
    step = on_step or (lambda text: None)
    step(f"verifying {len(manifest['files'])} files against their checksums")
    if problems := verify_files(folder / "checkpoint", manifest["files"]):
        raise SavepointDamaged(problems)
    step("verifying: Spark's state reader loads the state")
    started = time.monotonic()
    reading = run_state_tool("verify", folder / "checkpoint", int(manifest["batch_id"]))
    return reading, int((time.monotonic() - started) * 1000)


def savepoint_verified(savepoint: Savepoint, folder: Path, manifest: dict, reading: dict, reader_ms: int) -> None:
    """What Spark's state reader found in the savepoint's state is kept in its manifest; the savepoint is verified."""
    manifest["verification"] = reading
    manifest["verify_ms"] = reader_ms
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _manifest_kept(savepoint, manifest)
    savepoint.status, savepoint.verified_at = SavepointStatus.VERIFIED, timezone.now()


def savepoint_dispose(*, savepoint: Savepoint, status: str = SavepointStatus.DISPOSED) -> None:
    if savepoint.path:
        folder = Path(savepoint.path).resolve()
        if savepoint.job.savepoint_root.resolve() not in folder.parents:
            raise ActionFailed(f"{folder} is not under the job's savepoint folder; not deleting it")
        remove_tree(folder)
    Savepoint.objects.filter(id=savepoint.id).update(status=status, disposed_at=timezone.now())


def dispose_action(action: Action) -> str:
    savepoint = action.job.savepoints.filter(id=action.params.get("savepoint")).first()
    if savepoint is None or savepoint.status == SavepointStatus.DISPOSED:
        raise ActionFailed("That savepoint does not exist or was already disposed.")
    newest = savepoint_newest_verified(action.job)
    if newest is not None and newest.id == savepoint.id and not action.params.get("allow_newest"):
        raise ActionFailed("This is the newest verified savepoint: it is kept, so that a restore is always possible.")
    savepoint_dispose(savepoint=savepoint)
    return f"Savepoint #{savepoint.id} disposed."


def savepoints_retain(*, job: Job) -> list[int]:
    """Dispose verified savepoints beyond the job's max count or max age; never the newest verified one, nor the one
    taken before the job's latest upgrade (the way back)."""
    verified = list(job.savepoints.filter(status=SavepointStatus.VERIFIED).order_by("-id"))
    too_old = timezone.now() - timedelta(hours=job.savepoints_max_age_hours)
    way_back = next((sp.id for sp in verified if sp.origin == "before-upgrade"), None)  # the latest upgrade's
    gone = [
        sp
        for i, sp in enumerate(verified)
        if i > 0 and sp.id != way_back and (i >= job.savepoints_max_count or sp.created_at < too_old)
    ]
    for savepoint in gone:
        savepoint_dispose(savepoint=savepoint)
    for failed in job.savepoints.filter(status=SavepointStatus.FAILED, disposed_at=None):
        savepoint_dispose(savepoint=failed)  # a failed copy is of no use: free its space
    return [sp.id for sp in gone]
