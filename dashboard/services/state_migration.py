"""State migrations: an upgrade to a version whose state cannot be read from the job's, built from it instead.

The new version declares how (``statekeeper_sdk.Migration``: the old state per state variable in, its initial state
out). The upgrade preview and the upgrade take ``migrate``; their step tables (``dashboard.services.upgrades``) list
this module's steps, which do the following:

- the preview (``preview_copy``, ``preview_run``), after the compatibility check, copies the checkpoint as of its newest batch, runs the migration on the
  copy into a scratch checkpoint, and runs the new version's first batch there on the migrated state, from where that
  batch ended, over the entries that came after it (``migrate`` of the state tool). Nothing stops. It shows the rows
  read per state variable and written, keys in and out, the old keys that map to nothing, samples before and after,
  and the first batch's output; a migration that raises, or output the new state refuses, is shown with the error.
- the upgrade stops the job with a savepoint at batch N, runs the migration (``migrate``) on the savepoint's state into the new
  checkpoint's seed (``checkpoint_dir.files.seed_dir``), and starts the new version there: its transformWithState
  operator takes the seed as its initial state at batch 0, its source reads on after N's offsets, and its sinks number
  its batches from N + 1 (``write_lineage``). A failure before the new version's first batch rolls back by itself to
  savepoint N, as any upgrade does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings

from dashboard import kafka, pipelines
from dashboard.checkpoint_dir.files import CheckpointError, batch_offsets, copy_checkpoint, remove_tree, seed_dir
from dashboard.models import Action, Job, Savepoint, StateBackend
from dashboard.services.action_keys import Keys, action_progress, memo_save, remember
from dashboard.services.action_steps import Done, Next, NoneType, Outcome, Wait
from dashboard.services.errors import ActionFailed
from dashboard.services.forks import fork_name
from dashboard.services.secrets import kafka_cluster
from dashboard.services.shadow import range_end
from dashboard.services.state_reader_client import state_read
from dashboard.services.upgrade_parts import (
    next_line_base,
    scratch_cleanup,
    scratch_dead_letters,
    scratch_dir,
    scratch_spec,
    start_of,
    target_shown,
)

PREVIEW_RECORDS = 1000  # entries after the batch the preview's first batch reads, at most


# A preview's: the input range of the migrated first batch ({"id", "n"}; Kafka's {topic: {partition: offset}}; its
# end None when no input follows the batch), and the figures shown. An upgrade's or a blue/green's: that it began
# writing the new line's seed, and that the seed is written.
MIGRATION_PREVIEW_KEYS = Keys(
    memo={"migration_start": dict, "migration_end": (dict, NoneType)}, params={"migration": dict}
)
MIGRATION_KEYS = Keys(memo={"migrated": bool, "migration_begun": bool}, params={"migration": dict})


def migration_spec(action: Action, checkpoint: Path, use: str) -> dict[str, Any]:
    """What the state tool's ``migrate`` needs: the job's source (for a first batch), the new version and its values,
    the pipeline the state is read from, and the new checkpoint it seeds."""
    job = action.job
    target = action.params["plan"]["target"]
    rocksdb = pipelines.get(target).needs_rocksdb and job.state_backend == StateBackend.MEMORY
    return scratch_spec(job, scratch_dead_letters(action, use)) | {
        **({"backend": StateBackend.ROCKSDB.value} if rocksdb else {}),  # the migrated line's (_start_migrated)
        "reference": pipelines.reference(target),
        "from_pipeline": action.params.get("from_pipeline") or job.pipeline,
        "parameters": action.params["parameters"],
        "checkpoint": str(checkpoint),
    }


def migration_summary(done: dict[str, Any]) -> str:
    """One sentence of what a migration read and made, as the preview and the upgrade's outcome say it."""
    read = f"{sum(done['variables'].values())} ({', '.join(f'{n}: {r}' for n, r in sorted(done['variables'].items()))})"
    keys = f"{done['keys_in']} keys in, " if done.get("keys_in") is not None else ""
    dropped = done.get("dropped") or {}
    lost = (
        f"; {dropped['keys']} old {'/'.join(dropped['on'])} map to nothing" if dropped.get("keys") else
        f"; every old {'/'.join(dropped['on'])} kept" if dropped else ""
    )  # fmt: skip
    return f"read {read} state rows; wrote {done['rows_out']} rows ({keys}{done['keys_out']} keys out){lost}"


def _kept(result: dict[str, Any]) -> dict[str, Any]:
    """The tool's answer as the action keeps it (its rows read summed as ``rows_in``)."""
    return {k: v for k, v in result.items() if k != "batch"} | {"rows_in": sum(result["variables"].values())}


# --- the preview ----------------------------------------------------------------------------------------------------


def preview_copy(action: Action) -> Outcome:
    job = action.job
    batch = int(action.params["plan"]["batch"])
    old, new = scratch_dir(action, "migration-old"), scratch_dir(action, "migration-new")
    for path in (old, new, seed_dir(new)):
        remove_tree(path)
    action_progress(action, f"copying the checkpoint as of batch {batch} for the migration")
    try:
        copy_checkpoint(job.checkpoint_location, old, batch)
        starting = batch_offsets(old, batch)["sources"][0]
    except (CheckpointError, IndexError) as exc:
        raise ActionFailed(f"The checkpoint cannot be copied for the migration's preview: {exc}") from None
    start = start_of(job, starting, f"Batch {batch}'s offsets")
    memo_save(action, migration_start=start, migration_end=_first_input(job, start))
    return Next("migration")


def _first_input(job: Job, start: dict[str, Any]) -> dict[str, Any] | None:
    """Where the preview's first batch on the migrated state ends: PREVIEW_RECORDS entries of a Redis stream after
    ``start``; for Kafka, the topic's end offsets now (Spark reads at most PREVIEW_RECORDS of them in that batch). None
    when no record comes after ``start``."""
    if not job.reads_kafka:
        return range_end(job, start, PREVIEW_RECORDS, "so the first batch's input cannot be fixed")
    try:
        ends = kafka.end_offsets(kafka_cluster(job), job.source_stream)
    except kafka.KafkaUnavailable as exc:
        raise ActionFailed(f"Kafka cannot be reached, so the first batch's input cannot be fixed: {exc}") from None
    at = kafka.offsets_of(start, job.source_stream)
    if not sum(kafka.lag_by_partition(ends, at).values()):
        return None
    return {job.source_stream: {str(p): end for p, (_, end) in ends.items()}}


def preview_run(action: Action) -> Outcome:
    batch = int(action.params["plan"]["batch"])
    old, new = scratch_dir(action, "migration-old"), scratch_dir(action, "migration-new")
    ending = action.memo.get("migration_end")
    spec = migration_spec(action, new, "migration") | {
        "first_batch": ending is not None, "starting": action.memo["migration_start"], "ending": ending,
        "records": PREVIEW_RECORDS, "base": batch + 1, "sample_keys": settings.MIGRATION_PREVIEW_KEYS,
    }  # fmt: skip
    action_progress(action, f"migrating the state of batch {batch} on a scratch copy")
    try:
        result = state_read(action, "migration", "migrate", old, batch, spec)
    except ActionFailed as exc:
        _preview_cleanup(action)
        remember(action, migration={"error": str(exc).removeprefix("Spark could not migrate the state: ")})
        raise ActionFailed(f"The migration failed on the state of batch {batch}; nothing stopped. {exc}") from None
    if result is None:
        return Wait(f"migrating the state of batch {batch} on a scratch copy", 1.0)
    _preview_cleanup(action)
    done = _kept(result)
    remember(action, migration=done)
    first = done.get("first_batch") or {}
    part = (
        f" (run on {first['seeded']['keys']} of its {done['keys_out']} keys: a sample of {first['seeded']['sampled']} "
        f"and the {first['seeded']['read']} keys the batch reads)" if first.get("seeded") else ""
    )  # fmt: skip
    after = (
        f"; {target_shown(action)}'s first batch on it gave {first['rows']} output rows{part}"
        if first.get("ran") else "; no entry came after the batch, so no first batch ran on it"
    )  # fmt: skip
    return Done(f"Migration from batch {batch}: {migration_summary(done)}{after}. Nothing stopped.")


def _preview_cleanup(action: Action) -> None:
    new = scratch_dir(action, "migration-new")
    for path in (scratch_dir(action, "migration-old"), new, seed_dir(new)):
        remove_tree(path)
    scratch_cleanup(action, "migration")


# --- the upgrade ----------------------------------------------------------------------------------------------------


def migrate(action: Action) -> Outcome:
    """Run the migration on the savepoint's state into the seed of the new checkpoint the job will switch to."""
    if not action.params.get("migrate") or action.memo.get("migrated"):
        return Next("switch")
    savepoint = Savepoint.objects.filter(id=action.params.get("savepoint")).first()
    if savepoint is None:  # no state to migrate: a job with no committed batch starts the new version as it is
        return Next("switch")
    return seed(action, action.job.directory / fork_name(action, "upgrade"), savepoint) or Next("switch")


def seed(action: Action, new: Path, savepoint: Savepoint) -> Wait | None:
    """Run the migration on the savepoint's state into ``new``, a checkpoint with no batch whose seed the new
    version's first batch takes as its initial state (the savepoint upgrade's new line, or blue/green's fork). None
    once done (the result kept in the action's ``migration``); Wait while Spark's state reader runs it."""
    if action.memo.get("migrated"):
        return None
    if not action.memo.get("migration_begun"):
        remove_tree(new)
        remove_tree(seed_dir(new))
        memo_save(action, migration_begun=True)
    spec = migration_spec(action, new, "migration") | {
        "base": next_line_base(savepoint),
        "lineage": {"after_savepoint": savepoint.id, "upgrade": action.id, "reason": "state migration",
                    "from": action.params.get("from_pipeline")},
    }  # fmt: skip
    action_progress(action, f"migrating the state of savepoint #{savepoint.id} (batch {savepoint.batch_id})")
    result = state_read(action, "migration", "migrate", Path(savepoint.path) / "checkpoint",
                        int(savepoint.batch_id or 0), spec)  # fmt: skip
    if result is None:
        return Wait(f"migrating the state of savepoint #{savepoint.id} (batch {savepoint.batch_id})", 1.0)
    remember(action, migration=_kept(result))
    memo_save(action, migrated=True)
    return None
