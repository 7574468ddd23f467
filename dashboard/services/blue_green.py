"""Blue/green upgrades: change a running job (a new pipeline version, new parameter values, new state partitions)
without stopping its output, and hand over at a committed batch with every sink exact.

1. Preview, as a savepoint upgrade does: an incompatible change is refused before anything starts. A rescale alone
   (the same version, new state partitions) needs none.
2. A savepoint of the job's ("blue's") newest committed batch K, the way back; it is copied into a fork. For a
   rescale, Spark's offline repartition rewrites the fork's state (as a batch K+1 of no input, so green's batches are
   numbered one ahead of blue's from then on: green's K+2 runs blue's K+1, and its checkpoint's lineage base is one
   less, so the sinks number it K+1 too), and Spark's state reader checks that it loads.
3. Green, the new version, starts on the fork beside blue: in the shared driver for a job that runs there, else in a
   driver of its own, which is started before step 2 and waits with its Spark up, so that the fork is of blue's
   newest batch rather than one a JVM's start old. Its source follows blue's checkpoint: green's batch K+1 reads exactly blue's batch K+1's offsets
   once blue committed it, and so on (workers/green.py). Green writes no sink; each of its batches is compared with
   what blue wrote for the same batch (rows added, removed, changed), shown live on the job's page.
4. The handover, on the operator's word or by itself when green is caught up and the diff passes the rules given,
   is one transaction: the lease's token moves to green's run (every sink refuses blue's from then on), the job's
   checkpoint becomes green's fork, its pipeline and parameters the new ones. Blue's run ends "handed over"; green
   writes the job's sinks from the batch after the last one blue committed.
5. An abort before the handover stops green and removes its fork and its diff; blue was never touched.

A green that dies before the handover is started again on its fork (it goes on following blue); after the handover
green is the job's run, restarted under the job's strategy as any run. The job's "roll back the upgrade" returns to
the savepoint of step 2, as after a savepoint upgrade."""

from __future__ import annotations

import functools
import json
import os
import uuid
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Sum
from django.utils import timezone

from dashboard import pipelines
from dashboard.checkpoint_dir.files import (
    CheckpointError,
    committed_batches,
    follow_mirror,
    handover_file,
    latest_committed,
    lineage,
    lineage_base,
    mark_handed_over,
    mirror_committed,
    remove_tree,
    write_lineage,
)
from dashboard.green_order import GreenOrder, order_write, reported, reports_checked
from dashboard.models import (
    ACTIVE_RUN_STATUSES,
    Action,
    ActionKind,
    ActionStatus,
    Checkpoint,
    Deploy,
    GreenBatch,
    Job,
    Run,
    RunStatus,
    Savepoint,
    StateBackend,
)
from dashboard.services import state_migration
from dashboard.services.action_keys import SAVEPOINT_TAKEN, STARTED, Keys, action_progress, memo_save, remember
from dashboard.services.action_steps import Done, Next, NoneType, Outcome, Step, Steps, Wait, step_seconds
from dashboard.services.errors import ActionAborted, ActionFailed, ActionRefused
from dashboard.services.forks import fork_name, savepoint_fork
from dashboard.services.hosts import host_for_launch, shared_master_label
from dashboard.services.rescale import MEMORY_REPARTITION, repartition_wait, state_loads_wait
from dashboard.services.run_waits import active_run
from dashboard.services.runs import own_driver_settings, run_holds_process, shares_driver, spawn_driver
from dashboard.services.savepoints import savepoint_steps
from dashboard.services.upgrade_parts import (
    current_parameters,
    migration_refusal,
    savepoint_offset,
    target_parameters,
    target_shown,
)
from dashboard.services.upgrades import PLAN_KEYS, plan_steps, spec_applied
from dashboard.units import bytes_h

GREEN_STARTS = 3  # a green that dies before the handover is started again this often, then the upgrade fails
CATCH_UP_SECONDS = 1800  # how long an automatic promotion waits for green to catch up and pass its rules
OWN_DRIVER_BYTES = 1_300_000_000  # what a driver of its own holds (bench.memory), for the memory check
HEAP_HEADROOM = 0.8  # a shared driver takes green while its heap, with green's state, stays under this share
CATCH_UP_WAIT_SECONDS = 1200  # how long a promotion waits for green to come within a batch of blue
EXACT_WAIT_SECONDS = 10  # and then for green to have committed what blue has
BLUE_MISSING_SECONDS = 120  # blue not running this long (no restart came) while green follows: abort
GREEN_RESTART_SECONDS = 120  # green dead after the handover, no run of the job this long: the upgrade failed
BOOT_WAIT_SECONDS = 300  # green's driver of its own gets this long to start before the savepoint it forks from
FRESH_WAIT_SECONDS = 60  # after the handover, how long the gap's measure waits for green's first batch of new input
GAIN_WINDOW_SECONDS = 60  # green's gain on blue is measured over windows this long, and said after the first
NO_GAIN_WINDOWS = 3  # an automatic handover gives up after this many windows in a row in which green did not gain


# -- what the page and the API show --------------------------------------------------------------------------------


def green_run(action: Action) -> Run | None:
    run_id = action.params.get("green_run")
    return Run.objects.filter(id=run_id).first() if run_id else None


def blue_last(job: Job) -> int | None:
    """The newest batch blue committed (in the job's checkpoint directory as it was when green forked)."""
    batches = committed_batches(job.directory / job.checkpoint_dir)
    return batches[-1] if batches else None


def green_view(action: Action) -> dict[str, Any]:
    """Where green is, beside blue, and how its batches compare: what the job page's blue/green panel shows."""
    batches = list(GreenBatch.objects.filter(action=action).order_by("-batch_id")[:20])
    summed = GreenBatch.objects.filter(action=action).aggregate(
        compared=Count("id"),
        **{k: Sum(k) for k in ("added", "removed", "changed", "same", "output_rows", "input_rows")},
    )  # one query, however many batches green ran: the upgrade's steps ask every 0.2 s
    totals = {k: int(v or 0) for k, v in summed.items()}
    run = green_run(action)
    job = action.job
    blue = blue_last(job) if not action.params.get("handed_over") else action.params.get("handover_after")
    green_at = batches[0].batch_id if batches else action.params.get("bg_batch")
    return {
        "action": action.id, "status": action.status, "target": action.params.get("plan", {}).get("target"),
        "partitions": [action.params["before"]["state_partitions"], partitions_to(action)]
        if partitions_to(action) is not None else None,
        "outcome": action.outcome, "progress": action.progress,
        "run": run.id if run else None, "run_status": run.status if run else None,
        "blue_batch": blue, "green_batch": green_at,
        "behind": (blue - green_at) if isinstance(blue, int) and isinstance(green_at, int) else None,
        "totals": totals, "rules": action_rules(action.params), "auto": bool(action.params.get("auto")),
        "handed_over": bool(action.params.get("handed_over")), "gap_seconds": action.params.get("gap_seconds"),
        "catch_up": action.params.get("catch_up"), "pace": catch_up_shown(action.params.get("catch_up")),
        "following": action.in_flight and not action.params.get("handed_over"),
        "batches": [{"batch": b.batch_id, "input_rows": b.input_rows, "output_rows": b.output_rows,
                     "added": b.added, "removed": b.removed, "changed": b.changed, "same": b.same,
                     "duration_ms": b.duration_ms, "samples": b.samples} for b in batches],
    }  # fmt: skip


def latest_blue_green(job: Job) -> Action | None:
    return job.actions.filter(kind=ActionKind.BLUE_GREEN).order_by("-id").first()


def action_rules(params: dict[str, Any]) -> dict[str, Any]:
    """The rules an automatic promotion checks, from the request (``no_removed``, ``max_changed_percent``)."""
    rules: dict[str, Any] = {}
    if params.get("no_removed"):
        rules["no_removed"] = True
    if params.get("max_changed_percent") is not None:
        rules["max_changed_share"] = int(params["max_changed_percent"]) / 100
    return rules


def rules_problems(rules: dict[str, Any], totals: dict[str, int]) -> list[str]:
    """Why green's diff does not pass the operator's rules (empty: it passes). ``no_removed``: no row of blue's
    missing from green's; ``max_changed_share``: rows changed over rows compared, at most this share."""
    problems = []
    if rules.get("no_removed") and totals.get("removed"):
        problems.append(f"{totals['removed']} row(s) blue wrote are missing from green's output")
    if (share := rules.get("max_changed_share")) is not None:
        compared = sum(totals.get(k, 0) for k in ("added", "removed", "changed", "same"))
        if compared and totals.get("changed", 0) / compared > float(share):
            problems.append(f"{totals['changed']} of {compared} rows changed, more than {float(share):.0%}")
    return problems


def green_request(action: Action, what: str) -> bool:
    """The operator asks the running blue/green upgrade to hand over now (``promote``) or to stop (``abort``): kept in
    the action's ``asked``, which only the console writes and its steps read. Asked before green is up, it is kept
    and acted on once green follows; True when green is up already."""
    with transaction.atomic():
        locked = Action.objects.select_for_update().get(id=action.id)
        if locked.status not in (ActionStatus.PENDING, ActionStatus.RUNNING):
            raise ActionRefused(f"Blue/green upgrade #{action.id} has ended ({locked.status}): nothing to {what}.")
        if locked.params.get("handed_over"):
            raise ActionRefused(f"Blue/green upgrade #{action.id} has already handed over: nothing to {what}.")
        locked.asked = {**locked.asked, what: timezone.now().isoformat()}
        locked.save(update_fields=["asked"])
    action.asked = locked.asked
    return green_run(action) is not None


def asked(action: Action, run: Run) -> set[str]:
    """What the operator asked for (promote, abort), read once a visit: in the action (afresh: the console writes it
    while the step runs), or in green's run, where upgrades requested before ``Action.asked`` kept it."""
    fresh = Action.objects.filter(id=action.id).values_list("asked", flat=True).first() or {}
    return {what for what in ("promote", "abort") if fresh.get(what) or reported(run.green, what)}


def partitions_to(action: Action) -> int | None:
    """The state partitions a blue/green rescale moves the job to (None: it keeps its own)."""
    before = int(action.params.get("before", {}).get("state_partitions") or action.job.state_partitions)
    wanted = action.params.get("state_partitions")
    return int(wanted) if wanted is not None and int(wanted) != before else None


def change_shown(action: Action) -> str:
    """What the change is, as the operator reads it: the version and the parameters it changes, and the new state
    partitions of a rescale."""
    shown = target_shown(action)
    if (partitions := partitions_to(action)) is not None:
        shown += f", state partitions {action.params['before']['state_partitions']} → {partitions}"
    return shown


# -- the steps ------------------------------------------------------------------------------------------------------


def _what(action: Action) -> Next:
    """What changes: a new version or new parameter values are previewed first; a rescale alone (the job's own
    version and values, new state partitions) needs no preview: its state is the job's, repartitioned."""
    job = action.job
    if "before" not in action.params:
        remember(action, before={"state_partitions": job.state_partitions})
    target = str(action.params.get("pipeline") or job.pipeline)
    remember(action, pipeline=target)
    partitions = partitions_to(action)
    if partitions is not None and not 1 <= partitions <= 1024:
        raise ActionFailed("State partitions must be 1–1024.")
    if partitions is not None and job.state_backend == "memory" and job.has_state():
        raise ActionFailed(MEMORY_REPARTITION)
    values = current_parameters(job)
    try:
        unchanged = target == job.pipeline and target_parameters(job, target, action.params.get("parameters")) == values
    except ValueError:
        unchanged = False  # values the pipeline refuses: the preview's check (upgrades.checked_target) says why
    if partitions is None or not unchanged:
        return Next("copy")  # the preview refuses "nothing to change" and an incompatible version
    remember(
        action, from_parameters=values, parameters=values,
        plan={"target": target, "batch": blue_last(job), "verdicts": [], "incompatible": False,
              "summary": f"{target} as it runs, its state repartitioned {job.state_partitions} → {partitions} by "
                         "Spark's offline repartition on green's fork"},
    )  # fmt: skip
    return Next("gate")


def _green_gate(action: Action) -> Next:
    """Refuse before anything starts: an incompatible change, a job that is not running, too little memory."""
    job = action.job
    plan = action.params["plan"]
    remember(action, from_pipeline=action.params.get("from_pipeline") or job.pipeline)
    migrate = bool(action.params.get("migrate"))
    if plan["incompatible"] and not migrate:
        way = (
            f" {plan['target']} declares how to build its state from {job.pipeline}'s: ask for the migration."
            if pipelines.migration(plan["target"], job.pipeline) is not None
            else ""
        )
        raise ActionFailed(f"Refused before anything started. {plan['summary']}.{way}")
    if migrate and (refused := _migration_refusal(action)):
        raise ActionFailed(f"Refused before anything started: {refused}")
    blue = active_run(job)
    if blue is None or blue.status != RunStatus.RUNNING:
        raise ActionFailed(
            f"A blue/green upgrade runs the new version beside the running job; {job.name} is not running. Use the "
            "savepoint upgrade for a stopped job."
        )
    if not (job.reads_redis or job.reads_kafka):
        raise ActionFailed("A blue/green upgrade follows the job's batches on a Redis stream or a Kafka topic; this "
                           "job reads files. Use the savepoint upgrade.")  # fmt: skip
    if job.real_time:
        raise ActionFailed(
            "A blue/green upgrade's new version follows the job batch by batch and writes the sinks from its handover "
            f"batch on; {job.name} runs in Spark's real-time mode, whose Kafka writer has no such handover yet. Use the "
            "savepoint upgrade (its output pauses for the restart)."
        )
    if refusal := memory_refusal(job, blue):
        raise ActionFailed(f"Refused before anything started: {refusal}")
    batch = blue_last(job)
    if batch is None:
        raise ActionFailed(f"{job.name} has not committed a batch yet; nothing to start the new version from.")
    remember(action, was_running=True, bg_batch=batch, blue_run=blue.id)
    return Next("boot")


def _migration_refusal(action: Action) -> str:
    """Why a blue/green migration cannot be made as asked (empty when it can)."""
    job, target = action.job, action.params["plan"]["target"]
    if refused := migration_refusal(job, target):
        return refused
    if partitions_to(action) is not None:
        return "a state migration and new state partitions at once; migrate first, then rescale."
    if pipelines.get(target).needs_rocksdb and job.state_backend == StateBackend.MEMORY:
        return (
            f"{target} keeps transformWithState state, which needs RocksDB, and green runs on {job.name}'s backend "
            f"({job.state_backend}). Migrate with the savepoint upgrade (the migrated line moves to RocksDB)."
        )
    return ""


def memory_refusal(job: Job, blue: Run) -> str:
    """Why this host cannot hold green beside blue (empty when it can), with the figures."""
    latest = Checkpoint.objects.filter(job=job).order_by("-id").values_list("state_memory_bytes", flat=True).first()
    state = int(latest or 0)
    if shares_driver(job) and blue.heap_max_bytes:
        used = int(blue.heap_after_gc_bytes or 0)
        if used + state > HEAP_HEADROOM * blue.heap_max_bytes:
            return (
                f"the shared driver's heap holds {bytes_h(used)} of {bytes_h(blue.heap_max_bytes)} after "
                f"garbage collection; green's state ({bytes_h(state)}) would take it past "
                f"{HEAP_HEADROOM:.0%}. Raise STATEKEEPER_SHARED_DRIVER_MEMORY, or use the savepoint upgrade."
            )
        return ""
    if shares_driver(job):
        return ""
    available = _available_memory()
    if available is not None and available < OWN_DRIVER_BYTES + state:
        return (
            f"the host has {bytes_h(available)} of memory available; green needs a driver of its own, about "
            f"{bytes_h(OWN_DRIVER_BYTES + state)}. Free memory, or use the savepoint upgrade."
        )
    return ""


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _make_fork(action: Action, fork: str) -> None:
    """Green's checkpoint: a fork of the action's savepoint, as a query of its own (Spark stops a running query when
    another with its id starts in the same driver)."""
    job = action.job
    savepoint = Savepoint.objects.get(id=action.params["savepoint"])
    savepoint_fork(action, savepoint, fork)
    (job.directory / fork / "metadata").write_text(json.dumps({"id": str(uuid.uuid4())}) + "\n")
    (job.directory / fork / ".metadata.crc").unlink(missing_ok=True)


def _fork(action: Action) -> Outcome:
    """Green's checkpoint: a fork of the savepoint; for a state migration, a new checkpoint seeded with the migrated
    state, whose batch 0 follows blue's batch after the savepoint's (``shift``), its batches numbered on from there
    for the sinks (its lineage base) and its source starting where the savepoint's batch ended."""
    job = action.job
    fork = fork_name(action, "green")
    if action.params.get("migrate"):
        savepoint = Savepoint.objects.get(id=action.params["savepoint"])
        if waiting := state_migration.seed(action, job.directory / fork, savepoint):
            return waiting
        remember(action, shift=-(int(savepoint.batch_id or 0) + 1), green_start=savepoint_offset(action, savepoint))
    elif not action.memo.get("forked"):
        _make_fork(action, fork)
        memo_save(action, forked=True)
    remember(action, fork=fork, follow=str(job.directory / job.checkpoint_dir))
    return Next("repartition" if partitions_to(action) is not None else "green")


def _mirroring(step: Step) -> Step:  # wrapped: the step table's checks read the step's own source
    """The step, after copying the batches the job committed since green's fork for green to follow (Spark purges the
    job's own past its retention, and green may start a hundred batches late on a busy host): every visit, from the
    fork to the handover."""

    @functools.wraps(step)
    def visit(action: Action) -> Outcome:
        if fork := action.params.get("fork"):
            mirror_committed(Path(action.params["follow"]), follow_mirror(action.job.directory / fork),
                             int(action.params["bg_batch"]))  # fmt: skip
        return step(action)

    return visit


def _unmirror(action: Action) -> None:
    if fork := action.params.get("fork"):
        remove_tree(follow_mirror(action.job.directory / fork))


REPARTITION_FAILED = "The repartition of green's fork failed; the job runs on, untouched"


def _repartition(action: Action) -> Outcome:
    """A rescale: Spark's offline repartition of green's fork (the job runs on beside it)."""
    fork = action.job.directory / action.params["fork"]
    partitions = partitions_to(action)
    assert partitions is not None
    try:

        def fresh_fork() -> None:  # a reader died writing into it: the fork made again
            remove_tree(fork)
            _make_fork(action, fork.name)

        return repartition_wait(action, fork, partitions, REPARTITION_FAILED, fresh_fork) or Next("check-state")
    except ActionFailed:
        _unmirror(action)
        raise


def _check_state(action: Action) -> Outcome:
    """Spark loads the repartitioned fork; then its numbers: the repartition's batch of no input puts green's batch
    numbers ``shift`` ahead of blue's, and the fork's lineage base is lowered by as much, so that the sinks number
    green's batches as blue's (checkpoint_dir/files.py: write_lineage)."""
    job = action.job
    fork = job.directory / action.params["fork"]
    try:
        if waiting := state_loads_wait(action, fork, REPARTITION_FAILED):
            return waiting
    except ActionFailed:
        _unmirror(action)
        raise
    try:
        shift = latest_committed(fork) - int(action.params["bg_batch"])
        about = {k: v for k, v in lineage(fork).items() if k != "base"}
        # from blue's base, not the fork's: a step run again after a worker's death writes the same base
        base = lineage_base(job.directory / job.checkpoint_dir) - shift
    except CheckpointError as exc:
        remove_tree(fork)
        _unmirror(action)
        raise ActionFailed(f"{REPARTITION_FAILED}: {exc}") from None
    write_lineage(fork, base, **(about | {"repartitioned": partitions_to(action), "blue_green": action.id}))
    remember(action, shift=shift)
    return Next("green")


def _green_order(action: Action, boot: bool = False) -> GreenOrder:
    """What green's driver runs: the new version, on the fork, following the job's checkpoint."""
    job = action.job
    return GreenOrder(
        action=action.id, fork=fork_name(action, "green"), follow=str(job.directory / job.checkpoint_dir),
        pipeline=action.params["plan"]["target"], parameters=action.params["parameters"],
        partitions=partitions_to(action) or job.state_partitions, shift=int(action.params.get("shift") or 0),
        start_offset=action.params.get("green_start"), boot=boot,
    )  # fmt: skip


def _green_create(action: Action, boot: bool = False) -> Run:
    """A run of status green (once per attempt, at most GREEN_STARTS), in the shared driver the job runs in or a
    driver of its own, started."""
    job = action.job
    starts = int(action.memo.get("green_starts", 0))
    if starts >= GREEN_STARTS:
        raise ActionFailed(
            f"The new version's run ended {starts} times before the handover "
            f"({action.memo.get('green_ended', 'no reason given')}); {job.name} runs on, untouched."
        )
    with transaction.atomic():
        run = Run.objects.create(
            job=job, status=RunStatus.GREEN, requested_by=action.requested_by, host=settings.HOST_ID,
            green=_green_order(action, boot).as_json(),
        )  # fmt: skip
        run.job = job
        for name, value in own_driver_settings(run).items():
            setattr(run, name, value)
        if shares_driver(job):
            host = host_for_launch()
            run.driver_host, run.pid, run.log_path = host, host.pid, host.log_path
            run.spark_master = shared_master_label(host)
        run.save()
    if run.driver_host_id is None:
        Run.objects.filter(id=run.id).update(pid=spawn_driver(run))
    memo_save(action, green_starts=starts + 1)
    remember(action, green_run=run.id)
    return run


def _boot(action: Action) -> Next:
    """A job with a driver of its own: green's driver is started before the savepoint it forks from, and waits with
    its Spark up (``workers.driver.wait_for_fork``), so that green starts on a fork of the job's newest batch instead of
    one a JVM's start old (30-40 s on a busy host, which green caught up on only as fast as its batches were shorter
    than the interval). A shared driver's green starts in seconds: it needs none."""
    if shares_driver(action.job):
        return Next("savepoint")
    if not action.params.get("green_run"):  # a step run again after its worker died has started it already
        run = _green_create(action, boot=True)
        action_progress(action, f"green run #{run.id}: its driver starts (its JVM, then Spark) before the savepoint")
    return Next("booted")


def _booted(action: Action) -> Outcome:
    """Once green's driver says its Spark is up (or it went away: green is started anew after the fork, or its start
    takes longer than BOOT_WAIT_SECONDS: the fork is made, and green starts on it when it is up), the savepoint of the
    job's newest batch, which green forks from."""
    job = action.job
    run = green_run(action)
    assert run is not None
    if why := _green_gone(run):
        memo_save(action, green_ended=why)
        Run.objects.filter(id=run.id, status=RunStatus.GREEN).update(status=RunStatus.FAILED, message=why[:2000],
                                                                    ended_at=timezone.now())  # fmt: skip
    elif not reported(run.green, "up") and step_seconds(action) < BOOT_WAIT_SECONDS:
        return Wait(f"green run #{run.id}: its driver starts (its JVM, then Spark) before the savepoint", 0.5)
    if (batch := blue_last(job)) is not None:
        remember(action, bg_batch=batch)
    return Next("savepoint")


def _green_start(action: Action) -> Next:
    """Start green (once per attempt): a run of status green, in the shared driver the job runs in, or a driver of
    its own; or, when its driver started before the savepoint (``_boot``) and waits, tell it what to run."""
    run = green_run(action)
    if run is not None and GreenOrder.read(run.green).boot and run.status == RunStatus.GREEN:
        if not (why := _green_gone(run)):
            order_write(run, _green_order(action, boot=True), go=timezone.now().isoformat())
            action_progress(action, f"green run #{run.id} starting on {action.params['fork']}, its driver up already")
            return Next("follow")
        memo_save(action, green_ended=why)
        Run.objects.filter(id=run.id, status=RunStatus.GREEN).update(status=RunStatus.FAILED, message=why[:2000],
                                                                    ended_at=timezone.now())  # fmt: skip
    run = _green_create(action)
    action_progress(action, f"green run #{run.id} starting on {action.params['fork']}")
    return Next("follow")


def _green_gone(run: Run) -> str:
    """Why green's run is no longer there (empty while it is): ended, or its process gone."""
    run.refresh_from_db()
    if run.status != RunStatus.GREEN:
        return run.message or f"run #{run.id} ended {run.status}"
    if run_holds_process(run):
        return ""
    return "its shared driver let go of it" if run.driver_host_id is not None else "its driver process is gone"


def catch_up(window: dict[str, Any], behind: int, now: datetime, streak: int = 0) -> dict[str, Any]:
    """Whether green gains on blue, over the window that began at ``window["at"]`` with green ``window["behind"]``
    batches behind, now ``behind``: the batches gained (negative: lost), the seconds, the windows in a row without a
    gain (``streak`` before this one), and at this pace the seconds until green is within a batch (None when it does
    not gain).

    >>> from datetime import UTC
    >>> at = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
    >>> catch_up({"at": at.isoformat(), "behind": 50}, 20, at + timedelta(seconds=60))["to_go_seconds"]
    38
    >>> slow = catch_up({"at": at.isoformat(), "behind": 50}, 52, at + timedelta(seconds=60), streak=1)
    >>> slow["gaining"], slow["gained"], slow["without_gain"], slow["to_go_seconds"]
    (False, -2, 2, None)
    """
    seconds = max((now - datetime.fromisoformat(window["at"])).total_seconds(), 0.001)
    gained = int(window["behind"]) - behind
    gaining = gained > 0 or behind <= 1
    return {
        "was": int(window["behind"]), "behind": behind, "gained": gained, "seconds": round(seconds),
        "gaining": gaining, "without_gain": 0 if gaining else streak + 1, "at": now.isoformat(),
        "to_go_seconds": round(max(behind - 1, 0) * seconds / gained) if gained > 0 else None,
    }  # fmt: skip


def catch_up_shown(seen: dict[str, Any] | None) -> str:
    """What the page and the progress line say of green's gain on blue (empty before its first window ends)."""
    if not seen:
        return ""
    if not seen["gaining"]:
        return (
            f"green cannot gain on blue: {seen['was']} → {seen['behind']} batches behind over the last "
            f"{seen['seconds']} s (the host's cores are taken?): abort it, or give the host room"
        )
    if seen["behind"] <= 1:
        return ""
    return (
        f"green gains on blue: {seen['gained']} batches in {seen['seconds']} s, about {seen['to_go_seconds']} s to go"
    )


def _gain(action: Action, behind: int) -> dict[str, Any] | None:
    """Measure green's gain on blue a window at a time (``catch_up``): kept in params, for the page and the API."""
    now = timezone.now()
    window = action.memo.get("gain_from")
    if window is None:
        memo_save(action, gain_from={"at": now.isoformat(), "behind": behind})
        return action.params.get("catch_up")
    if (now - datetime.fromisoformat(window["at"])).total_seconds() < GAIN_WINDOW_SECONDS:
        return action.params.get("catch_up")
    seen = catch_up(window, behind, now, int((action.params.get("catch_up") or {}).get("without_gain") or 0))
    remember(action, catch_up=seen)
    memo_save(action, gain_from={"at": now.isoformat(), "behind": behind})
    return seen


def _follow(action: Action) -> Outcome:
    """Green runs blue's batches behind it; on to the handover once promoted (by the operator, or by itself when
    caught up and its diff passes the rules), or to the abort."""
    job = action.job
    run = green_run(action)
    assert run is not None
    words = asked(action, run)
    if why := _green_gone(run):
        if "abort" in words:
            return Next("abort")
        memo_save(action, green_ended=why)
        Run.objects.filter(id=run.id, status=RunStatus.GREEN).update(status=RunStatus.FAILED, message=why[:2000],
                                                                    ended_at=timezone.now())  # fmt: skip
        return Next("green")
    if "abort" in words:
        return Next("abort")
    if active_run(job) is None:  # blue failed, or was stopped: its restart strategy may bring it back
        since = action.memo.get("blue_missing_since") or timezone.now().isoformat()
        if not action.memo.get("blue_missing_since"):
            memo_save(action, blue_missing_since=since)
        if timezone.now() - datetime.fromisoformat(since) > timedelta(seconds=BLUE_MISSING_SECONDS):
            memo_save(action, abort_reason=f"{job.name} stopped while the new version ran beside it")
            return Next("abort")
        return Wait(f"{job.name} is not running: waiting for its restart", 0.5)
    if action.memo.get("blue_missing_since"):
        memo_save(action, blue_missing_since=None)
    view = green_view(action)
    behind, green_at = view["behind"], view["green_batch"]
    problems = rules_problems(view["rules"], view["totals"])
    t = view["totals"]
    caught_up = behind is not None and behind <= 1 and t["compared"] > 0
    where = f"green at batch {green_at}, {behind if behind is not None else '?'} behind blue"
    seen = _gain(action, behind) if behind is not None else None
    if pace := catch_up_shown(seen):
        where = f"{where}; {pace}"
    if blocked := reported(run.green, "sink_problems"):  # the new version cannot write the job's sinks: no handover
        line = f"{where}; no handover while {'; '.join(blocked)}"
        problems = [*problems, *(f"the new version cannot write {p}" for p in blocked)]
    else:
        line = (
            f"{where}; diff so far: {t['added']} added, {t['removed']} removed, {t['changed']} changed, {t['same']} "
            "the same" + (f"; rules not met: {'; '.join(problems)}" if problems else "")
        )
        if "promote" in words or (view["auto"] and caught_up and not problems):
            return Next("handover")
    if view["auto"] and seen and seen["without_gain"] >= NO_GAIN_WINDOWS:
        memo_save(action, abort_reason=f"green did not gain on blue for {seen['without_gain'] * GAIN_WINDOW_SECONDS} s "
                  f"({seen['was']} → {seen['behind']} batches behind over the last {seen['seconds']} s): it cannot "
                  "catch up on this host; nothing was handed over")  # fmt: skip
        return Next("abort")
    if view["auto"] and step_seconds(action) > float(action.params.get("catch_up_seconds") or CATCH_UP_SECONDS):
        memo_save(action, abort_reason="green did not catch up and pass its rules in time"
                  + (f" ({'; '.join(problems)})" if problems else ""))  # fmt: skip
        return Next("abort")
    return Wait(line, 0.2)  # the action's progress line until the next visit


def green_committed_lag(action: Action) -> int | None:
    """How many of blue's committed batches green has not committed yet, from both checkpoints' commit files (in
    blue's numbers: green's run ``shift`` ahead); None before either has committed."""
    job = action.job
    blue = blue_last(job)
    green = committed_batches(job.directory / action.params["fork"])
    if blue is None or not green:
        return None
    return blue - (green[-1] - int(action.params.get("shift") or 0))


def handover_point(newest: int, shadowing: int | None, shift: int = 0) -> int:
    """The batch of blue's after which green takes over: the one before blue's newest, so that green's batch of the
    newest number replaces blue's output of it, unless green's writer has begun that batch as a shadow already
    (``shadowing``, green's number of the last batch it took as a shadow). Without that record (a green of an
    earlier release), after blue's newest, as before.

    >>> handover_point(10, 9), handover_point(10, 10), handover_point(10, None), handover_point(10, 10, shift=1)
    (9, 10, 10, 9)
    """
    if shadowing is None:
        return newest
    return min(newest, max(newest - 1, int(shadowing) - shift))


def _handover(action: Action) -> Outcome:
    """Once green is caught up (within a batch of blue), the handover in one transaction; blue is fenced by it."""
    job = action.job
    run = green_run(action)
    assert run is not None
    if why := _green_gone(run):
        memo_save(action, green_ended=why)
        return Next("follow")
    view = green_view(action)
    behind = view["behind"] if view["behind"] is not None and view["batches"] else None
    # Green runs blue's batches as a shadow, over the same offsets, and writes the job's sinks from the batch after
    # the handover point (``handover_point``). Once green has committed blue's K - 1, with blue at K, the handover can
    # come after K - 1: green's K, over the offsets blue's K read, then replaces blue's output of K in every sink (as
    # after a restore), and the sinks go without a new batch only until green commits it. Green one batch behind by
    # its compared batches may still be in K - 1; where its batches take as long as blue's interval it stays there,
    # and green's commit of K - 1 comes for a moment each batch, shorter than a wait's wake-up: green's driver wakes
    # the action as it commits (``GreenRecorder``), and the visit sees it.
    waited = step_seconds(action)
    lag = green_committed_lag(action)
    ready = behind is not None and behind <= 1 and lag is not None and lag <= 1
    if not ready and (
        behind is None or behind > 1 and waited < CATCH_UP_WAIT_SECONDS or behind == 1 and waited < EXACT_WAIT_SECONDS
    ):
        return Wait(f"handing over once green is caught up (it is {behind} batch(es) behind)", 0.05)
    assert behind is not None
    if behind > 1:  # on a host whose cores the job already fills, green runs no faster than the job
        memo_save(action, abort_reason=f"green was still {behind} batches behind after {CATCH_UP_WAIT_SECONDS} s: "
                  "it does not catch up on this host's cores; nothing was handed over")  # fmt: skip
        return Next("abort")
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(id=job.id)
        blue = locked.runs.filter(status__in=ACTIVE_RUN_STATUSES).first()  # a restart of blue, pending, included
        newest = blue_last(locked)
        if newest is None:
            raise ActionFailed(f"{job.name}'s checkpoint has no committed batch to hand over after; nothing changed.")
        shift = int(action.params.get("shift") or 0)  # green's number for blue's batch ``after`` is after + shift
        # green's writer records each batch it takes as a shadow under this row's lock (workers/green.py: decide)
        green_now = Run.objects.select_for_update().get(id=run.id).green or {}
        after = handover_point(newest, reported(green_now, "shadowing"), shift)
        token = int(locked.lease_token or 0) + 1
        now = timezone.now()
        if blue is not None:
            Run.objects.filter(id=blue.id).update(
                status=RunStatus.STOPPED, ended_at=now,
                message=f"Handed over to run #{run.id} ({change_shown(action)}) after batch {after}.",
            )  # fmt: skip
        Run.objects.filter(id=run.id).update(
            status=RunStatus.RUNNING, fencing_token=token, started_at=now, last_heartbeat_at=now,
            green={**green_now, **reports_checked(handover=after + shift)},
        )  # fmt: skip
        Job.objects.filter(id=job.id).update(
            lease_token=token, lease_expires_at=now + timedelta(seconds=settings.LEASE_TTL_SECONDS),
            checkpoint_dir=action.params["fork"], latest_checkpoint=None, pipeline=action.params["plan"]["target"],
            parameters=action.params["parameters"], updated_at=now,
            state_partitions=partitions_to(action) or locked.state_partitions,
            # a migrated line started reading where the savepoint's batch ended, as the savepoint upgrade's does
            **({"start_offset": action.params["green_start"]} if action.params.get("green_start") else {}),
        )  # fmt: skip
        remember(action, handed_over=True, handover_after=after, blue_run=blue.id if blue else None,
                 handover_at=now.isoformat(), run=run.id)  # fmt: skip
    mark_handed_over(job.directory / action.params["fork"], after + shift)
    return Next("live")


def _live(action: Action) -> Outcome:
    """Green's first batch in the job's sinks (or, when green died just after the handover, the first batch of the
    job's restart on the new version's checkpoint): the upgrade is done, with the output gap measured."""
    job = action.job
    run = Run.objects.get(id=action.params["green_run"])
    after = action.params["handover_after"]
    mine = (after if after is not None else -1) + int(action.params.get("shift") or 0)  # in green's numbers
    first = (
        Checkpoint.objects.filter(job=job, location=action.params["fork"], run_id__gte=run.id, batch_id__gt=mine)
        .order_by("batch_id").first()
    )  # fmt: skip
    if first is None:
        if not run.is_active and active_run(job) is None and step_seconds(action) > GREEN_RESTART_SECONDS:
            raise ActionFailed(
                f"The new version took over after batch {after} and then ended ({run.message or run.status}) before "
                f"its first batch, and no run of {job.name} started again within {GREEN_RESTART_SECONDS} s; the job "
                "is on the new version's checkpoint: start it, or roll the upgrade back."
            )
        if step_seconds(action) < 600:
            return Wait(f"green took over after batch {after}: waiting for its first batch", 0.1)
        return _upgraded(action, run, None)
    blue_batch = Checkpoint.objects.filter(job=job, run_id=action.params.get("blue_run")).order_by("-batch_id").first()
    # The gap as a consumer of the sinks sees it: from the old version's last write (its newest batch) to the new
    # version's first write of input no earlier write held, the batch after the old version's newest (green's first
    # batch may be the old version's newest written again: values a consumer has seen already). With no new input
    # within FRESH_WAIT_SECONDS there is no such write, and no gap to say.
    newest = blue_batch.batch_id if blue_batch else after if after is not None else -1
    fresh = (
        Checkpoint.objects.filter(job=job, location=action.params["fork"], run_id__gte=run.id,
                                  batch_id__gt=newest + int(action.params.get("shift") or 0))
        .order_by("batch_id").first()
    )  # fmt: skip
    if fresh is None and step_seconds(action) < FRESH_WAIT_SECONDS:
        return Wait(f"green took over after batch {after}: waiting for its first batch of new input", 0.1)
    # a record's committed_at is its trigger's time: each batch is committed its duration later
    gap = (
        (fresh.committed_at + timedelta(milliseconds=fresh.duration_ms))
        - (blue_batch.committed_at + timedelta(milliseconds=blue_batch.duration_ms))
    ).total_seconds() if blue_batch and fresh else None  # fmt: skip
    # the old version's batches past the handover point (its newest, when the handover came before it, and one it had
    # in flight): green wrote them again, and the history holds both versions' records of them
    replaced = sorted(
        Checkpoint.objects.filter(job=job, run_id=action.params.get("blue_run"), batch_id__gt=-1 if after is None else after)
        .values_list("batch_id", flat=True)
    )  # fmt: skip
    remember(action, gap_seconds=round(gap, 3) if gap is not None else None, first_batch=first.batch_id,
             fresh_batch=fresh.batch_id if fresh else None, replaced=replaced)  # fmt: skip
    return _upgraded(action, run, first.batch_id)


def _upgraded(action: Action, run: Run, first: int | None) -> Done:
    run.refresh_from_db()
    if run.deploy_id:
        Deploy.objects.filter(id=run.deploy_id, upgrade=None).update(upgrade=action)
    spec_applied(action)
    _unmirror(action)  # green runs past the job's last batch: it reads the stream itself
    proof = {"state": "proven", "batch": first} if first is not None else {"state": "unproven"}
    remember(action, proof=proof, kept=f"savepoint #{action.params['savepoint']} kept as the way back")
    gap = action.params.get("gap_seconds")
    t = green_view(action)["totals"]
    return Done(
        f"Blue/green upgrade of {action.job.name} to {change_shown(action)}: run #{run.id} took over after batch "
        f"{action.params['handover_after']}"
        + (f" and committed batch {first} to the job's sinks" if first is not None else ", no batch yet")
        + (
            f" (in place of the old version's output of batch {', '.join(map(str, replaced))})"
            if (replaced := action.params.get("replaced"))
            else ""
        )
        + (
            f"; output gap {gap:.2f} s (the old version's last write to the new version's first of new input, "
            f"batch {action.params.get('fresh_batch')})"
            if gap is not None
            else "; no new input came within a minute, so no output gap to measure"
            if first is not None and action.params.get("fresh_batch") is None
            else ""
        )
        + f". Beside blue it ran {t['compared']} batch(es): {t['added']} rows added, "
        f"{t['removed']} removed, {t['changed']} changed, {t['same']} the same. Savepoint #{action.params['savepoint']}"
        " is the way back."
    )


def _abort(action: Action) -> Outcome:
    """Stop green, wait for it to let go, remove its fork and its diff. Blue was never touched."""
    job = action.job
    run = green_run(action)
    if run is not None:
        Run.objects.filter(id=run.id, status=RunStatus.GREEN).update(
            status=RunStatus.STOPPED, ended_at=timezone.now(), message="Aborted before the handover."
        )
        run.refresh_from_db()
        if run_holds_process(run):  # its lease keeper finds it no longer green and stops its query
            if step_seconds(action) < settings.STOP_GRACE_SECONDS + 30:
                return Wait(f"green run #{run.id} is stopping", 0.5)
            if run.driver_host_id is None and run.pid:
                os.killpg(run.pid, 9)
    fork = action.params.get("fork")
    if fork and fork != Job.objects.get(id=job.id).checkpoint_dir:
        remove_tree(job.directory / fork)
        handover_file(job.directory / fork).unlink(missing_ok=True)
    _unmirror(action)
    compared = GreenBatch.objects.filter(action=action).count()
    GreenBatch.objects.filter(action=action).delete()
    why = action.memo.get("abort_reason") or "on request"
    raise ActionAborted(
        f"Blue/green upgrade aborted ({why}) before the handover: {job.name} runs on unchanged; the new version's "
        f"fork and its {compared} compared batch(es) are removed."
    )


BLUE_GREEN_KEYS = (
    PLAN_KEYS + state_migration.MIGRATION_KEYS + STARTED + SAVEPOINT_TAKEN + Keys(
        memo={
            "abort_reason": str,  # why it goes on to "abort"
            "blue_missing_since": (str, NoneType),  # since when blue has had no run (ISO time)
            "forked": bool,  # green's fork is made
            "green_ended": str,  # why green's run ended
            "green_starts": int,  # green's runs started, bounded
            "gain_from": dict,  # the window green's gain on blue is measured over: its start ("at") and "behind"
        },
        params={
            "pipeline": str,  # the version green runs (the job's own for a rescale alone)
            "before": dict, "state_partitions": int,  # a rescale: the scale before, the partitions asked for
            "from_pipeline": str, "was_running": bool, "bg_batch": (int, NoneType), "blue_run": (int, NoneType),
            "fork": str, "follow": str, "green_run": int,
            "shift": int,  # how far green's batch numbers run ahead of blue's (a rescale 1, a migration -(K+1))
            "green_start": dict,  # a migration: where green's new checkpoint starts reading (the savepoint's end)
            "handed_over": bool, "handover_after": (int, NoneType), "handover_at": str,
            "gap_seconds": (float, int, NoneType), "first_batch": int,
            "fresh_batch": (int, NoneType),  # green's first batch of input the old version never wrote (its numbers)
            "replaced": list,  # the old version's batches past the handover that green wrote again
            "kept": str, "proof": dict,
            "catch_up": dict,  # whether green gains on blue, over the last window (``catch_up``)
        },
    )
)  # fmt: skip
BLUE_GREEN_STEPS: Steps = {
    "what": ("what changes", _what),
    **plan_steps(),
    "gate": ("refuse an incompatible change", _green_gate),
    "boot": ("start green's driver of its own", _boot),
    "booted": ("green's driver starts", _booted),
    **savepoint_steps("before-upgrade", then="fork", batch=lambda action: action.params["bg_batch"]),
    "fork": ("fork the savepoint for green", _mirroring(_fork)),
    "repartition": ("a rescale: repartition green's fork", _mirroring(_repartition)),
    "check-state": ("Spark loads the repartitioned fork", _mirroring(_check_state)),
    "green": ("start the new version beside the job", _mirroring(_green_start)),
    "follow": ("green follows the job's batches", _mirroring(_follow)),
    "handover": ("hand over", _mirroring(_handover)),
    "live": ("green's first batch in the job's sinks", _live),
    "abort": ("abort: stop green, remove its fork", _abort),
}
