"""A state migration of a team's job (examples/team_orders): ``customer-spend`` keeps spend per customer per hourly
window in a streaming aggregation; ``customer-spend-daily`` keeps it per customer per day in a transformWithState
operator, a change no upgrade can read the old state across. It declares a migration (the windows summed into their
days), which the console previews on a scratch copy, applies from a savepoint with every sink going on exactly, and
rolls back with every sink exact again. Every figure is checked against the orders sent."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from dashboard.checkpoint_dir.files import committed_batches, lineage, seed_dir
from dashboard.models import ActionKind, ActionStatus, Job, StateBackend
from dashboard.services.actions import action_request
from dashboard.services.runs import job_request_start
from tests.conftest import wait_for
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


@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_team_job_migrated_from_hourly_windows_to_days_keeps_every_total_and_rolls_back_exact(
    make_job, redis, stream_name, celery_worker, spark, team_database, tmp_path
):
    lake = tmp_path / "lake"
    job = make_job(pipeline="customer-spend", parallelism=1, trigger_interval_seconds=1,
                   parameters={"orders_dsn": team_database, "lake_dir": str(lake)})  # fmt: skip
    assert job.state_backend == StateBackend.MEMORY
    orders = Orders(redis, stream_name)
    orders.send(60, seed=1)
    job_request_start(job=job)
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 1, "the first orders")

    # the plain upgrade is refused before anything stops, and says a migration is declared
    plain = finished(action_request(job=job, kind=ActionKind.UPGRADE, params={"pipeline": "customer-spend-daily"}))
    assert plain.status == ActionStatus.FAILED and "migrate the state" in plain.outcome, plain.outcome
    assert Job.objects.get(id=job.id).pipeline == "customer-spend" and not plain.params.get("savepoint")

    # the preview: on a scratch copy, the migration and the new version's first batch over orders not yet read
    preview = finished(action_request(job=job, kind=ActionKind.UPGRADE_PREVIEW,
                                      params={"pipeline": "customer-spend-daily", "migrate": 1}))  # fmt: skip
    assert preview.status == ActionStatus.SUCCEEDED, preview.outcome
    done = preview.params["migration"]
    windows, days = truth(orders), truth(orders, window_minutes=1440)
    assert done["variables"] == {"default": len(windows)}, "every hourly window of the state read"
    assert done["keys_in"] == len(windows) and done["keys_out"] == len(days) == done["rows_out"]
    assert done["dropped"] == {"on": ["customer"], "keys": 0, "samples": []}
    assert len(done["before"]) == min(10, len(windows)) and len(done["after"]) == min(10, len(days))
    assert Job.objects.get(id=job.id).pipeline == "customer-spend", "a preview changes nothing"
    assert not [p.name for p in job.directory.iterdir() if "migration" in p.name], "its scratch copies are gone"

    # the upgrade with the migration, while orders flow: savepoint N, the migrated line goes on after N's offsets
    orders.send(20, seed=2)
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 1, "the orders before it")
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

    orders.send(30, seed=3)
    hourly = truth(orders, before_migration)
    touched = {f"{o['customer']['id']}|" for o in orders.sent[before_migration:]}
    daily = {k: v for k, v in truth(orders, window_minutes=1440).items() if any(k.startswith(t) for t in touched)}
    wait_for(lambda: migrated_exactly(spark, job, team_database, lake, hourly, daily), 240, 1,
             "the daily totals to go on from the migrated state in every sink")  # fmt: skip
    assert committed_batches(job.checkpoint_location)[0] == 0, "Spark's batches start again in the new checkpoint"

    # and back: the hourly version from savepoint N; the sinks rewind what the migrated line wrote, and the orders
    # after N are counted in their hours, once
    back = finished(action_request(job=job, kind=ActionKind.UPGRADE_ROLLBACK, params={"upgrade": upgrade.id}))
    assert back.status == ActionStatus.SUCCEEDED and switched_to(job, "customer-spend"), back.outcome
    assert Job.objects.get(id=job.id).state_backend == StateBackend.MEMORY
    orders.send(10, seed=4)
    wait_for(lambda: every_sink_exact(spark, job, orders, team_database, lake), 240, 1,
             "every order in its hour after the rollback, in every sink")  # fmt: skip


@pytest.mark.spark
def test_two_state_variables_merged_into_one_keep_every_users_totals(spark, tmp_path):
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
