"""Shadow run of an upgrade: the new version and the current one, each from its own copy of the newest savepoint,
over the same records after it, beside the live job; the result rows the new one would add, remove or change."""

from __future__ import annotations

import shutil
from contextlib import suppress
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from dashboard import pipelines
from dashboard.checkpoint_dir.files import committed_batches, remove_tree
from dashboard.connections import redis_client
from dashboard.models import Action, Job, Savepoint
from dashboard.services.action_steps import action_progress, run_state_tool
from dashboard.services.errors import ActionFailed
from dashboard.services.savepoints import savepoint_newest_verified, savepoint_take
from dashboard.services.upgrades import remember, scratch_spec, upgrade_refusal

SHADOW_RECORDS = 5000  # input a shadow run reads by default, from the savepoint's offset on


def shadow_range(job: Job, savepoint: Savepoint, records: int) -> dict[str, Any]:
    """The source offset ``records`` entries after the savepoint's (or the stream's head, if nearer)."""
    if not job.reads_redis:
        raise ActionFailed(
            "A shadow run reads a fixed range of a Redis stream beside the live job; this job's source has no such "
            "range yet. Preview the upgrade instead."
        )
    start = (savepoint.manifest.get("source_offsets") or [None])[0]
    if not isinstance(start, dict) or "id" not in start:
        raise ActionFailed(f"Savepoint #{savepoint.id} does not record where in {job.source_stream} it stands.")
    try:
        entries = redis_client().xrange(job.source_stream, min=f"({start['id']}", count=records)
    except RedisError as exc:
        raise ActionFailed(f"Redis cannot be reached, so the shadow run's input cannot be fixed: {exc}") from None
    if not entries:
        raise ActionFailed(
            f"Nothing arrived in {job.source_stream} after savepoint #{savepoint.id}: no input to compare on yet."
        )
    last = entries[-1][0]
    return {"id": last.decode() if isinstance(last, bytes) else str(last), "n": int(start["n"]) + len(entries)}


def upgrade_shadow_action(action: Action) -> str:
    """Run the new version and the current one from the same savepoint over the same input, on scratch copies beside
    the live job, and keep the result rows the new one would add, remove or change."""
    job = action.job
    target = str(action.params.get("pipeline", ""))
    if refusal := upgrade_refusal(job, target):
        raise ActionFailed(refusal)
    if pipelines.find(job.pipeline) is None:
        raise ActionFailed(f"{job.pipeline}, which {job.name} runs now, is not registered: nothing to compare with.")
    savepoint = savepoint_newest_verified(job)
    if savepoint is None:
        if not committed_batches(job.checkpoint_location):
            raise ActionFailed(f"{job.name} has no state yet: there is nothing to shadow.")
        savepoint = savepoint_take(job=job, action=action, origin="shadow")
    records = min(int(action.params.get("records") or SHADOW_RECORDS), 100_000)
    ending = shadow_range(job, savepoint, records)
    scratch = job.directory / f"upgrade-shadow-{action.id}"
    dead_letters = f"{job.dead_letter_stream}:shadow-{action.id}"
    remove_tree(scratch)
    try:
        for side in ("old", "new"):
            action_progress(action, f"copying savepoint #{savepoint.id} for the {side} version")
            shutil.copytree(Path(savepoint.path) / "checkpoint", scratch / side)
        action_progress(
            action,
            f"running {job.pipeline} and {target} over {ending['n'] - int(savepoint.manifest['source_offsets'][0]['n'])} records",
        )
        spec = scratch_spec(job, dead_letters) | {
            "old_reference": pipelines.reference(job.pipeline), "new_reference": pipelines.reference(target),
            "ending": ending, "limit": 50,
        }  # fmt: skip
        result = run_state_tool("shadow", scratch, int(savepoint.batch_id or 0), spec=spec)
    finally:
        remove_tree(scratch)
        with suppress(RedisError):
            redis_client().delete(dead_letters)
    read = ending["n"] - int(savepoint.manifest["source_offsets"][0]["n"])
    shadow = {"target": target, "current": job.pipeline, "savepoint": savepoint.id, "records": read, **result}
    remember(action, shadow=shadow)
    counts = result["counts"]
    return (
        f"Shadow run of {target} beside {job.pipeline}, from savepoint #{savepoint.id} over the next {read} records: "
        f"{counts['added']} result rows added, {counts['removed']} removed, {counts['changed']} changed, "
        f"{result['same']} the same."
    )
