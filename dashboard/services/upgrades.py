"""Stateful upgrades: move a job to another pipeline (a new version of its code) with its state.

1. Preview, before anything stops: a scratch copy of the checkpoint re-runs its last committed batch with the new
   pipeline (Spark checks the new code against the old state as a restart would), and the state schemas before and
   after are compared operator by operator. Spark accepts a key whose columns were renamed but kept their types (it
   would read every user's state as a region's); the preview refuses it.
2. Switch: stop after the batch in flight, take a savepoint (the way back), start the new version on the same
   checkpoint, and watch its first batch. If the new version fails before it commits one, the upgrade rolls back by
   itself: the savepoint is restored into a fork and the old version starts on it.
3. "Roll back the upgrade" does the same on request, for the job's latest upgrade.
"""

from __future__ import annotations

import time
from contextlib import suppress
from dataclasses import asdict, dataclass
from typing import Any

from django.conf import settings
from django.utils import timezone
from redis.exceptions import RedisError

from dashboard import pipelines
from dashboard.checkpoint_dir.files import CheckpointError, committed_batches, copy_checkpoint, remove_tree
from dashboard.connections import redis_client
from dashboard.models import Action, ActionKind, ActionStatus, Deploy, Job, Run, RunStatus, Savepoint, SavepointStatus
from dashboard.services.action_steps import action_progress, alive_run, run_state_tool, wait_until_stopped
from dashboard.services.errors import ActionFailed
from dashboard.services.forks import savepoint_fork, switch_to_fork
from dashboard.services.runs import job_request_start
from dashboard.services.savepoints import savepoint_take

COMPATIBLE, EVOLVES, INCOMPATIBLE = "compatible", "evolves", "incompatible"
WATCH_MIN_SECONDS = 120  # how long the new version gets to commit its first batch (at least 10 triggers)


@dataclass
class Verdict:
    operator: str
    variable: str
    verdict: str
    reason: str


def _columns(schema: dict[str, Any] | None) -> dict[str, str]:
    """A struct schema's fields as name -> type (a nested type as its JSON)."""
    if not schema:
        return {}
    return {f["name"]: f["type"] if isinstance(f["type"], str) else str(f["type"]) for f in schema.get("fields", [])}


def _shown(columns: dict[str, str]) -> str:
    return "(" + ", ".join(f"{name} {kind}" for name, kind in columns.items()) + ")"


def _variable_verdict(operator: str, name: str, before: dict[str, Any], after: dict[str, Any]) -> Verdict:
    old_key, new_key = _columns(before["key"]), _columns(after["key"])
    if old_key != new_key:
        return Verdict(
            operator, name, INCOMPATIBLE,
            f"key schema changed: {_shown(old_key)} → {_shown(new_key)}; the old state would be read under new keys",
        )  # fmt: skip
    old_value, new_value = _columns(before["value"]), _columns(after["value"])
    if old_value == new_value:
        return Verdict(operator, name, COMPATIBLE, "same key and value schema")
    changes = [f"added {f}" for f in new_value if f not in old_value]
    changes += [f"removed {f}" for f in old_value if f not in new_value]
    changes += [
        f"{f} {old_value[f]} → {new_value[f]}" for f in old_value if f in new_value and old_value[f] != new_value[f]
    ]
    if not changes:
        changes = ["fields reordered"]
    return Verdict(operator, name, EVOLVES, "Spark's schema evolution reads the old values: " + ", ".join(changes))


def compare(result: dict[str, Any], old: Any, new: Any) -> list[Verdict]:
    """Verdicts per operator and state variable, from the state tool's plan and the two pipelines."""
    verdicts = []
    if old is not None and old.output_mode != new.output_mode:
        verdicts.append(
            Verdict("query", "", INCOMPATIBLE, f"output mode changed: {old.output_mode} → {new.output_mode}")
        )
    if error := result.get("replay_error"):
        verdicts.append(Verdict("query", "", INCOMPATIBLE, f"Spark refused the new version on this state: {error}"))
        return verdicts
    before = {op["id"]: op for op in result["before"]}
    after = {op["id"]: op for op in result["after"]}
    for op_id in sorted(before.keys() | after.keys()):
        label = f"{op_id} {(before.get(op_id) or after[op_id])['name']}"
        if op_id not in after:
            verdicts.append(Verdict(label, "", INCOMPATIBLE, "operator removed: its state would be left behind"))
            continue
        if op_id not in before:
            verdicts.append(Verdict(label, "", INCOMPATIBLE, "operator added: it has no state to start from"))
            continue
        if before[op_id]["name"] != after[op_id]["name"]:
            verdicts.append(
                Verdict(label, "", INCOMPATIBLE, f"operator replaced by {after[op_id]['name']} at the same place")
            )
            continue
        old_vars, new_vars = before[op_id]["variables"], after[op_id]["variables"]
        for name in sorted(old_vars.keys() | new_vars.keys()):
            if name not in new_vars:
                verdicts.append(Verdict(label, name, INCOMPATIBLE, "state variable removed: its state would be lost"))
            elif name not in old_vars:
                verdicts.append(Verdict(label, name, COMPATIBLE, "new state variable: it starts empty"))
            else:
                verdicts.append(_variable_verdict(label, name, old_vars[name], new_vars[name]))
    return verdicts


def upgrade_refusal(job: Job, target: str) -> str:
    """Why ``target`` cannot even be previewed for the job; empty when it can."""
    new = pipelines.find(target)
    if new is None:
        return f"There is no registered pipeline {target!r}; the registry has {', '.join(pipelines.names())}."
    if target == job.pipeline:
        return f"{job.name} already runs {target}."
    if new.needs_rocksdb and job.state_backend != "rocksdb":
        return (
            f"{target} keeps transformWithState state, which needs the RocksDB backend; {job.name} uses "
            f"{job.state_backend}."
        )
    return ""


def upgrade_plan(action: Action, target: str) -> dict[str, Any]:
    """The preview of moving the job to ``target``: verdicts, and whether the upgrade may go ahead. Runs Spark on a
    scratch copy; the job keeps running and nothing of it changes."""
    job = action.job
    if refusal := upgrade_refusal(job, target):
        raise ActionFailed(refusal)
    new, old = pipelines.get(target), pipelines.find(job.pipeline)
    batches = committed_batches(job.checkpoint_location)
    if not batches:
        return {"target": target, "batch": None, "verdicts": [], "incompatible": False,
                "summary": f"{job.name} has no committed state yet: {target} starts from the beginning of the source."}  # fmt: skip
    batch = batches[-1]
    scratch = job.directory / f"upgrade-preview-{action.id}"
    dead_letters = f"{job.dead_letter_stream}:preview-{action.id}"
    remove_tree(scratch)
    try:
        action_progress(action, f"copying the checkpoint as of batch {batch} into a scratch directory")
        copy_checkpoint(job.checkpoint_location, scratch, batch)
        action_progress(action, f"re-running batch {batch} with {target} on the scratch copy")
        spec = scratch_spec(job, dead_letters) | {"reference": pipelines.reference(target)}
        result = run_state_tool("plan", scratch, batch, spec=spec)
    except CheckpointError as exc:
        raise ActionFailed(f"The checkpoint cannot be copied for the preview: {exc}") from None
    finally:
        remove_tree(scratch)
        with suppress(RedisError):  # a Redis hiccup must not fail the preview; the key holds only replayed rejects
            redis_client().delete(dead_letters)
    verdicts = compare(result, old, new)
    bad = [v for v in verdicts if v.verdict == INCOMPATIBLE]
    if bad:
        summary = f"Incompatible with {target}: " + "; ".join(
            f"{' '.join(filter(None, (v.operator, v.variable)))}: {v.reason}" for v in bad
        )
    else:
        evolving = sum(v.verdict == EVOLVES for v in verdicts)
        summary = (
            f"Compatible with {target} at batch {batch}"
            + (f" ({evolving} state variable(s) through Spark's schema evolution)" if evolving else "")
            + f"; the replayed batch produced {result.get('output_rows', 0)} result rows."
        )
    return {"target": target, "batch": batch, "verdicts": [asdict(v) for v in verdicts], "incompatible": bool(bad),
            "summary": summary}  # fmt: skip


def scratch_spec(job: Job, dead_letters: str) -> dict[str, Any]:
    """What the state tool needs to read the job's source beside it, with rejects going to a scratch key."""
    return {
        "stream": job.source_stream, "redis_url": settings.REDIS_URL, "backend": job.state_backend,
        "partitions": job.state_partitions, "max_records": job.max_records_per_batch, "dead_letter": dead_letters,
        "skip_list": job.skip_list, "max_future_seconds": job.max_future_seconds, "source_kind": job.source_kind,
        "source_path": job.source_path, "source_format": job.source_format,
    }  # fmt: skip


def remember(action: Action, **params: Any) -> None:
    action.params = {**action.params, **params}
    Action.objects.filter(id=action.id).update(params=action.params)


def upgrade_preview_action(action: Action) -> str:
    plan = upgrade_plan(action, str(action.params.get("pipeline", "")))
    remember(action, plan=plan)
    return str(plan["summary"])


def _watch(run: Run, after_batch: int | None, seconds: float) -> str:
    """'' when the new run committed a batch (or is running and healthy at the deadline, with no input to prove a
    batch), else why it failed: it ended (failed, lost, refused, stopped) or never started running."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        run.refresh_from_db()
        committed = run.checkpoints.all()
        if after_batch is not None:
            committed = committed.filter(batch_id__gt=after_batch)
        if committed.exists():
            return ""
        if not run.is_active:
            return run.message or f"run #{run.id} ended {run.status}"
        time.sleep(0.5)
    if run.status != RunStatus.RUNNING:
        return f"run #{run.id} was still {run.status} after {seconds:.0f} s"
    return ""


def _wait_for_exit(job: Job, seconds: float = 60) -> None:
    """A failed driver ends its process a few seconds after its run ended; the checkpoint is touched only after."""
    deadline = time.monotonic() + seconds
    while alive_run(job) is not None:
        if time.monotonic() > deadline:
            raise ActionFailed(f"run #{alive_run(job).id} of {job.name} is still alive; nothing was restored")  # type: ignore[union-attr]
        time.sleep(0.5)


def _roll_back(action: Action, savepoint: Savepoint | None, to_pipeline: str, start: bool) -> str:
    """Stop the job, put back the savepoint taken before the upgrade (in a fork) and the old pipeline, start it."""
    job = action.job
    wait_until_stopped(action, job)
    _wait_for_exit(job)
    if savepoint is not None:
        fork = f"checkpoint-upgrade-rollback-{action.id}"
        savepoint_fork(action, savepoint, fork)
        switch_to_fork(job, fork)
    Job.objects.filter(id=job.id).update(pipeline=to_pipeline, start_offset=None, updated_at=timezone.now())
    job.pipeline = to_pipeline
    where = f"savepoint #{savepoint.id} (batch {savepoint.batch_id})" if savepoint else "the beginning"
    if not start:
        return f"{to_pipeline} from {where}; the job stays stopped"
    run = job_request_start(job=job, requested_by=action.requested_by)
    return f"{to_pipeline} from {where}, run #{run.id} starting"


def _start_empty(action: Action, savepoint: Savepoint) -> str:
    """Point the job at a new, empty checkpoint directory that starts reading where the savepoint's batch ended."""
    job = action.job
    offset = (savepoint.manifest.get("source_offsets") or [None])[0]
    if not isinstance(offset, dict) or "id" not in offset:
        raise ActionFailed(f"Savepoint #{savepoint.id} does not say where {job.source_stream} was read to.")
    fork = f"checkpoint-upgrade-{action.id}"
    remove_tree(job.directory / fork)
    switch_to_fork(job, fork)
    Job.objects.filter(id=job.id).update(start_offset={"id": offset["id"], "n": int(offset["n"])})
    operators = sorted(
        {v["operator"] for v in action.params.get("plan", {}).get("verdicts", []) if v["operator"] != "query"}
    )
    return (
        f"; started with empty state ({', '.join(operators) or 'every operator'}) in {fork}, reading on from "
        f"entry {offset['id']}"
    )


def upgrade_action(action: Action) -> str:
    job = action.job
    target = str(action.params.get("pipeline", ""))
    source = job.pipeline
    empty = bool(action.params.get("empty_state"))
    plan = upgrade_plan(action, target)
    remember(action, plan=plan, from_pipeline=source)
    if plan["incompatible"] and not empty:
        raise ActionFailed(
            f"Refused before anything stopped. {plan['summary']}. To run it anyway, upgrade with empty state: the new "
            f"version starts from where {source} stopped, with nothing in its state, and {source}'s state stays in "
            "the savepoint."
        )
    if empty and not job.reads_redis:
        raise ActionFailed("Starting with empty state needs a Redis stream source (a start offset); nothing stopped.")
    was_running = alive_run(job) is not None
    wait_until_stopped(action, job)
    savepoint = None
    if committed_batches(job.checkpoint_location):
        savepoint = savepoint_take(job=job, action=action, origin="before-upgrade")
        remember(action, savepoint=savepoint.id, from_deploy=savepoint.deploy_id)
    emptied = ""
    if empty and savepoint is not None:
        emptied = _start_empty(action, savepoint)
    Job.objects.filter(id=job.id).update(pipeline=target, updated_at=timezone.now())
    job.pipeline = target
    kept = f"savepoint #{savepoint.id} of {source} kept as the way back" if savepoint else "no state to keep"
    kept += emptied
    if not was_running and not action.params.get("start"):
        return f"Switched {job.name} from {source} to {target}; {kept}. The job stays stopped: its next start runs {target}."
    run = job_request_start(job=job, requested_by=action.requested_by)
    remember(action, run=run.id)
    action_progress(action, f"run #{run.id} of {target} starting: waiting for its first batch")
    watch = float(action.params.get("watch_seconds") or max(WATCH_MIN_SECONDS, 10 * job.trigger_interval_seconds))
    failure = _watch(run, savepoint.batch_id if savepoint and not emptied else None, watch)
    if failure:
        action_progress(action, f"{target} failed: rolling back to {source}")
        back = _roll_back(action, savepoint, source, start=True)
        raise ActionFailed(
            f"The upgrade to {target} failed ({failure.strip()[:600]}) and was rolled back by itself: {back}."
        )
    run.refresh_from_db()
    if run.deploy_id:
        Deploy.objects.filter(id=run.deploy_id, upgrade=None).update(upgrade=action)
    committed = run.checkpoints.exists()
    return (
        f"Upgraded {job.name} from {source} to {target}; run #{run.id} "
        f"{'committed its first batch' if committed else 'is running (no new input yet to prove a batch)'}; {kept}."
    )


def latest_upgrade(job: Job) -> Action | None:
    return job.actions.filter(kind=ActionKind.UPGRADE, status=ActionStatus.SUCCEEDED).order_by("-id").first()


def upgrade_rollback_action(action: Action) -> str:
    job = action.job
    upgrade = latest_upgrade(job)
    if upgrade is None or upgrade.id != int(action.params.get("upgrade") or 0):
        raise ActionFailed("Only the job's latest succeeded upgrade can be rolled back; nothing was changed.")
    if job.pipeline != upgrade.params.get("pipeline"):
        raise ActionFailed(f"{job.name} no longer runs {upgrade.params.get('pipeline')}; nothing was changed.")
    savepoint = (
        job.savepoints.filter(id=upgrade.params.get("savepoint")).first() if upgrade.params.get("savepoint") else None
    )
    if upgrade.params.get("savepoint") and (savepoint is None or savepoint.status != SavepointStatus.VERIFIED):
        raise ActionFailed("The savepoint taken before the upgrade is gone; the upgrade cannot be rolled back.")
    was_running = alive_run(job) is not None
    back = _roll_back(action, savepoint, str(upgrade.params["from_pipeline"]), start=was_running)
    return f"Rolled back upgrade #{upgrade.id}: {back}."
