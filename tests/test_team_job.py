"""A team's job brought as it is written (examples/team_orders: nested JSON orders with an array of items, exact
decimals, event-time windows, parameters; the package depends on the SDK only): every result is checked against the
orders sent, every broken order is dead-lettered with the path that is wrong, and the parameters reach the pipeline
and the deploy. The long form runs it through savepoint, kill -9, rollback, restore, a parameter upgrade, a code
upgrade and the upgrade's rollback (``-m chaos``)."""

from __future__ import annotations

import os
import random
import signal
import time
from datetime import UTC, datetime
from decimal import Decimal

import pytest

from dashboard import pipelines
from dashboard.models import Action, ActionKind, ActionStatus, Deploy, Job, ResultRow, SavepointStatus
from dashboard.services.actions import action_request
from dashboard.services.runs import job_request_start, job_request_stop, pid_alive
from tests.conftest import run_through, wait_for
from tests.support import CUSTOMERS, Orders, finished, running_with_progress, sink, switched_to


def stop(job: Job) -> None:
    """Stop the job and wait for its driver's process to be gone (a restore or rollback refuses one still exiting)."""
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["starting", "running", "stopping"]).exists(), 120, 0.5, "the stop")
    pids = [pid for pid in job.runs.values_list("pid", flat=True) if pid]
    wait_for(lambda: not any(pid_alive(pid) for pid in pids), 60, 0.5, "the driver's process to exit")


def totals_match(job: Job, orders: Orders) -> bool:
    want = {
        k: {f: v[f] for f in ("customer", "start", "end", "orders", "items", "total")}
        for k, v in orders.expected().items()
    }
    return sink(job) == want


@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_team_job_with_nested_orders_and_parameters_counts_every_order_and_names_each_broken_path(
    make_job, start_driver, redis, stream_name
):
    orders = Orders(redis, stream_name)
    orders.send(40, seed=1)
    orders.send_poison()
    orders.send(40, seed=2)
    # a threshold in the middle of the totals: some windows are big, some are not
    threshold = float(sorted(Decimal(r["total"]) for r in orders.expected(window_minutes=30).values())[3])
    job = make_job(pipeline="customer-spend", parameters={"window_minutes": 30, "threshold": threshold}, parallelism=1)
    run_through(start_driver(job), redis, redis.xlen(stream_name))

    expected = orders.expected(window_minutes=30, threshold=threshold)
    got = sink(job, ("customer", "start", "end", "orders", "items", "total", "big"))
    assert got == expected, "every order counted once, with exact decimals, in 30-minute windows, big at the threshold"
    assert any(row["big"] for row in got.values()) and not all(row["big"] for row in got.values())

    dead = {f[b"entry"].decode(): f[b"reason"].decode() for _, f in redis.xrange(job.dead_letter_stream)}
    assert set(dead) == set(orders.poison), "each broken order dead-lettered once, no good one"
    for entry, path in orders.poison.items():
        assert dead[entry].startswith(f"{path}:"), (path, dead[entry])

    deploy = Deploy.objects.get(job=job)
    assert deploy.parameters == {"window_minutes": 30, "threshold": threshold, "lateness_minutes": 10,
                                 "orders_dsn": "", "lake_dir": ""}  # fmt: skip
    assert deploy.package == "statekeeper-example-team-orders 1.2.0"


@pytest.mark.chaos  # savepoint, kill -9, rollback, restore, two upgrades and a rollback: several minutes
@pytest.mark.django_db(transaction=True)
def test_a_team_job_through_savepoint_kill_rollback_restore_and_upgrades_keeps_every_total_exact(
    make_job, redis, stream_name, celery_worker, spark, team_database, tmp_path
):
    """Every step checks all three sinks (the results table, the team's table, the Parquet files read back by Spark)
    against the orders sent: each order's effect once, whatever was replayed, paused, killed or undone."""
    from tests.support import assert_every_sink_exact, every_sink_exact

    lake = tmp_path / "lake"
    job = make_job(pipeline="customer-spend", state_backend="rocksdb", parallelism=1, trigger_interval_seconds=1,
                   restart_strategy="fixed-delay", restart_delay_seconds=1,
                   parameters={"orders_dsn": team_database, "lake_dir": str(lake)})  # fmt: skip
    orders = Orders(redis, stream_name)

    def totals_match(job: Job, orders: Orders) -> bool:  # every sink, not only the results table
        return every_sink_exact(spark, job, orders, team_database, lake)

    orders.send(60, seed=1)
    orders.send_poison()
    job_request_start(job=job)
    wait_for(lambda: totals_match(job, orders), 240, 0.5, "the first orders to be counted")

    # a paused driver (SIGSTOP) while orders arrive: it carries on where it stopped once continued
    run = wait_for(lambda: running_with_progress(job), 60, 0.5, "a running driver")
    os.killpg(run.pid, signal.SIGSTOP)
    orders.send(20, seed=7)
    time.sleep(5)
    os.killpg(run.pid, signal.SIGCONT)
    wait_for(lambda: totals_match(job, orders), 240, 0.5, "every order after the pause")

    savepoint = finished(action_request(job=job, kind=ActionKind.SAVEPOINT, params={}))
    assert savepoint.status == ActionStatus.SUCCEEDED, savepoint.outcome
    saved = job.savepoints.get(status=SavepointStatus.VERIFIED)
    stood = saved.manifest["sinks"]
    assert set(stood) == {"results", "team-db", "lake"}, stood
    # read as the copy ends: a sink may hold the batch after it (written, not yet committed by Spark), no further
    assert all(saved.batch_id <= stood[name] <= saved.batch_id + 1 for name in ("team-db", "lake")), stood

    # kill -9 the driver while orders arrive: the restart replays, nothing counts twice
    run = wait_for(lambda: running_with_progress(job), 60, 0.5, "a running driver")
    orders.send(40, seed=2)
    os.killpg(run.pid, signal.SIGKILL)
    wait_for(lambda: running_with_progress(job, run.id), 180, 0.5, "the recovery after kill -9")
    orders.send(40, seed=3)
    wait_for(lambda: totals_match(job, orders), 240, 0.5, "every order after the kill")

    # roll back to a middle batch (of a stopped job, as the console asks): it replays what came after it
    stop(job)
    batches = sorted(
        job.checkpoints.filter(location=Job.objects.get(id=job.id).checkpoint_dir).values_list("batch_id", flat=True)
    )
    middle = batches[len(batches) // 2]
    rolled = finished(action_request(job=job, kind=ActionKind.ROLLBACK, params={"batch": middle}))
    assert rolled.status == ActionStatus.SUCCEEDED, rolled.outcome
    wait_for(lambda: totals_match(job, orders), 240, 0.5, "every order after the rollback")

    # restore the savepoint taken after the first orders: the rest are read again, counted once
    stop(job)
    restored = finished(action_request(job=job, kind=ActionKind.RESTORE, params={"savepoint": saved.id}))
    assert restored.status == ActionStatus.SUCCEEDED, restored.outcome
    wait_for(lambda: totals_match(job, orders), 240, 0.5, "every order after the restore")

    # a parameter change is an upgrade: the same pipeline, threshold 50; the rows it emits next say big at 50
    lower = finished(action_request(job=job, kind=ActionKind.UPGRADE,
                                    params={"pipeline": "customer-spend", "parameters": {"threshold": 50}}))  # fmt: skip
    assert lower.status == ActionStatus.SUCCEEDED, lower.outcome
    assert "threshold: 100.0 → 50.0" in lower.outcome and "Compatible" in lower.params["plan"]["summary"]
    assert Job.objects.get(id=job.id).parameters == {"window_minutes": 60, "threshold": 50.0, "lateness_minutes": 10,
                                                     "orders_dsn": team_database, "lake_dir": str(lake)}  # fmt: skip
    orders.send(30, seed=4)
    wait_for(lambda: totals_match(job, orders), 240, 0.5, "every order after the parameter upgrade")
    touched = {o["customer"]["id"] for o in orders.sent[-30:]}
    at_fifty = orders.expected(threshold=50.0)
    for key, row in ResultRow.objects.filter(job=job, kind="spend").values_list("key", "value"):
        if row["customer"] in touched and key == max(k for k in at_fifty if k.startswith(row["customer"] + "|")):
            assert row["big"] == at_fifty[key]["big"], (key, row)

    # a code change: version 2 adds the average order to the results, on the same state
    v2 = finished(action_request(job=job, kind=ActionKind.UPGRADE, params={"pipeline": "customer-spend-v2"}))
    assert v2.status == ActionStatus.SUCCEEDED and switched_to(job, "customer-spend-v2"), v2.outcome
    orders.send(30, seed=5)
    wait_for(lambda: totals_match(job, orders), 240, 0.5, "every order after the code upgrade")
    assert any("average" in r.value for r in ResultRow.objects.filter(job=job, kind="spend"))

    # and back: version 1 from the savepoint taken before version 2, with the threshold it ran with
    back = finished(action_request(job=job, kind=ActionKind.UPGRADE_ROLLBACK, params={"upgrade": v2.id}))
    assert back.status == ActionStatus.SUCCEEDED, back.outcome
    assert switched_to(job, "customer-spend") and Job.objects.get(id=job.id).parameters["threshold"] == 50.0
    orders.send(20, seed=6)
    wait_for(lambda: totals_match(job, orders), 240, 0.5, "every order after the upgrade's rollback")

    stop(job)
    assert_every_sink_exact(spark, job, orders, team_database, lake)
    dead = {f[b"entry"].decode() for _, f in redis.xrange(job.dead_letter_stream)}
    assert dead == set(orders.poison), "each broken order dead-lettered once, whatever was replayed"
    deploys = list(Deploy.objects.filter(job=job).order_by("id").values_list("pipeline", "parameters"))
    assert [d[0] for d in deploys][-3:] == ["customer-spend", "customer-spend-v2", "customer-spend"]
    assert {d[1]["threshold"] for d in deploys} == {100.0, 50.0}
    assert Action.objects.filter(job=job, status=ActionStatus.FAILED).count() == 0


@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_team_job_reads_its_nested_orders_from_parquet_files_and_refuses_csv_for_them(
    make_job, start_driver, redis, settings, tmp_path
):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from workers.spark.sources.files import unsupported

    settings.FILE_SOURCE_ROOTS = [tmp_path.resolve()]
    inbox = tmp_path / "orders"
    inbox.mkdir()
    orders = Orders(redis, "unused")  # only its figures: the orders go to a Parquet file, not a stream
    rng = random.Random(9)
    now = datetime.now(UTC)
    for n in range(30):
        items = [{"sku": f"S{k}", "qty": rng.randint(1, 3), "price": Decimal(rng.randint(1, 9999)) / 100}
                 for k in range(rng.randint(1, 3))]  # fmt: skip
        orders.sent.append({"order_id": f"o{n}", "customer": {"id": rng.choice(CUSTOMERS), "region": "eu"},
                            "placed_at": now.isoformat(), "express": None, "items": items})  # fmt: skip
    item = pa.struct([("sku", pa.string()), ("qty", pa.int32()), ("price", pa.decimal128(10, 2))])
    schema = pa.schema([
        ("order_id", pa.string()), ("customer", pa.struct([("id", pa.string()), ("region", pa.string())])),
        ("placed_at", pa.timestamp("us", tz="UTC")), ("express", pa.bool_()), ("items", pa.list_(item)),
    ])  # fmt: skip
    rows = [{**o, "placed_at": datetime.fromisoformat(o["placed_at"])} for o in orders.sent]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), inbox / "orders-1.parquet")

    spend = pipelines.get("customer-spend")
    assert "a CSV row is flat, and its payload nests customer, items" in unsupported(spend.payload, "csv")
    assert unsupported(spend.payload, "parquet") == unsupported(spend.payload, "json") == ""

    job = make_job(pipeline="customer-spend", source_kind="files", source_path=str(inbox), source_format="parquet",
                   source_stream="files:orders", parallelism=1)  # fmt: skip
    driver = start_driver(job)
    wait_for(lambda: totals_match(job, orders), 180, 0.5, "every Parquet order counted")
    assert driver.stop() == "stopped"
    assert not redis.xlen(job.dead_letter_stream), "no good order dead-lettered"
