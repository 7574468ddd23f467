"""Stateful upgrades: move a job to another pipeline (a new version of its code) with its state.

1. Preview, before anything stops: a scratch copy of the checkpoint re-runs its last committed batch with the new
   pipeline (Spark checks the new code against the old state as a restart would), and the state schemas before and
   after are compared operator by operator. Spark accepts a key whose columns were renamed but kept their types (it
   would read every user's state as a region's); the preview refuses it.
2. Switch: stop after the batch in flight, take a savepoint (the way back), start the new version on the same
   checkpoint, and watch its first batch. If the new version fails before it commits one, the upgrade rolls back by
   itself: the savepoint is restored into a fork and the old version starts on it.
   A quiet job has no input to prove a batch with: the upgrade returns once the new run is up (and a few seconds
   passed without failure), marked "running, not yet proven", and the watch goes on (``upgrades_watch``, every few
   seconds): the first batch proves it, and a failure before that still rolls it back by itself.
3. "Roll back the upgrade" does the same on request, for the job's latest upgrade.

An upgrade asked for within PLAN_KEPT_SECONDS of a preview of the same change (the Deploys tab's Preview, then
Upgrade) uses that preview's plan rather than re-running a batch again: the same target, parameters and source, the
same code of both pipelines (their files' hash), and nothing since that changed the job's pipeline or state layout.

An incompatible change is refused, unless the new version declares a *migration* from the job's pipeline
(``statekeeper_sdk.Migration``) and the upgrade asks for it (``migrate``): the preview then also runs the migration
on a scratch copy and the new version's first batch on its output (``migration_preview``); the upgrade stops the job
with a savepoint at batch N, runs the migration on the savepoint's state, and starts the new version on a new
checkpoint seeded with it, its source reading on after N's offsets and its sinks numbering its batches on from N + 1
(``write_lineage``), so that they neither rewind the history before N nor write a batch twice. Rolling it back is
the rollback of any upgrade: the old version from savepoint N, the sinks rewinding what the migrated line wrote.
"""

from __future__ import annotations

import logging
import re
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone
from statekeeper_sdk._runtime.compatibility import INCOMPATIBLE, compare, described, summary

from dashboard import pipelines
from dashboard.checkpoint_dir.files import (
    CheckpointError,
    committed_batches,
    copy_checkpoint,
    lineage_base,
    remove_tree,
    seed_dir,
    write_lineage,
)
from dashboard.models import (
    Action,
    ActionKind,
    ActionStatus,
    Deploy,
    Job,
    ResultUndo,
    Run,
    Savepoint,
    SavepointStatus,
    StateBackend,
)
from dashboard.records import offset_text
from dashboard.services import state_migration
from dashboard.services.action_keys import (
    SAVEPOINT_TAKEN,
    SPARK_READS,
    STARTED,
    Keys,
    action_progress,
    memo_save,
    remember,
)
from dashboard.services.action_steps import Done, Next, NoneType, Outcome, Steps, Wait, step_seconds
from dashboard.services.errors import ActionFailed
from dashboard.services.forks import fork_name, savepoint_fork, switch_to_fork
from dashboard.services.run_waits import alive_run, exit_step, run_up, start_once, stop_step, stopped
from dashboard.services.savepoints import (
    records_after_savepoint,
    savepoint_check,
    savepoint_copy_step,
    savepoint_files_checked,
    savepoint_read_after,
)
from dashboard.services.state_reader_client import reader_step, state_read, state_read_early
from dashboard.services.upgrade_parts import (
    TARGET_KEYS,
    checked_target,
    migration_refusal,
    next_line_base,
    savepoint_offset,
    scratch_cleanup,
    scratch_dead_letters,
    scratch_dir,
    scratch_spec,
    target_shown,
)

log = logging.getLogger(__name__)

WATCH_MIN_SECONDS = 120  # how long an upgrade waits for the first batch when input is waiting (at least 10 triggers)
QUIET_SECONDS = 3  # how long the new run of a job with no input waiting must stay up before the upgrade returns
PLAN_KEPT_SECONDS = 600  # a preview's plan stands for an upgrade of the same change asked for this soon after it
# what, done after a preview, makes its plan stale: the job's pipeline, its state or its partitions changed
PLAN_SPOILERS = (ActionKind.UPGRADE, ActionKind.BLUE_GREEN, ActionKind.UPGRADE_ROLLBACK, ActionKind.RESTORE,
                 ActionKind.ROLLBACK, ActionKind.RESCALE, ActionKind.SKIP_ENTRIES)  # fmt: skip


def plan_code(source: str, target: str) -> dict[str, str]:
    """The code a plan was made with: the hash of both pipelines' files as they are on disk now."""
    return {"from": source, "to": target, "from_code": pipelines.code_version(source).code_hash,
            "to_code": pipelines.code_version(target).code_hash}  # fmt: skip


def fresh_preview(action: Action, target: str) -> Action | None:
    """The job's preview of this very change whose plan still stands (see the module's note), if any."""
    job = action.job
    if action.kind == ActionKind.UPGRADE_PREVIEW or action.params.get("migrate"):
        return None
    since = timezone.now() - timedelta(seconds=PLAN_KEPT_SECONDS)
    preview = (job.actions.filter(kind=ActionKind.UPGRADE_PREVIEW, status=ActionStatus.SUCCEEDED, finished_at__gte=since)
               .order_by("-id").first())  # fmt: skip
    if preview is None:
        return None
    asked, plan = preview.params, preview.params.get("plan") or {}
    same = (
        asked.get("pipeline") == target and not asked.get("migrate")
        and asked.get("parameters") == action.params.get("parameters")
        and asked.get("from_parameters") == action.params.get("from_parameters")
    )  # fmt: skip
    if not same or plan.get("code") != plan_code(job.pipeline, target):
        return None
    spoiled = job.actions.filter(id__gt=preview.id, kind__in=PLAN_SPOILERS).exclude(status=ActionStatus.FAILED)
    return None if spoiled.exclude(id=action.id).exists() else preview


def _plan_copy(action: Action) -> Outcome:
    """Copy the checkpoint as of its newest committed batch into a scratch directory the plan may change; or, when a
    preview of the same change was just made, take its plan."""
    job = action.job
    target = checked_target(action)
    if (preview := fresh_preview(action, target)) is not None:
        age = (timezone.now() - preview.finished_at).total_seconds() if preview.finished_at else 0
        remember(action, plan=preview.params["plan"], plan_from=preview.id)
        action_progress(action, f"preview #{preview.id} of this change, {age:.0f} s old, stands as the plan")
        return Next("gate")
    shown = described(target, action.params["from_parameters"], action.params["parameters"])
    batches = committed_batches(job.checkpoint_location)
    if not batches:
        plan: dict[str, Any] = {"target": target, "batch": None,
                "verdicts": [], "incompatible": False,
                "summary": f"{job.name} has no committed state yet: {shown} starts from the beginning of the source."}  # fmt: skip
        remember(action, plan=plan)
        return Next("gate")
    batch = batches[-1]
    scratch = scratch_dir(action, "preview")
    remove_tree(scratch)
    action_progress(action, f"copying what re-running batch {batch} needs of the checkpoint into a scratch directory")
    try:
        copy_checkpoint(job.checkpoint_location, scratch, batch, replay=True)
    except CheckpointError as exc:
        raise ActionFailed(f"The checkpoint cannot be copied for the preview: {exc}") from None
    memo_save(action, plan_batch=batch)
    return Next("reader")


SPARK_ERROR_CLASS = re.compile(r"\[[A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*\]")


def not_a_refusal(result: dict[str, Any]) -> bool:
    """Whether a re-run's error may be the copy's rather than the new version's: Spark refuses a version on the state
    while it plans the batch, with its error class (``[STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE]``); a state file missing
    shows as CANNOT_LOAD_STATE_STORE, or as the sink's Python error (the count that runs the batch) without a class."""
    error = str(result.get("replay_error") or "")
    return bool(error) and (
        not SPARK_ERROR_CLASS.search(error) or "CANNOT_LOAD_STATE_STORE" in error or "FileNotFound" in error
    )


def _plan(action: Action) -> Outcome:
    """Re-run the copied batch with the new pipeline, in the warm state reader when it listens (a second or two),
    else in a process of its own while the action waits; then the verdicts. The copy holds only what the re-run needs
    (``copy_checkpoint``'s ``replay``); when the re-run fails otherwise than by Spark's refusal of the new version, it
    runs again on a full copy, whose answer stands: a preview's verdict is never the trimmed copy's."""
    job = action.job
    target = str(action.params.get("pipeline", ""))
    batch = int(action.memo["plan_batch"])
    scratch = scratch_dir(action, "preview")
    spec = scratch_spec(job, scratch_dead_letters(action, "preview")) | {
        "reference": pipelines.reference(target), "parameters": action.params["parameters"],
    }  # fmt: skip
    shown = described(target, action.params["from_parameters"], action.params["parameters"])
    full = bool(action.memo.get("plan_full"))
    action_progress(action, f"re-running batch {batch} with {shown} on the scratch copy" + (" (whole)" if full else ""))

    def fresh_copy() -> None:  # the reader went away mid-plan, or runs older code: a process plans on a new copy
        remove_tree(scratch)
        copy_checkpoint(job.checkpoint_location, scratch, batch, replay=not full)

    try:
        result = state_read(action, "plan-2" if full else "plan", "plan", scratch, batch, spec, fresh_copy)
        if result is not None and not full and not_a_refusal(result):
            log.info("preview #%s: the re-run on the trimmed copy failed (%s); again on a full copy", action.id,
                     str(result["replay_error"])[:300])  # fmt: skip
            memo_save(action, plan_full=True)
            full = True
            try:
                fresh_copy()
            except CheckpointError as exc:  # the batch left the live checkpoint meanwhile: Spark's answer stands
                log.info("preview #%s: no full copy of batch %s: %s", action.id, batch, exc)
            else:
                result = state_read(action, "plan-2", "plan", scratch, batch, spec, fresh_copy)
    except ActionFailed:
        scratch_cleanup(action, "preview")
        raise
    if result is None:
        early = state_read_early(action, "plan-2" if full else "plan")
        if early is not None and "plan" not in action.params:
            plan = _verdict_plan(action, early, proven=False)
            remember(action, plan=plan)
            log.info("preview #%s: verdict at planning, %.2f s after the request", action.id, plan["verdict_seconds"])
        if "plan" in action.params:
            return Wait(f"Spark's verdict is in; batch {batch} runs on the scratch copy to prove it", 1.0)
        return Wait(f"re-running batch {batch} with {shown} on the scratch copy", 1.0)
    scratch_cleanup(action, "preview")
    plan = _verdict_plan(action, result, proven=True)
    if (early_plan := action.params.get("plan")) and early_plan.get("verdicts") != plan["verdicts"]:
        if result.get("replay_error"):  # planned, then failed as it ran: the code, or the state it read
            log.info("preview #%s: the batch failed on the copy after Spark planned it", action.id)
        else:  # the schema view read other schemas than Spark's reader after the commit: the latter stand
            log.warning("preview #%s: the schemas after the batch's run differ from those at planning", action.id)
    remember(action, plan=plan)
    return Next("gate")


def _verdict_plan(action: Action, result: dict[str, Any], proven: bool) -> dict[str, Any]:
    """The plan from a re-run's schemas: the verdicts and their sentence, given once Spark has planned the batch
    (``proven`` False: the batch still runs on the copy, and its answer stands once it has) or after the batch's run.
    ``verdict_at``: when the first verdict came, which the operator read from then on; ``proven_at``: when the
    batch's run answered."""
    job = action.job
    target = str(action.params.get("pipeline", ""))
    batch = int(action.memo["plan_batch"])
    shown = described(target, action.params["from_parameters"], action.params["parameters"])
    verdicts = compare(result, pipelines.find(job.pipeline), pipelines.get(target))
    now = timezone.now().isoformat()
    first = (action.params.get("plan") or {}).get("verdict_at") or now
    return {
        "target": target, "batch": batch, "verdicts": [asdict(v) for v in verdicts],
        "incompatible": any(v.verdict == INCOMPATIBLE for v in verdicts),
        "summary": summary(verdicts, shown, batch, int(result.get("output_rows", 0)) if proven else None),
        "code": plan_code(job.pipeline, target), "proven": proven, "verdict_at": first,
        "verdict_seconds": round((datetime.fromisoformat(first) - action.requested_at).total_seconds(), 3),
        "seconds": result.get("seconds") or {}, **({"proven_at": now} if proven else {}),
    }  # fmt: skip


# ``plan_steps``': the batch the scratch copy re-runs, whether it runs again on a full copy (the trimmed one failed),
# the plan shown, and the preview whose plan an upgrade took
PLAN_KEYS = (
    SPARK_READS
    + TARGET_KEYS
    + Keys(memo={"plan_batch": int, "plan_full": bool}, params={"plan": dict, "plan_from": int})
)


def plan_steps() -> Steps:
    """The preview's steps, "copy", "reader" (until it listens) and "plan", which leave the plan in the action's
    params and go on to "gate"."""
    return {
        "copy": ("copy the checkpoint for the preview", _plan_copy),
        **reader_step(then="plan"),
        "plan": ("re-run a batch with the new version", _plan),
    }


def _start_empty(action: Action, savepoint: Savepoint) -> str:
    """Point the job at a new, empty checkpoint directory that starts reading where the savepoint's batch ended, its
    batches numbered on from the savepoint's for the sinks."""
    job = action.job
    offset = savepoint_offset(action, savepoint)
    fork = fork_name(action, "upgrade")
    remove_tree(job.directory / fork)
    write_lineage(job.directory / fork, next_line_base(savepoint), after_savepoint=savepoint.id, upgrade=action.id,
                  reason="empty state")  # fmt: skip
    switch_to_fork(job, fork)
    Job.objects.filter(id=job.id).update(start_offset=offset)
    operators = sorted(
        {v["operator"] for v in action.params.get("plan", {}).get("verdicts", []) if v["operator"] != "query"}
    )
    return (
        f"; started with empty state ({', '.join(operators) or 'every operator'}) in {fork}, reading on from "
        f"{offset_text(offset)}"
    )


def _start_migrated(action: Action, savepoint: Savepoint) -> str:
    """Point the job at the new checkpoint the migration seeded (``state_migration``), reading on where the savepoint's
    batch ended; a memory job's migrated line runs on RocksDB when the new version needs it."""
    job = action.job
    offset = savepoint_offset(action, savepoint)
    fork = fork_name(action, "upgrade")
    if not (seed_dir(job.directory / fork) / "_SUCCESS").exists():
        raise ActionFailed(f"The migrated state of {fork} is missing; the job was not switched.")
    switch_to_fork(job, fork)
    update: dict[str, Any] = {"start_offset": offset}
    new = pipelines.get(action.params["plan"]["target"])
    if new.needs_rocksdb and job.state_backend == StateBackend.MEMORY:
        remember(action, from_backend=job.state_backend)  # the way back runs the old version's memory state
        update["state_backend"] = StateBackend.ROCKSDB
        job.state_backend = StateBackend.ROCKSDB
    Job.objects.filter(id=job.id).update(**update)
    done = action.params.get("migration", {})
    return (
        f"; state migrated from batch {savepoint.batch_id} ({done.get('rows_in', '?')} rows → {done.get('rows_out', '?')} "
        f"rows, {done.get('keys_out', '?')} keys) into {fork}, reading on from {offset_text(offset)}; the sinks go on "
        f"from batch {next_line_base(savepoint)}"
    )


def forget_undo(job: Job) -> None:
    """Drop what the job's batches changed in the results table (``ResultUndo``) when it moves to a checkpoint whose
    batches are numbered afresh (an empty-state upgrade, or the way back from one): those records name the other
    line's batches, and the new line's batch 0 would undo every one of them. The results they wrote stay."""
    ResultUndo.objects.filter(job=job).delete()


def latest_upgrade(job: Job) -> Action | None:
    kinds = (ActionKind.UPGRADE, ActionKind.BLUE_GREEN)
    return job.actions.filter(kind__in=kinds, status=ActionStatus.SUCCEEDED).order_by("-id").first()


def _verdict(action: Action) -> Outcome:
    """The plan's verdict; a state migration asked for (and a batch to migrate) is previewed next."""
    if action.params.get("migrate") and action.params["plan"]["batch"] is not None:
        return Next("migration-copy")
    return Done(str(action.params["plan"]["summary"]))


PREVIEW_KEYS = PLAN_KEYS + state_migration.MIGRATION_PREVIEW_KEYS
PREVIEW_STEPS: Steps = {
    **plan_steps(),
    "gate": ("verdict", _verdict),
    "migration-copy": ("copy the checkpoint for the migration", state_migration.preview_copy),
    "migration": ("migrate the state and run a first batch on it", state_migration.preview_run),
}


def _gate(action: Action) -> Next:
    """Refuse an incompatible change before anything stops (unless with empty state, or migrated)."""
    job = action.job
    plan = action.params["plan"]
    source = action.params.get("from_pipeline") or job.pipeline
    empty = bool(action.params.get("empty_state"))
    migrate = bool(action.params.get("migrate")) and plan["batch"] is not None
    remember(action, from_pipeline=source)
    if plan["incompatible"] and not (empty or migrate):
        way = (
            f"migrate the state: {plan['target']} declares how to build its state from {source}'s"
            if pipelines.migration(plan["target"], source) is not None
            else f"upgrade with empty state: the new version starts from where {source} stopped, with nothing in its "
            f"state, and {source}'s state stays in the savepoint"
        )
        raise ActionFailed(f"Refused before anything stopped. {plan['summary']}. To run it anyway, {way}.")
    if empty and not (job.reads_redis or job.reads_kafka):
        raise ActionFailed(
            "Starting with empty state needs a Redis stream or Kafka source (a start offset); nothing stopped."
        )
    if migrate and (refused := migration_refusal(job, plan["target"])):
        raise ActionFailed(f"{refused} Nothing stopped.")
    if "was_running" not in action.params:
        remember(action, was_running=alive_run(job) is not None)
    return Next("stop")


def _stop(action: Action) -> Outcome:
    job = action.job
    if (waiting := stopped(action, job)) is not None:
        return waiting
    return Next("savepoint" if committed_batches(job.checkpoint_location) else "switch")


def _switch(action: Action) -> Outcome:
    job = action.job
    source = action.params["from_pipeline"]
    target = target_shown(action)
    savepoint = Savepoint.objects.filter(id=action.params.get("savepoint")).first()
    emptied = ""
    if savepoint is not None:
        remember(action, from_deploy=savepoint.deploy_id)
        if action.memo.get("migrated"):
            emptied = _start_migrated(action, savepoint)
        elif action.params.get("empty_state"):
            emptied = _start_empty(action, savepoint)
    values = action.params.get("parameters", job.parameters)
    Job.objects.filter(id=job.id).update(
        pipeline=action.params["plan"]["target"], parameters=values, updated_at=timezone.now()
    )
    job.pipeline, job.parameters = action.params["plan"]["target"], values
    kept = f"savepoint #{savepoint.id} of {source} kept as the way back" if savepoint else "no state to keep"
    remember(action, kept=kept + emptied)
    if not action.params["was_running"] and not action.params.get("start"):
        spec_applied(action)
        return Done(
            f"Switched {job.name} from {source} to {target}; {kept}{emptied}. The job stays stopped: its next start "
            f"runs {target}."
        )
    return Next("start")


def _start(action: Action) -> Next:
    start_once(action, launch=True)
    return Next("up")


def _up(action: Action) -> Outcome:
    run = Run.objects.get(id=action.params["run"])
    state = run_up(action, run)
    if isinstance(state, Wait):
        return state
    if isinstance(state, str):
        memo_save(action, failure=state)
        return Next("roll-back")
    memo_save(action, input_waiting=records_after_savepoint(action))
    return Next("first-batch")


def after_batch(action: Action) -> int | None:
    """The batch the new version's first own batch comes after (None: any batch proves it, a new checkpoint)."""
    if action.params.get("empty_state") or action.memo.get("migrated"):
        return None
    savepoint = Savepoint.objects.filter(id=action.params.get("savepoint")).first()
    return savepoint.batch_id if savepoint else None


def first_batch(run: Run, after_batch: int | None) -> int | None:
    """The first batch the run committed after ``after_batch``, or None."""
    committed = run.checkpoints.all()
    if after_batch is not None:
        committed = committed.filter(batch_id__gt=after_batch)
    first = committed.order_by("batch_id").values_list("batch_id", flat=True).first()
    return int(first) if first is not None else None


def verify_beside(action: Action) -> Outcome:
    """The savepoint's checksums, now (and its manifest kept: where its batch ended, which the switch reads); Spark's
    reading of its state waits until the new version's first batch (``savepoint_read_after``), so that it does not share the
    cores with that batch while the output is stopped, and the upgrade returns only once it has answered. A migration
    reads that state: its upgrade waits for the whole verification first."""
    if action.params.get("migrate"):
        checked = savepoint_check(action)
        return checked if isinstance(checked, Wait) else Next("migrate")
    savepoint_files_checked(action)
    return Next("migrate")


def _first_batch(action: Action) -> Outcome:
    run = Run.objects.get(id=action.params["run"])
    job = action.job
    if (batch := first_batch(run, after_batch(action))) is not None:
        if isinstance(checked := savepoint_read_after(action), Wait):
            return checked
        proof = {"state": "proven", "batch": batch, "at": timezone.now().isoformat()}
        return _upgraded(action, run, proof, checked)
    if not run.is_active:
        memo_save(action, failure=run.message or f"run #{run.id} ended {run.status}")
        return Next("roll-back")
    window = (
        float(action.params.get("watch_seconds") or max(WATCH_MIN_SECONDS, 10 * job.trigger_interval_seconds))
        if action.memo.get("input_waiting")
        else QUIET_SECONDS
    )
    if step_seconds(action) < window:
        return Wait(f"run #{run.id} of {job.pipeline} is up: waiting for its first batch", 0.5)
    if isinstance(checked := savepoint_read_after(action), Wait):
        return checked
    return _upgraded(action, run, {"state": "unproven", "since": timezone.now().isoformat()}, checked)


def spec_applied(action: Action) -> None:
    """An upgrade that `statekeeper apply` asked for has made its pipeline and parameters the job's applied spec."""
    if action.params.get("from_spec"):
        job = action.job
        job.refresh_from_db(fields=["pipeline", "parameters", "state_partitions"])
        applied = {"pipeline": job.pipeline, "parameters": job.parameters}
        if action.params.get("state_partitions") is not None:  # a blue/green rescale
            applied["state_partitions"] = job.state_partitions
        job.spec_applied(applied)


def _upgraded(action: Action, run: Run, proof: dict[str, Any], unverified: str = "") -> Done:
    job = action.job
    run.refresh_from_db()
    if run.deploy_id:
        Deploy.objects.filter(id=run.deploy_id, upgrade=None).update(upgrade=action)
    remember(action, proof=proof)
    spec_applied(action)
    source = action.params["from_pipeline"]
    target = target_shown(action)
    shown = (
        f"committed its first batch ({proof['batch']})"
        if proof["state"] == "proven"
        else "is running, not yet proven (no input yet for a first batch; it is watched, and rolls back by itself if "
        "its first batch fails)"
    )
    done = f"Upgraded {job.name} from {source} to {target}; run #{run.id} {shown}; {action.params['kept']}."
    if unverified:
        done += (f" But savepoint #{action.params['savepoint']}, the way back, failed its verification "
                 f"({unverified}): the upgrade cannot be rolled back; take a savepoint now.")  # fmt: skip
    return Done(done)


def _roll_back_stop(action: Action) -> Outcome:
    action_progress(
        action, f"{action.params['plan']['target']} failed: rolling back to {action.params['from_pipeline']}"
    )
    return stopped(action, action.job) or Next("roll-back-exit")


def _put_back(action: Action, savepoint: Savepoint | None, to_pipeline: str) -> str:
    """Put back the savepoint taken before the upgrade (in a fork, once), the old pipeline and its parameters."""
    job = action.job
    fork = fork_name(action, "upgrade-rollback")
    if Job.objects.filter(id=job.id, start_offset__isnull=False).exists() and not lineage_base(
        job.checkpoint_location
    ):  # leaving an empty-state line numbered afresh (made before lines had a base): its undo records name its batches
        forget_undo(job)
    if savepoint is not None and job.checkpoint_dir != fork:
        savepoint_fork(action, savepoint, fork)
        switch_to_fork(job, fork)
    values = action.params.get("from_parameters", job.parameters)
    backend = action.params.get("from_backend") or job.state_backend
    # the savepoint's own partitions: a blue/green rescale's way back is the state before its repartition
    partitions = int((savepoint.manifest if savepoint else {}).get("state_partitions") or job.state_partitions)
    Job.objects.filter(id=job.id).update(
        pipeline=to_pipeline, parameters=values, start_offset=None, state_backend=backend, updated_at=timezone.now(),
        state_partitions=partitions,
    )  # fmt: skip
    job.pipeline, job.parameters, job.state_backend, job.state_partitions = to_pipeline, values, backend, partitions
    return f"savepoint #{savepoint.id} (batch {savepoint.batch_id})" if savepoint else "the beginning"


def _roll_back_fork(action: Action) -> Outcome:
    savepoint = Savepoint.objects.filter(id=action.params.get("savepoint")).first()
    if savepoint is not None and isinstance(checked := savepoint_check(action), Wait):  # verified before it is used
        return checked
    memo_save(action, put_back=_put_back(action, savepoint, action.params["from_pipeline"]))
    return Next("roll-back-start")


def _roll_back_start(action: Action) -> Done:
    run = start_once(action, key="rollback_run", launch=True)
    source = action.params["from_pipeline"]
    target = target_shown(action)
    failure = str(action.memo.get("failure", "")).strip()[:600]
    raise ActionFailed(
        f"The upgrade to {target} failed ({failure}) and was rolled back by itself: {source} from "
        f"{action.memo['put_back']}, run #{run.id} starting."
    )


UPGRADE_KEYS = (
    PLAN_KEYS + state_migration.MIGRATION_KEYS + STARTED + SAVEPOINT_TAKEN + Keys(
        memo={
            "failure": str,  # why the new version failed, for "roll-back"
            "input_waiting": bool,  # records wait for the new run's first batch
            "put_back": str,  # what its rollback put back
        },
        params={
            "from_backend": str, "from_deploy": (int, NoneType), "from_pipeline": str, "was_running": bool,
            "kept": str,  # the checkpoint directory the old version's line is kept in
            "proof": dict,  # the new version's first batch (or its failure), as the upgrade's watch saw it
            "rollback_run": int,  # the run a failed first batch's rollback started
        },
    )
)  # fmt: skip
UPGRADE_STEPS: Steps = {
    **plan_steps(),
    "gate": ("refuse an incompatible change", _gate),
    "stop": ("stop the job", _stop),
    "savepoint": savepoint_copy_step("before-upgrade"),
    "verify": ("verify the savepoint", verify_beside),
    "migrate": ("migrate the state (a migration asked for; otherwise on to the switch)", state_migration.migrate),
    "switch": ("switch the pipeline", _switch),
    "start": ("start the new version", _start),
    "up": ("the new run comes up", _up),
    "first-batch": ("its first batch", _first_batch),
    "roll-back": ("roll back: stop", _roll_back_stop),
    "roll-back-exit": exit_step(then="roll-back-fork"),
    "roll-back-fork": ("roll back: restore the savepoint", _roll_back_fork),
    "roll-back-start": ("roll back: start the old version", _roll_back_start),
}


def _rollback_check(action: Action) -> Next:
    job = action.job
    upgrade = latest_upgrade(job)
    if upgrade is None or upgrade.id != int(action.params.get("upgrade") or 0):
        raise ActionFailed("Only the job's latest succeeded upgrade can be rolled back; nothing was changed.")
    upgraded_to = upgrade.params.get("parameters")
    if job.pipeline != upgrade.params.get("pipeline") or upgraded_to is not None and job.parameters != upgraded_to:
        shown = described(str(upgrade.params.get("pipeline")), upgrade.params.get("from_parameters", {}),
                          upgraded_to or {})  # fmt: skip
        raise ActionFailed(f"{job.name} no longer runs {shown}; nothing was changed.")
    savepoint = (
        job.savepoints.filter(id=upgrade.params.get("savepoint")).first() if upgrade.params.get("savepoint") else None
    )
    if upgrade.params.get("savepoint") and (savepoint is None or savepoint.status != SavepointStatus.VERIFIED):
        raise ActionFailed(
            "The savepoint taken before the upgrade is gone or failed its verification; the upgrade cannot be rolled "
            "back."
        )
    remember(
        action, savepoint=savepoint.id if savepoint else None, from_pipeline=upgrade.params["from_pipeline"],
        from_parameters=upgrade.params.get("from_parameters", job.parameters),
        from_backend=upgrade.params.get("from_backend", ""),
        was_running=alive_run(job) is not None or bool(action.params.get("automatic")),
    )  # fmt: skip
    return Next("stop")


def _rollback_fork(action: Action) -> Outcome:
    savepoint = Savepoint.objects.filter(id=action.params.get("savepoint")).first()
    memo_save(action, put_back=_put_back(action, savepoint, action.params["from_pipeline"]))
    return Next("start") if action.params["was_running"] else Next("done")


def _rollback_start(action: Action) -> Next:
    start_once(action, launch=True)
    return Next("done")


def _rolled_back(action: Action) -> Done:
    upgrade = int(action.params["upgrade"])
    where = f"{action.params['from_pipeline']} from {action.memo['put_back']}"
    started = f", run #{action.params['run']} starting" if action.params.get("run") else "; the job stays stopped"
    if action.params.get("automatic"):
        return Done(
            f"Upgrade #{upgrade} failed after it returned ({action.params.get('cause', '')[:600]}) and was rolled back "
            f"by itself: {where}{started}."
        )
    return Done(f"Rolled back upgrade #{upgrade}: {where}{started}.")


UPGRADE_ROLLBACK_KEYS = (
    STARTED
    + SAVEPOINT_TAKEN
    + Keys(
        memo={"put_back": str},
        params={"from_backend": str, "from_parameters": dict, "from_pipeline": str, "was_running": bool},
    )
)
UPGRADE_ROLLBACK_STEPS: Steps = {
    "check": ("check the upgrade", _rollback_check),
    "stop": stop_step(then="exit"),
    "exit": exit_step(then="fork"),
    "fork": ("restore the savepoint", _rollback_fork),
    "start": ("start the old version", _rollback_start),
    "done": ("rolled back", _rolled_back),
}
