"""A state migration of a team's job (examples/team_orders): ``customer-spend`` keeps spend per customer per hourly
window in a streaming aggregation; ``customer-spend-daily`` keeps it per customer per day in a transformWithState
operator, a change no upgrade can read the old state across. It declares a migration (the windows summed into their
days), which the console previews on a scratch copy, applies from a savepoint with every sink going on exactly, and
rolls back with every sink exact again. Every figure is checked against the orders sent."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import functions as F

from dashboard.checkpoint_dir.files import committed_batches, lineage, seed_dir
from dashboard.models import Action, ActionKind, ActionStatus, Job, ResultRow, Run, StateBackend
from dashboard.services.actions import action_request
from dashboard.services.runs import job_request_start, job_request_stop
from tests.conftest import CeleryWorkers, end_workers_and_their_processes, grant, wait_for
from tests.support import Orders, every_sink_exact, finished, lake_latest, lake_rows, sink, switched_to, team_rows

SPEND = ("customer", "start", "end", "orders", "items", "total")


def truth(orders: Orders, upto: int | None = None, window_minutes: int = 60) -> dict[str, dict[str, Any]]:
    """Spend per customer and window from the first ``upto`` orders sent (all by default)."""
    sent = Orders(None, "")
    sent.sent = orders.sent[:upto] if upto is not None else list(orders.sent)
    return {k: {f: v[f] for f in SPEND} for k, v in sent.expected(window_minutes=window_minutes).items()}


def daily_keys(rows: dict[str, Any]) -> set[str]:
    return {key for key, row in rows.items() if row["start"].endswith("00:00") and row["end"].endswith("00:00")
            and row["start"][:10] != row["end"][:10]}  # fmt: skip


def every_sink(spark: Any, job: Job, dsn: str, lake: Path) -> dict[str, dict[str, Any]]:
    return {"results": sink(job), "team-db": team_rows(dsn), "lake": lake_latest(lake_rows(spark, lake))}


def migrated_exactly(spark: Any, job: Job, dsn: str, lake: Path, hourly: dict, daily: dict) -> bool:
    """Each sink holds the hourly windows as they were at the savepoint (no rewind of the history) and each day the
    daily version touched with its total over every order sent (the migrated state's and the new orders')."""
    try:
        sinks = every_sink(spark, job, dsn, lake)
    except Exception:
        return False  # read mid-write
    for rows in sinks.values():
        days = daily_keys(rows)
        if {k: v for k, v in rows.items() if k not in days} != hourly or {k: rows[k] for k in days} != daily:
            return False
    return True


def daily_totals_go_on(spark: Any, job: Job, orders: Orders, dsn: str, lake: Path, before_migration: int) -> None:
    """After the migration: 30 orders more, and every sink holds the hourly windows of the orders before it as they
    were, and each day the new orders touched with its total over every order."""
    orders.send(30, seed=3)
    hourly = truth(orders, before_migration)
    touched = {f"{o['customer']['id']}|" for o in orders.sent[before_migration:]}
    daily = {k: v for k, v in truth(orders, window_minutes=1440).items() if any(k.startswith(t) for t in touched)}
    try:
        wait_for(lambda: migrated_exactly(spark, job, dsn, lake, hourly, daily), 240, 0.5,
                 "the daily totals to go on from the migrated state in every sink")  # fmt: skip
    except TimeoutError:
        raise AssertionError(migration_diff(every_sink(spark, job, dsn, lake), hourly, daily)) from None


def migration_diff(sinks: dict[str, dict[str, Any]], hourly: dict, daily: dict) -> str:
    """Where each sink differs from the hours and days expected, for a failure's message."""
    lines = []
    for name, rows in sinks.items():
        days = daily_keys(rows)
        hours = {k: v for k, v in rows.items() if k not in days}
        lines.append(
            f"{name}: hours missing {sorted(set(hourly) - set(hours))[:5]}, extra {sorted(set(hours) - set(hourly))[:5]}, "
            f"differing {[(k, hours[k], hourly[k]) for k in hours.keys() & hourly.keys() if hours[k] != hourly[k]][:3]}; "
            f"days missing {sorted(set(daily) - days)[:5]}, extra {sorted(days - set(daily))[:5]}, "
            f"differing {[(k, rows[k], daily[k]) for k in days & daily.keys() if rows[k] != daily[k]][:3]}"
        )
    return "\n".join(lines)


# in the default suite: the headline migration with its preview (on a part of the state) and rollback, three sinks
# (about 150 s: 146 s in CI at 858bea5)
@pytest.mark.django_db(transaction=True)
def test_a_team_job_migrated_from_hourly_windows_to_days_keeps_every_total_and_rolls_back_exact(
    make_job, redis, stream_name, checkpoint_root, spark, team_database, tmp_path
):
    # the preview runs its first batch on 1 of the migrated keys beside those the batch reads (2: one at least not in
    # the sample)
    workers = CeleryWorkers(checkpoint_root, tmp_path / "worker.log", {"STATEKEEPER_MIGRATION_PREVIEW_KEYS": "1"})
    try:
        migrate_preview_apply_and_roll_back(make_job, redis, stream_name, spark, team_database, tmp_path)
    finally:
        end_workers_and_their_processes(workers)


def migrate_preview_apply_and_roll_back(
    make_job: Any, redis: Any, stream_name: str, spark: Any, team_database: str, tmp_path: Path
) -> None:
    lake = tmp_path / "lake"
    job = make_job(pipeline="customer-spend", parallelism=1, trigger_interval_seconds=1,
                   parameters={"orders_dsn": team_database, "lake_dir": str(lake)})  # fmt: skip
    assert job.state_backend == StateBackend.MEMORY
    orders = Orders(redis, stream_name)
    orders.send(60, seed=1)
    job_request_start(job=job)
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5, "the first orders")

    # the plain upgrade is refused before anything stops, and says a migration is declared
    plain = finished(action_request(job=job, kind=ActionKind.UPGRADE, params={"pipeline": "customer-spend-daily"}))
    assert plain.status == ActionStatus.FAILED and "migrate the state" in plain.outcome, plain.outcome
    assert Job.objects.get(id=job.id).pipeline == "customer-spend" and not plain.params.get("savepoint")

    # the preview: on a scratch copy, the migration and the new version's first batch over orders not yet read (the
    # job stopped, then orders of two customers sent): run on a part of the migrated state, 1 of its days and the 2
    # the batch reads, its output is each of those days' total over every order, as on the whole state
    windows, days = truth(orders), truth(orders, window_minutes=1440)
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, 0.5, "the stop")
    orders.send(20, seed=2, customers=["c-0", "c-1"])
    preview = finished(action_request(job=job, kind=ActionKind.UPGRADE_PREVIEW,
                                      params={"pipeline": "customer-spend-daily", "migrate": 1}))  # fmt: skip
    assert preview.status == ActionStatus.SUCCEEDED, preview.outcome
    done = preview.params["migration"]
    assert done["variables"] == {"default": len(windows)}, "every hourly window of the state read"
    assert done["keys_in"] == len(windows) and done["keys_out"] == len(days) == done["rows_out"] > 5
    assert done["dropped"] == {"on": ["customer"], "keys": 0, "samples": []}
    assert len(done["before"]) == min(10, len(windows)) and len(done["after"]) == min(10, len(days))
    first, now_days = done["first_batch"], truth(orders, window_minutes=1440)
    read = {k for k in now_days if k.split("|")[0] in ("c-0", "c-1") and now_days[k] != days.get(k)}
    assert first["ran"] and first["seeded"]["sampled"] == 1 and first["seeded"]["read"] == len(read), first
    assert {r["key"]: {f: r["value"][f] for f in SPEND} for r in first["results"]} == {k: now_days[k] for k in read}
    assert 2 <= first["seeded"]["keys"] <= 1 + len(read) < len(days), first
    assert f"run on {first['seeded']['keys']} of its {len(days)} keys" in preview.outcome, preview.outcome
    assert Job.objects.get(id=job.id).pipeline == "customer-spend", "a preview changes nothing"
    assert not [p.name for p in job.directory.iterdir() if "migration" in p.name], "its scratch copies are gone"
    job_request_start(job=job)
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5, "the orders of the preview")

    # the upgrade with the migration, while orders flow: savepoint N, the migrated line goes on after N's offsets
    orders.send(20, seed=5)
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5, "the orders before it")
    before_migration = len(orders.sent)
    upgrade = finished(action_request(job=job, kind=ActionKind.UPGRADE,
                                      params={"pipeline": "customer-spend-daily", "migrate": 1}))  # fmt: skip
    assert upgrade.status == ActionStatus.SUCCEEDED and switched_to(job, "customer-spend-daily"), upgrade.outcome
    assert "state migrated from batch" in upgrade.outcome, upgrade.outcome
    job.refresh_from_db()
    assert job.state_backend == StateBackend.ROCKSDB, "the migrated line keeps transformWithState state in RocksDB"
    savepoint = job.savepoints.get(id=upgrade.params["savepoint"])
    assert lineage(job.checkpoint_location)["base"] == savepoint.batch_id + 1
    assert (seed_dir(job.checkpoint_location) / "_SUCCESS").exists()

    daily_totals_go_on(spark, job, orders, team_database, lake, before_migration)
    assert committed_batches(job.checkpoint_location)[0] == 0, "Spark's batches start again in the new checkpoint"

    # and back: the hourly version from savepoint N; the sinks rewind what the migrated line wrote, and the orders
    # after N are counted in their hours, once
    back = finished(action_request(job=job, kind=ActionKind.UPGRADE_ROLLBACK, params={"upgrade": upgrade.id}))
    assert back.status == ActionStatus.SUCCEEDED and switched_to(job, "customer-spend"), back.outcome
    assert Job.objects.get(id=job.id).state_backend == StateBackend.MEMORY
    orders.send(10, seed=4)
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 0.5,
             "every order in its hour after the rollback, in every sink")  # fmt: skip


@pytest.mark.spark
def test_two_state_variables_merged_into_one_keep_every_users_totals(kit_spark, tmp_path):
    """examples/user_sessions: user-sessions-timed keeps a user's open session and closed totals in two state
    variables (the closed one with a TTL); user-sessions-merged keeps them in one. Its migration joins them per user;
    the first batch after it goes on from every user's totals, checked against the events sent."""
    from statekeeper_sdk.testing import migrate_state, run_batches
    from user_sessions.timed import SESSIONS_MERGED, SESSIONS_TIMED

    rng = random.Random(5)
    before = [[{"user": f"u{rng.randrange(6)}", "region": "eu", "amount": rng.randrange(1, 100) / 4} for _ in range(30)]
              for _ in range(2)]  # fmt: skip
    # a gap of a second: the first batch's sessions are closed by their timers before the second batch's open again
    values = {"gap_seconds": 1, "ttl_minutes": 60}
    run_batches(SESSIONS_TIMED, [before[0], [], before[1]], parameters=values, workdir=tmp_path / "timed")
    seed = migrate_state(SESSIONS_MERGED, tmp_path / "timed" / "checkpoint", "user-sessions-timed", parameters=values)
    sent: dict[str, list[float]] = {}
    for event in before[0] + before[1]:
        sent.setdefault(event["user"], []).append(event["amount"])
    migrated = {r["user"]: r for r in seed.collect()}
    assert set(migrated) == set(sent), "every user, whether their session is open or closed"
    for user, amounts in sent.items():
        row = migrated[user]
        assert row["events"] + row["open_events"] == len(amounts), user
        assert abs(row["amount"] + row["open_amount"] - sum(amounts)) < 1e-9, user

    after = [{"user": user, "region": "eu", "amount": 1.0} for user in sorted(sent)]
    out = [b for b in run_batches(SESSIONS_MERGED, [after], parameters=values, initial_state=seed,
                                  workdir=tmp_path / "merged") if b.rows]  # fmt: skip
    got = {key: value for batch in out[:1] for _, key, value in batch.results}
    assert {u: (v["events"], round(v["amount"], 6)) for u, v in got.items()} == {
        u: (len(a) + 1, round(sum(a) + 1.0, 6)) for u, a in sent.items()
    }, "each user's events and amount go on from the migrated state"


class Sessions:
    """Session events sent to a stream, kept so that each user's expected events and amount come from them."""

    def __init__(self, redis: Any, stream: str) -> None:
        self.redis, self.stream, self.sent = redis, stream, []

    def send(self, count: int, seed: int) -> None:
        rng, pipe = random.Random(seed), self.redis.pipeline(transaction=False)
        for _ in range(count):
            event = {"user": f"u{rng.randrange(12)}", "region": "eu", "amount": rng.randrange(1, 400) / 4}
            self.sent.append(event)
            pipe.xadd(self.stream, {"v": json.dumps(event)})
        pipe.execute()

    def expected(self) -> dict[str, tuple[int, float]]:
        found: dict[str, tuple[int, float]] = {}
        for event in self.sent:
            events, amount = found.get(event["user"], (0, 0.0))
            found[event["user"]] = (events + 1, amount + event["amount"])
        return found


def totals_exact(job: Job, sessions: Sessions) -> bool:
    got = {r.key: (int(r.value["events"]), float(r.value["amount"])) for r in ResultRow.objects.filter(job=job)}
    want = sessions.expected()
    return set(got) == set(want) and all(got[u][0] == want[u][0] and abs(got[u][1] - want[u][1]) < 1e-6 for u in want)


@pytest.mark.headline
@pytest.mark.chaos  # kills during the migration and of the migrated driver: a few minutes
@pytest.mark.django_db(transaction=True)
def test_a_migration_through_a_worker_kill_and_a_driver_kill_ends_migrated_or_back_and_exact(
    make_job, redis, stream_name, celery_worker
):
    """user-sessions-timed → user-sessions-merged with the Celery worker killed while the migration runs, and the
    new version's driver killed with kill -9 once it is up: the job ends either migrated or back on the old version,
    its totals exact for every user either way, never between."""
    job = make_job(pipeline="user-sessions-timed", state_backend="rocksdb", parallelism=1, trigger_interval_seconds=1,
                   restart_strategy="fixed-delay", restart_delay_seconds=1,
                   parameters={"gap_seconds": 2, "ttl_minutes": 60})  # fmt: skip
    sessions = Sessions(redis, stream_name)
    sessions.send(120, seed=1)
    job_request_start(job=job)
    wait_for(lambda: totals_exact(job, sessions), 240, 0.5, "every user's first events")

    upgrade = action_request(job=job, kind=ActionKind.UPGRADE,
                             params={"pipeline": "user-sessions-merged", "migrate": 1})  # fmt: skip
    wait_for(lambda: Action.objects.get(id=upgrade.id).step in ("migrate", "switch", "start", "up"), 300, 0.1,
             "the migration to begin")  # fmt: skip
    celery_worker.kill()
    sessions.send(40, seed=2)  # while nothing runs the job: the new version (or the old one, back) reads them
    time.sleep(2)
    celery_worker.start()

    def migrated_run() -> Run | None:
        started = Action.objects.get(id=upgrade.id).params.get("run")
        return Run.objects.filter(id=started, pid__isnull=False).first() if started else None

    run = wait_for(migrated_run, 300, 0.2, "the migrated version's driver")
    os.killpg(run.pid, signal.SIGKILL)
    done = finished(Action.objects.get(id=upgrade.id), 600)
    assert done.status in (ActionStatus.SUCCEEDED, ActionStatus.FAILED), done.outcome
    job.refresh_from_db()
    migrated = job.pipeline == "user-sessions-merged"
    assert migrated == (done.status == ActionStatus.SUCCEEDED), (job.pipeline, done.outcome)
    assert migrated or "rolled back by itself" in done.outcome, done.outcome
    sessions.send(40, seed=3)
    wait_for(lambda: totals_exact(job, sessions), 300, 0.5,
             f"every user's events and amount, exact, on {job.pipeline} after the kills")  # fmt: skip
    assert not redis.xlen(job.dead_letter_stream) if redis.exists(job.dead_letter_stream) else True


@pytest.mark.django_db
def test_a_migration_is_asked_for_only_where_the_target_declares_one(client, django_user_model, make_job):
    """The API and the Deploys tab: a migration a target does not declare is refused before anything is requested,
    with the migrations it does declare; migrate and empty state together are refused; a declared one is requested
    (and a memory job may ask for it, the migrated line running on RocksDB)."""
    from dashboard.api.tokens import token_create

    make_job(name="spend", pipeline="customer-spend")
    user = django_user_model.objects.create_user("op", password="pw")
    grant(user, "operator")
    bearer = "Bearer " + token_create(user=user, name="ci")[1]

    def post(path: str, body: dict[str, Any]) -> Any:
        return client.post(path, json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=bearer)

    refused = post("/api/v1/jobs/spend/upgrade", {"pipeline": "customer-spend-v2", "migrate": 1})
    assert refused.status_code == 409, refused.json()
    assert (
        "customer-spend-v2 declares no state migration from customer-spend (it declares none)"
        in refused.json()["error"]
    )
    both = post("/api/v1/jobs/spend/upgrade", {"pipeline": "customer-spend-daily", "migrate": 1, "empty_state": 1})
    assert both.status_code == 400 and "Choose one" in both.json()["error"]
    plain = post("/api/v1/jobs/spend/upgrade", {"pipeline": "customer-spend-daily"})
    assert plain.status_code == 409 and "declares a state migration from customer-spend" in plain.json()["error"]
    asked = post("/api/v1/jobs/spend/upgrade-preview", {"pipeline": "customer-spend-daily", "migrate": 1})
    assert asked.status_code == 202, asked.json()
    assert Action.objects.get(id=asked.json()["action"]["id"]).params["migrate"] == 1

    client.force_login(user)
    page = client.get("/jobs/spend/deploys").content.decode()
    assert "data-migrations" in page and "customer-spend-daily" in page and 'name="migrate"' in page

    # the preview's answer, as the Deploys tab shows it (the figures are the state tool's, kept in the action)
    preview = Action.objects.get(id=asked.json()["action"]["id"])
    preview.params |= {
        "plan": {"target": "customer-spend-daily", "batch": 3, "verdicts": [], "incompatible": True,
                 "summary": "Incompatible with customer-spend-daily: operator replaced"},
        "migration": {"from": "customer-spend", "key": ["customer", "day"], "variables": {"default": 12},
                      "rows_in": 12, "rows_out": 6, "keys_in": 12, "keys_out": 6,
                      "dropped": {"on": ["customer"], "keys": 1, "samples": ['{"customer": "c-9"}']},
                      "before": ['{"key": 1}'], "after": ['{"customer": "c-1"}'],
                      "first_batch": {"ran": True, "rows": 4, "results": [], "state": {"spend": 7}}},
    }  # fmt: skip
    preview.save()
    page = client.get("/jobs/spend/deploys").content.decode()
    assert 'data-migration="12/6/6"' in page and "So the state is not read across" in page
    assert "c-9" in page and "4 output rows" in page, "the old key mapped to nothing, and the first batch's output"


def test_a_new_line_counts_its_batches_on_from_the_savepoint_for_the_sinks(tmp_path):
    from dashboard.checkpoint_dir.files import CheckpointError, lineage_base, write_lineage

    assert lineage_base(tmp_path / "checkpoint") == 0, "a checkpoint as Spark numbers it"
    write_lineage(tmp_path / "checkpoint", 42, reason="state migration")
    assert lineage_base(tmp_path / "checkpoint") == 42
    (tmp_path / "checkpoint" / "statekeeper-lineage.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="damaged"):  # read as 0, the sinks would rewind the whole history
        lineage_base(tmp_path / "checkpoint")


def _raises(old: Any, params: Any) -> Any:
    raise RuntimeError("no such customer table")


def _twice(old: Any, params: Any) -> Any:
    frame = old["default"].select(F.col("key.customer").alias("customer"), F.lit(None).cast("timestamp").alias("day"))
    return frame.unionByName(frame)


@pytest.mark.spark
def test_a_migration_that_raises_or_gives_a_key_twice_is_refused_with_the_reason(spark, tmp_path):
    """What the preview shows (and the upgrade refuses before switching): the migration's own error, or the keys it
    gives more than one row; the old checkpoint is only read."""
    from dataclasses import replace

    from statekeeper_sdk import Migration
    from statekeeper_sdk.testing import run_batches
    from team_orders.jobs import CUSTOMER_SPEND, CUSTOMER_SPEND_DAILY

    from workers.spark import state_tool

    order = {"order_id": "o1", "customer": {"id": "c1"}, "placed_at": "2026-11-25T10:00:00Z",
             "items": [{"sku": "a", "qty": 1, "price": "1.00"}]}  # fmt: skip
    run_batches(CUSTOMER_SPEND, [[order]], workdir=tmp_path / "old", spark=spark)
    old = tmp_path / "old" / "checkpoint"
    files = sorted(p.name for p in old.rglob("*"))
    for build, reason in ((_raises, "no such customer table"), (_twice, "1 keys more than one row (customer=c1")):
        broken = replace(CUSTOMER_SPEND_DAILY, migrations=(Migration("customer-spend", ("customer", "day"), build),))
        state_tool._LOADED.clear()
        globals()["BROKEN"] = broken
        spec = {"reference": f"{__name__}:BROKEN", "from_pipeline": "customer-spend", "parameters": {},
                "checkpoint": str(tmp_path / f"new-{build.__name__}")}  # fmt: skip
        with pytest.raises(Exception, match=re.escape(reason)):
            state_tool.migrate(spark, str(old), 0, spec)
    assert sorted(p.name for p in old.rglob("*")) == files, "the old checkpoint is only read"
