"""The state inspector: what is in a job's state at a retained batch or in a verified savepoint.

Spark's state reader (`state-metadata`, `statestore`) answers the variables and partitions, a page of keys, the keys
matching a text, and a diff between two batches; `rocksdict` answers raw statistics of RocksDB snapshots (keys and
bytes per partition and column family). A retained batch is read from a scratch copy, never from the running job's
files; a savepoint is read in place (nothing writes to it). Each inspection is an action: it shows progress while it
runs and keeps its answer, one page at a time."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

from django.conf import settings

from dashboard.checkpoint_dir.disk import state_version
from dashboard.checkpoint_dir.files import CheckpointError, committed_batches, copy_checkpoint, state_lineage
from dashboard.models import Action, Job, SavepointStatus
from dashboard.services.action_keys import SPARK_READS, Keys, action_progress, memo_save, remember
from dashboard.services.action_steps import Done, Next, Outcome, Steps, Wait
from dashboard.services.errors import ActionFailed
from dashboard.services.state_reader_client import reader_ready, state_read

MODES = ("variables", "keys", "lookup", "diff", "timers", "raw")


def _source(action: Action, scratch: Path) -> tuple[Path, int, str]:
    """The directory to read, the batch, and how it was found."""
    job: Job = action.job
    params = action.params
    if params.get("savepoint"):
        savepoint = job.savepoints.filter(id=params["savepoint"], status=SavepointStatus.VERIFIED).first()
        if savepoint is None or savepoint.batch_id is None:
            raise ActionFailed(f"Savepoint {params['savepoint']} is not a verified savepoint of {job.name}.")
        return Path(savepoint.path) / "checkpoint", savepoint.batch_id, f"savepoint #{savepoint.id}"
    batches = committed_batches(job.checkpoint_location)
    if not batches:
        raise ActionFailed(f"{job.name} has no committed batch to inspect.")
    batch = int(params.get("batch", batches[-1]))
    if batch not in batches:
        raise ActionFailed(f"Batch {batch} is not retained ({batches[0]}–{batches[-1]} are).")
    action_progress(action, f"copying the checkpoint as of batch {batch} to a scratch directory")
    try:
        copy_checkpoint(job.checkpoint_location, scratch, batch)
    except CheckpointError as exc:
        raise ActionFailed(str(exc)) from None
    return scratch, batch, f"batch {batch} of {job.checkpoint_dir}"


def inspect_state(action: Action) -> Outcome:
    """Read the state the action names: raw statistics at once (no Spark), everything else by Spark's state reader,
    asked without holding the worker (the step looks again until the answer is there)."""
    mode = action.params.get("mode", "variables")
    if mode not in MODES:
        raise ActionFailed(f"Unknown inspection {mode!r}; choose one of {', '.join(MODES)}.")
    work = settings.CHECKPOINT_ROOT / ".scratch" / f"inspect-{action.id}"
    try:
        if mode == "raw":
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            path, batch, origin = _source(action, work / "checkpoint")
            action_progress(action, f"unpacking RocksDB snapshots of {origin} into a scratch directory")
            stats = {"batch": batch, "partitions": rocksdb_stats(path, batch, work / "raw")}
            shutil.rmtree(work, ignore_errors=True)
            return _inspected(action, mode, stats, batch, origin)
        if (source := action.memo.get("source")) is None:
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            path, batch, origin = _source(action, work / "checkpoint")
            source = {"path": str(path), "batch": batch, "origin": origin}
            memo_save(action, source=source)
            action_progress(action, f"reading {origin} with Spark's state reader ({mode})")
        spec = {
            k: action.params[k]
            for k in ("mode", "operator", "variable", "text", "offset", "limit", "from_batch")
            if k in action.params
        }
        result = state_read(action, "inspect", "inspect", Path(source["path"]), int(source["batch"]), spec)
        if result is None:
            return Wait(f"reading {source['origin']} with Spark's state reader ({mode})", 0.5)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    return _inspected(action, mode, result, int(source["batch"]), str(source["origin"]))


def _inspected(action: Action, mode: str, result: dict[str, Any], batch: int, origin: str) -> Done:
    # the batch read is kept with the request, so the next page reads the same batch, not whatever is newest then
    if not action.params.get("savepoint"):
        remember(action, batch=batch)
    remember(action, result=result, origin_read=origin)
    shown = result.get("total", len(result.get("rows", result.get("partitions", result.get("operators", [])))))
    return Done(f"Inspected {origin}: {mode}, {shown} result(s).")


def _reader(action: Action) -> Outcome:
    """Raw statistics need no Spark; every other inspection waits for the warm reader without holding a worker."""
    if action.params.get("mode") == "raw":
        return Next("run")
    return reader_ready(action) or Next("run")


# the copy read ({"path", "batch", "origin"}); the result shown, the batch pinned (unless a savepoint's) and what was read
INSPECT_KEYS = SPARK_READS + Keys(memo={"source": dict}, params={"batch": int, "result": dict, "origin_read": str})
INSPECT_STEPS: Steps = {"reader": ("Spark's state reader", _reader), "run": ("read the state", inspect_state)}


def rocksdb_stats(checkpoint: Path, batch: int, scratch: Path) -> list[dict[str, Any]]:
    """Per state partition, the newest RocksDB snapshot at or before the batch's version, opened read-only with
    rocksdict from an unpacked copy: keys and key/value bytes per column family."""
    from rocksdict import AccessType, Options, Rdict

    version = batch + 1  # state version v is written by batch v - 1
    found = []
    for partition in sorted((checkpoint / "state").glob("*/*"), key=lambda p: (p.parent.name, p.name)):
        if not partition.name.isdigit():
            continue
        zips = {
            v: z
            for z in partition.glob("*.zip")
            if (v := state_version(z.name)) is not None and v <= version and on_lineage(checkpoint, partition, z.name)
        }
        if not zips:
            continue
        snapshot_version = max(zips)
        snapshot = zips[snapshot_version]
        target = scratch / partition.parent.name / partition.name
        target.mkdir(parents=True)
        with zipfile.ZipFile(snapshot) as packed:
            packed.extractall(target)
        lines = (target / "metadata").read_text().splitlines()
        meta = json.loads(lines[1] if lines and lines[0].startswith("v") else lines[0])
        for sst in meta.get("sstFiles", []):
            shutil.copy(partition / "SSTs" / sst["dfsSstFileName"], target / sst["localFileName"])
        families = {v: k for k, v in (meta.get("columnFamilyMapping") or {}).items()}
        # Spark's virtual column families: a 2-byte id before each key, written in the JVM's native (little-endian) order
        prefixed = len(families) > 1
        stats: dict[str, dict[str, int]] = {}
        db = Rdict(str(target), options=Options(raw_mode=True), access_type=AccessType.read_only())
        try:
            for raw_key, raw_value in db.items():
                key, value = bytes(raw_key), bytes(raw_value)  # type: ignore[arg-type]  # raw mode: bytes
                family = families.get(int.from_bytes(key[:2], "little"), "?") if prefixed else "default"
                entry = stats.setdefault(family, {"keys": 0, "key_bytes": 0, "value_bytes": 0})
                entry["keys"] += 1
                entry["key_bytes"] += len(key)
                entry["value_bytes"] += len(value)
        finally:
            db.close()
        found.append(
            {
                "operator": int(partition.parent.name),
                "partition": int(partition.name),
                "snapshot_version": snapshot_version,
                "metadata_keys": meta.get("numKeys"),
                "sst_bytes": sum(int(s.get("sizeBytes", 0)) for s in meta.get("sstFiles", [])),
                "families": stats,
            }
        )
    if not found:
        raise ActionFailed("No RocksDB snapshot to read: raw statistics need a RocksDB-backed job.")
    return found


def on_lineage(checkpoint: Path, partition: Path, name: str) -> bool:
    """Whether a state file is the one its version's commit chose (always, for format version 1)."""
    version, _, unique = name.split(".")[0].partition("_")
    if not unique or not version.isdigit():
        return True
    lineage = state_lineage(checkpoint, int(version) - 1)
    if lineage is None:  # the commit was cleaned up: then so were the files of versions before it
        return True
    return lineage.get((int(partition.parent.name), int(partition.name))) == unique
