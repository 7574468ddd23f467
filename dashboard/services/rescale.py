"""Rescaling: compute (cores) by a restart; state partitions by stop, savepoint, Spark's offline repartition on a
fork, restart. The savepoint is kept for rollback; the original checkpoint directory is untouched."""

from __future__ import annotations

import time

from django.utils import timezone

from dashboard.checkpoint_dir.files import CheckpointError, copy_checkpoint, latest_committed, remove_tree
from dashboard.models import Action, Job
from dashboard.services.action_steps import action_progress, run_state_tool, wait_until_stopped
from dashboard.services.errors import ActionFailed
from dashboard.services.forks import switch_to_fork
from dashboard.services.runs import job_request_start
from dashboard.services.savepoints import savepoint_take

MEMORY_REPARTITION = (
    "State partitions of a memory-backend job cannot change: Spark's offline repartition supports only RocksDB state "
    "(it answers STATE_REPARTITION_INVALID_CHECKPOINT.UNSUPPORTED_PROVIDER for the HDFS-backed store). The "
    "parallelism (cores) can still change."
)
BACKEND_SWITCH = (
    "Switching between the memory and RocksDB backends is not offered: Spark records the state store provider in the "
    "checkpoint at the first batch and refuses another one on restart, and its state reader cannot re-seed a "
    "dropDuplicates or aggregation operator in a new checkpoint. Only transformWithState jobs could be re-seeded "
    "(through initialState), and they already need RocksDB."
)


def rescale_action(action: Action) -> str:
    job = action.job
    before = {"parallelism": job.parallelism, "state_partitions": job.state_partitions}
    parallelism = int(action.params.get("parallelism") or job.parallelism)
    partitions = int(action.params.get("state_partitions") or job.state_partitions)
    if not 1 <= parallelism <= 64 or not 1 <= partitions <= 1024:
        raise ActionFailed("Parallelism must be 1–64 and state partitions 1–1024.")
    if (parallelism, partitions) == (before["parallelism"], before["state_partitions"]):
        raise ActionFailed("Nothing to change: that is the current scale.")
    if partitions != before["state_partitions"] and job.state_backend == "memory" and job.has_state():
        raise ActionFailed(MEMORY_REPARTITION)
    was_running = job.runs.filter(status="running").exists()
    wait_until_stopped(action, job)
    stopped_at = time.monotonic()
    notes = []
    if partitions != before["state_partitions"] and job.has_state():
        savepoint = savepoint_take(job=job, action=action, origin="before-rescale")
        notes.append(f"savepoint #{savepoint.id} kept for rollback")
        fork = f"checkpoint-rescale-{action.id}"
        target = job.directory / fork
        remove_tree(target)
        try:
            batch = latest_committed(job.checkpoint_location)
            action_progress(action, f"repartitioning a copy of the state into {partitions} partitions")
            copy_checkpoint(job.checkpoint_location, target, batch)
            run_state_tool("repartition", target, partitions)
            action_progress(action, "checking that Spark loads the repartitioned state")
            run_state_tool("verify", target, latest_committed(target))
        except (CheckpointError, ActionFailed) as exc:
            remove_tree(target)
            raise ActionFailed(f"Repartition failed, nothing changed (the job stays stopped): {exc}") from None
        switch_to_fork(job, fork)
    Job.objects.filter(id=job.id).update(
        parallelism=parallelism, state_partitions=partitions, updated_at=timezone.now()
    )
    job.refresh_from_db()
    after = {"parallelism": parallelism, "state_partitions": partitions}
    Action.objects.filter(id=action.id).update(params={**action.params, "before": before, "after": after})
    if was_running or action.params.get("start"):
        run = job_request_start(job=job, requested_by=action.requested_by)
        notes.append(f"run #{run.id} starting")
    downtime = time.monotonic() - stopped_at
    return f"Rescaled {before} → {after}; {', '.join(notes) or 'job left stopped'}; offline for {downtime:.1f} s before the restart request."
