"""The team's own tests of its pipeline, with the SDK's test kit: PySpark and the SDK only, no console."""

from __future__ import annotations

from decimal import Decimal

import pytest
from statekeeper_sdk.testing import check_upgrade, migrate_state, run_batches
from team_orders.jobs import CUSTOMER_SPEND, CUSTOMER_SPEND_DAILY, CUSTOMER_SPEND_V2


def order(order_id: str, customer: str, at: str, *prices: str) -> dict:
    return {"order_id": order_id, "customer": {"id": customer, "region": "eu"}, "placed_at": at,
            "items": [{"sku": f"S{i}", "qty": 1, "price": p} for i, p in enumerate(prices)]}  # fmt: skip


TARGETS = {"orders_dsn": "postgres://team@db.example/team_orders", "lake_dir": "/lake/customer_spend"}


@pytest.fixture(scope="module")
def batches() -> list:
    return run_batches(
        CUSTOMER_SPEND,
        [
            [order("o1", "c1", "2026-11-26T10:05:00Z", "10.00"), order("o2", "c1", "2026-11-26T10:20:00Z", "5.50"),
             order("o3", "c2", "2026-11-26T10:07:00Z", "7.25"), {**order("o4", "c2", "2026-11-26T10:08:00Z"),
             "items": [{"sku": "S0", "qty": 1, "price": "ten"}]}],
            [order("o5", "c1", "2026-11-26T10:29:00Z", "100.00"), b"not json at all"],
        ],
        parameters={"window_minutes": 30, "threshold": 100.0, **TARGETS},
    )  # fmt: skip


def test_each_batch_updates_the_windows_it_touched_in_every_sink(batches):
    data = [b for b in batches if b.rows]
    first, second = data[0], data[1]
    assert sorted((key, v["orders"], v["total"]) for _, key, v in first.results) == [
        ("c1|2026-11-26 10:00|2026-11-26 10:30", 2, "15.50"), ("c2|2026-11-26 10:00|2026-11-26 10:30", 1, "7.25"),
    ]  # fmt: skip
    assert [(r["customer"], r["orders"], r["total"], r["big"]) for r in second.sinks["team-db"]] == [
        ("c1", 3, Decimal("115.50"), True)
    ], "update mode: the window c1 is in again, now past the threshold"
    assert set(second.sinks) == {"team-db", "lake"}, "both of the team's sinks, their targets set"


def test_a_bad_event_goes_to_the_dead_letters_with_the_path_that_is_wrong(batches):
    refused = [(d.stage, d.reason) for b in batches for d in b.dead_letters]
    assert ("parse", "items[0].price: not a decimal number") in refused
    assert any(stage == "parse" and "JSON" in reason for stage, reason in refused), refused
    assert len(refused) == 2


def test_the_lake_is_off_when_its_directory_is_left_empty():
    [batch] = [b for b in run_batches(CUSTOMER_SPEND_V2, [[order("o1", "c1", "2026-11-26T10:05:00Z", "4.00")]],
                                      parameters={"orders_dsn": TARGETS["orders_dsn"]}) if b.rows]  # fmt: skip
    assert set(batch.sinks) == {"team-db"}
    assert [v["average"] for _, _, v in batch.results] == ["4.00"]


def test_the_daily_version_starts_from_the_windows_totals_summed_into_days(tmp_path):
    """The team's check of its state migration, before any console runs it: customer-spend's state after two
    batches, migrated, then the daily version's first batch on it."""
    run_batches(
        CUSTOMER_SPEND,
        [[order("o1", "c1", "2026-11-25T10:05:00Z", "10.00"), order("o2", "c1", "2026-11-25T13:20:00Z", "5.50"),
          order("o3", "c2", "2026-11-25T10:07:00Z", "7.25")],
         [order("o4", "c1", "2026-11-25T23:10:00Z", "1.00", "2.00")]],
        parameters={"window_minutes": 60, "lateness_minutes": 1440},
        workdir=tmp_path / "hourly",
    )  # fmt: skip
    seed = migrate_state(CUSTOMER_SPEND_DAILY, tmp_path / "hourly" / "checkpoint", "customer-spend",
                         parameters={"lateness_minutes": 1440})  # fmt: skip
    assert sorted((r["customer"], r["orders"], r["items"], str(r["total"])) for r in seed.collect()) == [
        ("c1", 3, 4, "18.50"),
        ("c2", 1, 1, "7.25"),
    ]
    [first] = [b for b in run_batches(CUSTOMER_SPEND_DAILY, [[order("o5", "c1", "2026-11-25T23:30:00Z", "100.00")]],
                                      parameters={"lateness_minutes": 1440}, initial_state=seed,
                                      workdir=tmp_path / "daily") if b.rows]  # fmt: skip
    assert [(key, v["orders"], v["total"], v["big"]) for _, key, v in first.results] == [
        ("c1|2026-11-25 00:00|2026-11-26 00:00", 4, "118.50", True)
    ], "the day's total goes on from the migrated one"


def test_a_migration_from_a_pipeline_it_does_not_declare_is_refused(tmp_path):
    with pytest.raises(ValueError, match="declares no migration from customer-spend-v2"):
        migrate_state(CUSTOMER_SPEND_DAILY, tmp_path, "customer-spend-v2")


@pytest.fixture(scope="module")
def hourly(tmp_path_factory) -> tuple:
    """customer-spend's state after two batches: what an upgrade would start from."""
    workdir = tmp_path_factory.mktemp("hourly")
    params = {"window_minutes": 60, "lateness_minutes": 1440}
    run_batches(
        CUSTOMER_SPEND,
        [[order("o1", "c1", "2026-11-25T10:05:00Z", "10.00"), order("o2", "c2", "2026-11-25T10:07:00Z", "7.25")],
         [order("o3", "c1", "2026-11-25T11:10:00Z", "1.00")]],
        parameters=params, workdir=workdir,
    )  # fmt: skip
    return workdir, params


def test_the_average_version_takes_over_the_state_as_the_console_would_let_it(hourly):
    """The pull request's check of a code upgrade: v2 adds a column to the output, not to the state."""
    workdir, params = hourly
    check = check_upgrade(CUSTOMER_SPEND, workdir, CUSTOMER_SPEND_V2, parameters=params)
    assert not check.incompatible, check.summary
    assert check.summary.startswith(f"Compatible with customer-spend-v2 at batch {check.batch}"), check.summary
    assert check.migration is None


def test_the_daily_version_is_refused_the_old_state_and_its_migration_previewed(hourly):
    workdir, params = hourly
    check = check_upgrade(CUSTOMER_SPEND, workdir, CUSTOMER_SPEND_DAILY, parameters=params)
    assert check.incompatible
    assert check.summary.startswith("Incompatible with customer-spend-daily:"), check.summary
    assert "Spark refused the new version on this state: [STREAMING_STATEFUL_OPERATOR_NOT_MATCH" in check.summary, (
        "the aggregation's place is taken by another operator"
    )
    assert check.migration is not None
    assert (check.migration["keys_out"], check.migration["rows_out"]) == (2, 2), "c1 and c2, one day each"
    assert sorted((r["customer"], r["orders"], str(r["total"])) for r in check.migration["state"].collect()) == [
        ("c1", 2, "11.00"), ("c2", 1, "7.25"),
    ]  # fmt: skip
