"""Operator actions on real jobs: savepoints, restore, rollback and rescale keep every record exactly once."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest
from django.conf import settings
from statekeeper_sdk._runtime.compatibility import EVOLVES, compare

from dashboard import pipelines
from dashboard.checkpoint_dir.files import (
    checkpoint_format,
    committed_batches,
    copy_checkpoint,
    directory_bytes,
    verify_files,
)
from dashboard.models import Action, ActionKind, ActionStatus, Job, RunStatus, SavepointStatus
from dashboard.selectors.partitions import partition_view
from dashboard.services import upgrade_parts, upgrades
from dashboard.services.actions import action_execute, action_request
from dashboard.services.drills import drills_run
from dashboard.services.errors import ActionFailed, ActionRefused
from dashboard.services.forks import rollback_preview, savepoint_preview
from dashboard.services.inspector import on_lineage
from dashboard.services.storage import job_storage
from tests.conftest import run_through, send_events, wait_for
from tests.support import execute, send, sink_total
from workers.spark import state_tool

pytestmark = [pytest.mark.spark, pytest.mark.django_db(transaction=True)]


def take_pending_start(job) -> None:
    """Actions queue a start for a Celery worker; these tests run the driver themselves, so drop the request."""
    job.runs.filter(status=RunStatus.PENDING).update(status=RunStatus.STOPPED)


def test_a_savepoint_of_a_running_job_is_verified_and_self_contained(make_job, start_driver, redis, stream_name):
    job = make_job(max_records_per_batch=300)
    sent = send_events(redis, stream_name, "url-counts", 900)
    driver = start_driver(job)
    wait_for(lambda: len(committed_batches(job.checkpoint_location)) >= 2, 120, what="two committed batches")

    execute(job, ActionKind.SAVEPOINT)  # while the job runs
    run_through(driver, redis, sent)

    savepoint = job.savepoints.get()
    assert savepoint.status == SavepointStatus.VERIFIED
    manifest = json.loads((Path(savepoint.path) / "_manifest.json").read_text())
    assert manifest["batch_id"] == savepoint.batch_id
    assert manifest["source_offsets"][0]["n"] == 300 * (savepoint.batch_id + 1)
    assert manifest["state_partitions"] == 2 and manifest["backend"] == "memory"
    assert manifest["verification"]["operators"][0]["rows"]["default"] == 8, "8 URLs in the state"
    assert verify_files(Path(savepoint.path) / "checkpoint", manifest["files"]) == []
    assert savepoint.size_bytes == sum(f["size"] for f in manifest["files"]) > 0

    # the restore drill reads the savepoint back and agrees with the history; a damaged file fails it
    assert drills_run() == [f"{job.name} savepoint #{savepoint.id}: ok: Spark read 8 state rows, as recorded at "
                            f"batch {savepoint.batch_id}"]  # fmt: skip
    victim = next(p for p in (Path(savepoint.path) / "checkpoint" / "state").rglob("*.delta") if p.stat().st_size)
    victim.write_bytes(b"\0" * victim.stat().st_size)
    drills_run()
    savepoint.refresh_from_db()
    assert savepoint.drill_ok is False and "differ from the manifest" in savepoint.drill_message

    # storage accounting: every byte in one category, adding up to du; orphans removed only when confirmed
    (job.directory / "stray.tmp").write_bytes(b"x" * 1234)
    (job.savepoint_root / "sp-999-batch-0").mkdir()
    (job.savepoint_root / "sp-999-batch-0" / "part").write_bytes(b"y" * 4321)
    storage = job_storage(job)
    du = int(subprocess.run(["du", "-sb", str(job.directory)], capture_output=True, text=True).stdout.split()[0])
    folders = sum(p.stat().st_size for p in [job.directory, *job.directory.rglob("*")] if p.is_dir())
    assert storage.total == du - folders, "du -sb also counts each directory's own entry; the files add up exactly"
    assert [(e.name, e.size) for e in storage.orphans] == [("savepoints/sp-999-batch-0", 4321), ("stray.tmp", 1234)]
    assert [e.name for e in storage.savepoints] == [f"savepoints/{Path(savepoint.path).name}"]
    assert storage.retention_reclaims(1) == storage.retained_bytes > 0
    cleaned = execute(job, ActionKind.CLEAN_ORPHANS, orphans=["stray.tmp", f"savepoints/{Path(savepoint.path).name}"])
    assert "Removed 1 orphan(s), 1234 bytes" in cleaned.outcome and "Left alone" in cleaned.outcome
    assert Path(savepoint.path).is_dir() and (job.savepoint_root / "sp-999-batch-0").is_dir()


def test_restore_from_a_savepoint_replays_to_exactly_the_events_sent(make_job, start_driver, redis, stream_name):
    job = make_job(max_records_per_batch=250)
    first = send_events(redis, stream_name, "url-counts", 750, seed=1)
    run_through(start_driver(job), redis, first)
    execute(job, ActionKind.SAVEPOINT)
    savepoint = job.savepoints.get()
    second = send_events(redis, stream_name, "url-counts", 500, seed=2)
    run_through(start_driver(job), redis, first + second)
    assert sink_total(job) == first + second

    preview = savepoint_preview(job, savepoint)
    assert (preview.batch_id, preview.replay_records, preview.refusal) == (savepoint.batch_id, second, "")
    execute(job, ActionKind.RESTORE, savepoint=savepoint.id)
    job.refresh_from_db()
    assert job.checkpoint_dir.startswith("checkpoint-restore-")
    assert (job.directory / "checkpoint" / "commits").is_dir(), "the original checkpoint stays untouched"
    take_pending_start(job)
    run_through(start_driver(job), redis, first + second)
    assert sink_total(job) == first + second, "the replayed records overwrite, never add"
    forked = job.checkpoints.filter(location=job.checkpoint_dir)
    assert sum(c.input_rows for c in forked) == second


def test_a_rocksdb_savepoint_holds_its_batch_alone_and_restores_exactly(make_job, start_driver, redis, stream_name):
    """RocksDB without change logs writes a full snapshot each batch: a savepoint copied every one the checkpoint
    retains (a hundred by default). It takes the snapshot of its batch and the SST files that snapshot lists."""
    job = make_job(max_records_per_batch=150, state_backend="rocksdb", state_partitions=2)
    first = send_events(redis, stream_name, "url-counts", 750, seed=3)
    run_through(start_driver(job), redis, first)
    execute(job, ActionKind.SAVEPOINT)
    savepoint = job.savepoints.get()
    assert savepoint.status == SavepointStatus.VERIFIED, savepoint.message
    copied = Path(savepoint.path) / "checkpoint"
    for part in ("0", "1"):
        snapshots = sorted(p.name.split("_")[0] for p in (copied / "state" / "0" / part).glob("*.zip"))
        assert snapshots == [str(savepoint.batch_id + 1)], snapshots
        live = list((job.checkpoint_location / "state" / "0" / part).glob("*.zip"))
        assert len(live) > 1, "the live checkpoint retains earlier snapshots: they stay out of the savepoint"
    assert sorted(int(p.name) for p in (copied / "commits").iterdir() if p.name.isdigit()) == [savepoint.batch_id]
    assert savepoint.size_bytes < directory_bytes(job.checkpoint_location)

    second = send_events(redis, stream_name, "url-counts", 300, seed=4)
    run_through(start_driver(job), redis, first + second)
    execute(job, ActionKind.RESTORE, savepoint=savepoint.id)
    job.refresh_from_db()
    take_pending_start(job)
    run_through(start_driver(job), redis, first + second)
    assert sink_total(job) == first + second, "restored from the batch alone, the replay is exact"


def snapshot_versions(root: Path, part: str) -> list[int]:
    return sorted(int(p.name.split("_")[0].split(".")[0]) for p in (root / "state" / "0" / part).glob("*.zip"))


def test_a_preview_copies_what_its_batch_needs_and_a_full_copy_when_that_is_not_enough(
    spark_settings_kept, make_job, start_driver, redis, stream_name, monkeypatch, tmp_path
):
    """A preview re-runs the job's last batch on a copy of its checkpoint: the state that batch began with (the
    newest snapshot at or below it), not the hundred batches Spark retains. When the re-run on that copy fails
    otherwise than by Spark's refusal of the new version (here the snapshot's SST files are lost), it runs again on
    a full copy, and the verdict is that one's."""
    job = make_job(pipeline="user-sessions", state_backend="rocksdb", max_records_per_batch=40)
    sent = send(redis, stream_name, 400, seed=1)
    run_through(start_driver(job), redis, sent)
    batch = committed_batches(job.checkpoint_location)[-1]
    trimmed = tmp_path / "trimmed"
    copy_checkpoint(job.checkpoint_location, trimmed, batch, replay=True)
    for part in ("0", "1"):
        assert snapshot_versions(trimmed, part) == [batch, batch + 1], "the state the batch began with, and its own"
        assert len(snapshot_versions(job.checkpoint_location, part)) > 5, "the live checkpoint retains many more"
    assert sorted(int(p.name) for p in (trimmed / "commits").iterdir() if p.name.isdigit()) == [batch - 1, batch]

    preview = execute(job, ActionKind.UPGRADE_PREVIEW, pipeline="user-sessions-v2")
    plan = preview.params["plan"]
    verdict = plan["summary"]
    assert verdict.startswith(f"Compatible with user-sessions-v2 at batch {batch} (1 state variable(s)"), verdict
    assert "plan_full" not in preview.memo, "the trimmed copy was enough"
    # Spark planned the batch (its verdict then given) before the batch ran on the copy, which proved it
    assert plan["proven"] is True and plan["verdict_at"] <= plan["proven_at"], plan
    assert 0 < plan["seconds"]["planned"] < plan["seconds"]["ran"], plan["seconds"]
    # what the verdict is given from as Spark plans: the schemas it wrote then, read before the batch committed, are
    # those its state reader reads once the batch has run
    planned = tmp_path / "planned"
    copy_checkpoint(job.checkpoint_location, planned, batch, replay=True)
    given: list[tuple[dict, bool]] = []
    spec = upgrade_parts.scratch_spec(job, f"{job.dead_letter_stream}:planned") | {
        "reference": pipelines.reference("user-sessions-v2"), "parameters": job.parameters,
    }  # fmt: skip
    result = state_tool.answer(spark_settings_kept, "plan", str(planned), batch, spec,
                               lambda early: given.append((early, (planned / "commits" / str(batch)).exists())))  # fmt: skip
    ((early, committed),) = given
    assert not committed, "the verdict's schemas were read before the batch committed"
    assert early["before"] == result["before"] and early["after"] == result["after"]
    assert [v.verdict for v in compare(early, pipelines.find(job.pipeline), pipelines.get("user-sessions-v2"))] == [
        EVOLVES
    ]
    assert not planned.with_name("planned.schemas").exists(), "the schema view is removed"

    real_copy = copy_checkpoint

    def losing_the_ssts(src: Path, dst: Path, upto: int, batch_only: bool = False, replay: bool = False):
        entries = real_copy(src, dst, upto, batch_only, replay)
        if replay:
            for sst in (dst / "state").rglob("SSTs/*"):
                sst.unlink()
        return entries

    monkeypatch.setattr(upgrades, "copy_checkpoint", losing_the_ssts)
    again = execute(job, ActionKind.UPGRADE_PREVIEW, pipeline="user-sessions-v2")
    assert again.memo.get("plan_full") is True, "the re-run on the copy without its SST files failed"
    assert again.params["plan"]["summary"] == verdict, "the full copy's verdict, not the broken copy's error"


def test_a_spark_refusal_is_the_previews_answer_and_anything_else_is_run_again():
    refused = {"replay_error": "[STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE] Provided key schema does not match existing"}
    assert not upgrades.not_a_refusal(refused)
    assert not upgrades.not_a_refusal({"before": [], "after": []}), "no error"
    lost = "org.apache.spark.SparkException: [CANNOT_LOAD_STATE_STORE.CANNOT_READ_DELTA_FILE_NOT_EXISTS] An error"
    assert upgrades.not_a_refusal({"replay_error": lost})
    python = "An exception was raised by the Python Proxy. Return Message: Traceback (most recent call last):"
    assert upgrades.not_a_refusal({"replay_error": python}), "the batch's execution failed: no class to go by"


def test_rollback_to_a_committed_batch_then_replay(make_job, start_driver, redis, stream_name):
    job = make_job(max_records_per_batch=200)
    sent = send_events(redis, stream_name, "url-counts", 1000)
    run_through(start_driver(job), redis, sent)
    preview = rollback_preview(job, 1)
    assert (preview.replay_records, preview.refusal) == (600, "")
    assert "not among the retained batches" in rollback_preview(job, 99).refusal

    execute(job, ActionKind.ROLLBACK, batch=1)
    take_pending_start(job)
    job.refresh_from_db()
    assert committed_batches(job.checkpoint_location)[-1] == 1
    run_through(start_driver(job), redis, sent)
    assert sink_total(job) == sent


def test_a_restore_whose_records_were_trimmed_is_refused_with_the_count(make_job, start_driver, redis, stream_name):
    job = make_job(max_records_per_batch=200)
    first = send_events(redis, stream_name, "url-counts", 200)
    run_through(start_driver(job), redis, first)
    execute(job, ActionKind.SAVEPOINT)
    savepoint = job.savepoints.get()
    send_events(redis, stream_name, "url-counts", 200, seed=2)
    redis.xtrim(
        stream_name, maxlen=50, approximate=False
    )  # the retention of the stream dropped what the savepoint needs

    preview = savepoint_preview(job, savepoint)
    assert preview.refusal.startswith("Refused: 150 records after this batch were already trimmed")
    action = action_request(job=job, kind=ActionKind.RESTORE, params={"savepoint": savepoint.id})
    assert action_execute(action_id=action.id).status == ActionStatus.FAILED
    job.refresh_from_db()
    assert job.checkpoint_dir == "checkpoint", "a refused restore changes nothing"


def test_rescaling_state_partitions_keeps_every_count(make_job, start_driver, redis, stream_name):
    job = make_job(max_records_per_batch=300, state_partitions=2, state_backend="rocksdb")
    first = send_events(redis, stream_name, "url-counts", 600, seed=1)
    run_through(start_driver(job), redis, first)
    assert checkpoint_format(job.checkpoint_location) == 2, "a new RocksDB checkpoint records its state file ids"

    action = execute(job, ActionKind.RESCALE, parallelism=1, state_partitions=3)
    job.refresh_from_db()
    assert (job.parallelism, job.state_partitions) == (1, 3)
    assert action.params["before"] == {"parallelism": 2, "state_partitions": 2}
    assert action.outcome.startswith("Rescaled: parallelism 2 → 1, state partitions 2 → 3; savepoint #")
    assert job.savepoints.get().origin == "before-rescale"
    assert job.checkpoint_dir.startswith("checkpoint-rescale-")

    second = send_events(redis, stream_name, "url-counts", 400, seed=2)
    run_through(start_driver(job), redis, first + second)
    assert sink_total(job) == first + second
    latest = job.checkpoints.filter(location=job.checkpoint_dir).order_by("-batch_id").first()
    assert latest.state_operators[0]["numShufflePartitions"] == 3

    # the per-partition view after the rescale: three partitions, and their rows counted by Spark's state reader
    counted = execute(job, ActionKind.COUNT_PARTITION_ROWS)
    assert sorted(counted.params["rows"]) == ["0:0", "0:1", "0:2"]
    assert sum(counted.params["rows"].values()) == latest.state_rows_total == 8
    view = partition_view(job)
    assert [(r.part, r.rows) for r in view.rows] == [(n, counted.params["rows"][f"0:{n}"]) for n in range(3)]

    # the state inspector, on a scratch copy: a page of keys, a diff between two batches, rocksdict's raw statistics
    inspected = execute(job, ActionKind.INSPECT_STATE, mode="keys", limit=5)
    assert inspected.params["batch"] == max(committed_batches(job.checkpoint_location)), "the batch read is kept"
    keys = inspected.params["result"]
    assert keys["total"] == 8 and len(keys["rows"]) == 5 and '"url"' in keys["rows"][0]["key"]
    newest = max(committed_batches(job.checkpoint_location))
    diff = execute(job, ActionKind.INSPECT_STATE, mode="diff", batch=newest, from_batch=newest - 1).params["result"]
    assert diff["total"] == sum(diff["counts"].values()) > 0 and set(diff["counts"]) <= {"added", "changed", "removed"}
    # a state file of the newest version that no commit chose (a fenced driver's, say) is never read
    assert checkpoint_format(job.checkpoint_location) == 2, "the savepoint copy and the repartition kept the format"
    partition = job.checkpoint_location / "state" / "0" / "0"
    committed = max(partition.glob("*.zip"), key=lambda z: int(z.name.split("_")[0]))
    stray = partition / f"{committed.name.split('_')[0]}_{uuid.uuid4()}.zip"
    stray.write_bytes(b"a zombie's half-written file")
    assert on_lineage(job.checkpoint_location, partition, committed.name)
    assert not on_lineage(job.checkpoint_location, partition, stray.name)
    raw = execute(job, ActionKind.INSPECT_STATE, mode="raw").params["result"]
    assert sum(f["keys"] for p in raw["partitions"] for f in p["families"].values()) == 8
    assert not list((settings.CHECKPOINT_ROOT / ".scratch").iterdir()), "scratch copies are removed"


def test_a_rescale_whose_savepoint_cannot_be_copied_after_the_switch_stands_and_says_where_the_way_back_is(
    make_job, start_driver, redis, stream_name, monkeypatch
):
    """The savepoint is copied once the job runs on the repartitioned copy: should the copy fail then (a full disk),
    the rescale has happened and stands; its outcome says so, and names the directory the job left as the way back."""
    from dashboard.services import rescale

    job = make_job(max_records_per_batch=300, state_partitions=2, state_backend="rocksdb")
    first = send_events(redis, stream_name, "url-counts", 300, seed=1)
    run_through(start_driver(job), redis, first)
    stopped_at = max(committed_batches(job.checkpoint_location))

    def full_disk(**kwargs):
        raise ActionFailed("Savepoint failed: [Errno 28] No space left on device")

    monkeypatch.setattr(rescale, "savepoint_copy", full_disk)
    action = execute(job, ActionKind.RESCALE, state_partitions=3)
    job.refresh_from_db()
    assert (job.state_partitions, job.checkpoint_dir) == (3, f"checkpoint-rescale-{action.id}")
    assert "its savepoint could not be taken (Savepoint failed: [Errno 28] No space left on device)" in action.outcome
    assert "the checkpoint directory it left, checkpoint, is kept as the way back; take a savepoint now" in (
        action.outcome
    )
    assert not job.savepoints.exists()
    assert max(committed_batches(job.directory / "checkpoint")) == stopped_at, "the way back, as the job left it"

    second = send_events(redis, stream_name, "url-counts", 200, seed=2)
    run_through(start_driver(job), redis, first + second)
    assert sink_total(job) == first + second, "every record counted once on the repartitioned state"


def test_a_rescale_whose_repartitioned_state_spark_cannot_load_puts_the_job_back_and_loses_nothing(
    make_job, start_driver, redis, stream_name, monkeypatch
):
    """Records waiting, the new run's first batch is to show that Spark loads the repartitioned state (no reader's
    load while the job is stopped). Here the repartitioned copy is damaged before the restart: the new run fails
    before its first batch, the reader cannot load the copy either, and the job goes back to its original checkpoint
    and scale, where every record counts once."""
    from dashboard.services import rescale, run_waits
    from dashboard.services.runs import run_finish

    job = make_job(max_records_per_batch=300, state_partitions=2, state_backend="rocksdb")
    first = send_events(redis, stream_name, "url-counts", 300, seed=1)
    driver = start_driver(job)
    wait_for(lambda: sink_total(job) == first, 180, 0.5, "the job to count the first events")
    waiting = []
    repartition_wait = rescale.repartition_wait

    def damaged(action, copy, *args):  # Spark's repartition, then its newest state files lost; records arrive
        if (outcome := repartition_wait(action, copy, *args)) is None and not waiting:
            version = max(committed_batches(copy)) + 1  # a batch's state is version batch + 1
            lost = [f for f in (copy / "state").rglob("*.zip") if f.name.startswith(f"{version}_")]
            assert len(lost) == 3, "the repartition wrote its batch's state, one file a partition"
            for file in lost:
                file.unlink()
            waiting.append(send_events(redis, stream_name, "url-counts", 200, seed=2))
        return outcome

    launched = []

    def launch(*, run_id):  # the new driver, as it reports a state it cannot load; the way back's, left pending
        launched.append(run_id)
        if len(launched) == 1:
            run_finish(run_id=run_id, status=RunStatus.FAILED, message="Spark could not load state version 3")

    monkeypatch.setattr(rescale, "repartition_wait", damaged)
    monkeypatch.setattr(run_waits, "run_launch", launch)
    # asked by `statekeeper apply`: the spec applied keeps the scale asked, and the outcome says the job differs from it
    action = action_request(job=job, kind=ActionKind.RESCALE, params={"state_partitions": 3, "from_spec": 1})
    done = action_execute(action_id=action.id)
    driver.thread.join(60)

    steps = [p["step"] for p in done.phases]
    assert steps[-7:] == ["check-state", "apply", "first-batch", "savepoint", "verify", "check-after", "back"], (
        steps,
        done.outcome,
    )
    assert "check-state" not in done.memo, "no load by the reader while the job was stopped"
    assert done.status == ActionStatus.FAILED
    assert done.outcome.startswith("Spark could not load the repartitioned state ("), done.outcome
    assert (
        "The job is back on its original checkpoint (checkpoint) at parallelism 2, state partitions 2" in done.outcome
    )
    assert f"run #{done.params['back_run']} starting: nothing was lost" in done.outcome
    job.refresh_from_db()
    assert (job.checkpoint_dir, job.state_partitions) == ("checkpoint", 2)
    assert job.applied_spec["state_partitions"] == 3
    assert "The spec applied still asks for parallelism 2, state partitions 3: the job page shows" in done.outcome
    assert launched == [done.params["run"], done.params["back_run"]]
    assert (job.directory / f"checkpoint-rescale-{done.id}").is_dir(), "the damaged copy is kept to look into"
    savepoint = job.savepoints.get(id=done.params["savepoint"])  # taken before the job went back to its checkpoint
    assert savepoint.origin == "before-rescale" and f"savepoint #{savepoint.id} too" in done.outcome
    assert savepoint.batch_id == max(committed_batches(job.checkpoint_location)), "the batch the job had stopped at"

    run_finish(run_id=done.params["back_run"], status=RunStatus.STOPPED, message="ran below instead")
    run_through(start_driver(job), redis, first + waiting[0])
    assert sink_total(job) == first + waiting[0], "every record counted once, on the original checkpoint"


def test_a_second_action_is_refused_while_one_is_in_flight(make_job):
    job = make_job()
    action_request(job=job, kind=ActionKind.SAVEPOINT)
    with pytest.raises(ActionRefused, match="one action at a time"):
        action_request(job=job, kind=ActionKind.RESCALE, params={"parallelism": 1})
    assert Job.objects.get(id=job.id).actions.count() == 1


def test_a_redelivered_action_is_not_executed_twice(make_job):
    job = make_job()
    action = action_request(job=job, kind=ActionKind.SAVEPOINT)
    first = action_execute(action_id=action.id)
    assert first.status == ActionStatus.FAILED and "no committed batch" in first.outcome
    again = action_execute(action_id=action.id)
    assert (again.status, again.finished_at) == (first.status, first.finished_at)


def test_a_memory_backend_job_cannot_repartition_and_is_told_why(make_job, start_driver, redis, stream_name):
    job = make_job(max_records_per_batch=300)
    run_through(start_driver(job), redis, send_events(redis, stream_name, "url-counts", 300))
    action = action_request(job=job, kind=ActionKind.RESCALE, params={"state_partitions": 4})
    done = action_execute(action_id=action.id)
    assert done.status == ActionStatus.FAILED and "supports only RocksDB state" in done.outcome
    job.refresh_from_db()
    assert (job.state_partitions, job.checkpoint_dir) == (2, "checkpoint")


@pytest.mark.django_db
def test_a_rescale_whose_savepoint_fails_its_reading_after_the_restart_says_so_first(make_job, tmp_path):
    from dashboard.models import Savepoint
    from dashboard.services import rescale

    job = make_job(state_backend="rocksdb")
    # its files were checked before the repartition; by the reading after the new run's first batch they are gone
    savepoint = Savepoint.objects.create(job=job, origin="before-rescale", path=str(tmp_path / "gone"), batch_id=3)
    action = Action.objects.create(
        job=job, kind=ActionKind.RESCALE, status=ActionStatus.RUNNING, params={"savepoint": savepoint.id},
        memo={"rescaled": {"scale": "state partitions 2 → 3, parallelism 1", "notes": [], "offline": 4.2, "then": []}},
    )  # fmt: skip
    done = rescale.RESCALE_STEPS["first-batch"][1](action)
    assert done.outcome.startswith(f"Savepoint #{savepoint.id}, the way back, failed its verification"), done
    assert done.outcome.endswith(
        "Rescaled: state partitions 2 → 3, parallelism 1; job left stopped; offline for 4.2 s before the restart request."
    )
    savepoint.refresh_from_db()
    assert savepoint.status == "failed"
