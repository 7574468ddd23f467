"""The sinks a pipeline declares, each exactly once: the team's own table (a commit table in its database, fenced by the
driver's token), Spark's file-sink layout (a ``_spark_metadata`` log Spark's readers trust), and the team job writing
both beside the results table, through a replayed batch and a fork, checked against the orders sent."""

from __future__ import annotations

import re
import shutil
import sqlite3
import traceback
import uuid
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from statekeeper_sdk import FileSink, ResultsTable, TableSink

from dashboard.checkpoint_dir.files import committed_batches, copy_checkpoint
from dashboard.engine.sinks import COMMITS, Fenced, FileLog, SinkError, TableWriter, chunked, write_files
from dashboard.failures import root_cause
from dashboard.models import Job, ResultRow
from dashboard.pipelines import get as get_pipeline
from dashboard.services.forks import switch_to_fork
from tests.conftest import run_through
from tests.support import Orders, assert_every_sink_exact, table
from workers.sink import SinkSet, rehearse, trim_commits, trim_file_log

COUNTS = TableSink(
    name="counts",
    table="counts",
    dsn="",
    columns=("k", "end", "n"),
    key=("k", "end"),
    create='CREATE TABLE IF NOT EXISTS counts (k text NOT NULL, "end" text NOT NULL, n bigint, '
    'batch_id bigint NOT NULL, PRIMARY KEY (k, "end"))',
)


def write(writer: TableWriter, batch: int, digest: str, rows: list[tuple]) -> Any:
    return writer.write(batch, digest, ["k", "end", "n"], chunked(iter(rows), 2))


def test_a_team_table_holds_each_batch_once_refuses_a_stale_token_and_drops_what_a_fork_undoes(team_database):
    sink = TableSink(**{**COUNTS.__dict__, "dsn": team_database})
    driver = TableWriter(sink, "orders-job", token=7)
    assert write(driver, 0, "b0", [("a", "x", 1), ("b", "x", 2), ("c", "x", 3)]).rows == 3
    again = write(driver, 0, "b0", [("a", "x", 1), ("b", "x", 2), ("c", "x", 3)])
    assert again.skipped and again.rows == 0, "a replayed batch (same offsets, same code) is skipped"
    # a row the table refuses (PostgreSQL text cannot hold NUL) is set aside with the reason; the rest is written
    third = write(driver, 1, "b1", [("a", "x", 10), ("bad\x00key", "x", 1), ("d", "x", 4)])
    assert third.rows == 2 and len(third.rejected) == 1
    assert third.rejected[0].stage == "sink" and "NUL" in third.rejected[0].reason
    write(driver, 2, "b2", [("e", "x", 5)])

    # the driver before this one (an older token) can never write again
    with pytest.raises(Fenced, match="token 6 is stale"):
        write(TableWriter(sink, "orders-job", token=6), 3, "b3", [("z", "x", 1)])

    # a fork at batch 0 (a rollback): batch 1 comes again under another digest; what batches 1 and 2 wrote goes first
    forked = TableWriter(sink, "orders-job", token=8)
    redo = write(forked, 1, "b1-fork", [("a", "x", 11)])
    assert redo.rewound == 3, "the rows batches 1 and 2 wrote: a and d (batch 1), e (batch 2)"
    assert table(team_database, "SELECT k, n, batch_id FROM counts ORDER BY k") == [
        ("a", 11, 1), ("b", 2, 0), ("c", 3, 0),
    ]  # fmt: skip
    assert table(team_database, f"SELECT batch_id, rows, token FROM {COMMITS} ORDER BY batch_id") == [
        (0, 3, 7),
        (1, 1, 8),
    ]
    assert forked.position().last_batch == 1 and forked.position().recent == ((1, 1), (0, 3))
    # the database drops the connection between two batches (a restart): the next batch opens another and is written
    with psycopg.connect(team_database, autocommit=True) as db:
        db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                   "AND pid <> pg_backend_pid()")  # fmt: skip
    assert write(forked, 2, "b2-fork", [("f", "x", 6)]).rows == 1
    for writer in (driver, forked):
        writer.close()


def test_a_rewind_puts_back_what_the_rewound_batches_changed_in_a_keyed_table(team_database):
    """A new line that writes other keys than the old (a state migration's days in place of hours) after a rewind:
    each row the rewound batches changed is back as it was before them, not deleted; rows they created are gone."""
    sink = TableSink(**{**COUNTS.__dict__, "dsn": team_database})
    old = TableWriter(sink, "orders-job", token=1)
    write(old, 0, "b0", [("a", "hour", 1), ("b", "hour", 2)])
    write(old, 1, "b1", [("a", "hour", 3), ("c", "hour", 1)])
    write(old, 2, "b2", [("a", "hour", 4), ("b", "hour", 5)])
    new = TableWriter(sink, "orders-job", token=2)
    redo = write(new, 1, "b1-migrated", [("a", "day", 9)])
    assert redo.rewound == 3, "a and b (batch 2) and c (batch 1) deleted, then a and b put back"
    assert table(team_database, 'SELECT k, "end", n, batch_id FROM counts ORDER BY k, "end"') == [
        ("a", "day", 9, 1), ("a", "hour", 1, 0), ("b", "hour", 2, 0),
    ]  # fmt: skip
    write(new, 2, "b2-migrated", [("a", "day", 10)])
    write(TableWriter(sink, "orders-job", token=3), 2, "b2-again", [("b", "day", 1)])  # a rewind of a rewind
    assert table(team_database, 'SELECT k, "end", n FROM counts ORDER BY k, "end"') == [
        ("a", "day", 9), ("a", "hour", 1), ("b", "day", 1), ("b", "hour", 2),
    ]  # fmt: skip
    assert trim_commits(new, 2) > 0 and table(
        team_database, "SELECT count(*) FROM statekeeper_sink_undo WHERE batch_id < 2"
    ) == [(0,)], "what no rewind can reach any more is trimmed"
    for writer in (old, new):
        writer.close()


def test_a_probe_names_the_sink_a_new_target_may_not_write_and_writes_nothing(team_database, tmp_path):
    """Before a blue/green upgrade hands the job's output to a new target, its sinks are tried without writing: a
    role without the rights a write takes, or a directory that cannot be made, is named as the batch's failure would
    name it, the password masked; with the rights granted the probe passes, and the table is as it was."""
    owner = TableWriter(TableSink(**{**COUNTS.__dict__, "dsn": team_database}), "orders-job", token=3)
    write(owner, 0, "b0", [("a", "x", 1)])
    owner.probe()
    owner.close()
    role = f"reader_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(team_database, autocommit=True) as db:
        db.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'pw-{role}'")
        db.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    server = urlsplit(team_database)
    limited = server._replace(netloc=f"{role}:pw-{role}@{server.hostname}:{server.port or 5432}").geturl()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    pipeline = replace(get_pipeline("url-counts"), sinks=(
        TableSink(**{**COUNTS.__dict__, "dsn": limited}), FileSink("lake", path=str(blocker / "lake")),
    ))  # fmt: skip
    sinks = SinkSet(job_id=0, job_name="orders-job", token=0, pipeline=pipeline, parameters={})
    problems = sinks.probe()
    assert len(problems) == 2, problems
    assert problems[0].startswith("sink counts (counts in postgresql://") and "InsufficientPrivilege" in problems[0]
    assert f"pw-{role}" not in problems[0], "the password is masked"
    assert problems[1].startswith("sink lake (") and "NotADirectoryError" in problems[1], problems[1]

    with psycopg.connect(team_database, autocommit=True) as db:
        db.execute(f"GRANT INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        db.execute(f"GRANT CREATE ON SCHEMA public TO {role}")  # a write's CREATE TABLE IF NOT EXISTS asks for it
    lake = replace(get_pipeline("url-counts"), sinks=(TableSink(**{**COUNTS.__dict__, "dsn": limited}),
                                                       FileSink("lake", path=str(tmp_path / "lake"))))  # fmt: skip
    granted = SinkSet(job_id=0, job_name="orders-job", token=0, pipeline=lake, parameters={})
    assert granted.probe() == []
    granted.close()
    assert table(team_database, "SELECT k, n, batch_id FROM counts") == [("a", 1, 0)], "the probe wrote nothing"
    assert table(team_database, f"SELECT batch_id, token FROM {COMMITS}") == [(0, 3)]
    assert [p.name for p in (tmp_path / "lake").iterdir()] == [], "the directory made, the probe's file gone"
    with psycopg.connect(team_database, autocommit=True) as db:
        db.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {role}")
        db.execute(f"REVOKE ALL ON SCHEMA public FROM {role}")
        db.execute(f"DROP ROLE {role}")


def test_the_table_contract_works_through_another_db_api_driver(tmp_path):
    path = tmp_path / "team.db"
    sink = TableSink(**{**COUNTS.__dict__, "dsn": str(path), "driver": "sqlite3"})
    writer = TableWriter(sink, "orders-job", token=1)
    assert write(writer, 0, "b0", [("a", "x", 1), ("a", "x", 2)]).rows == 2, "the same key twice: upserted"
    assert write(writer, 0, "b0", [("a", "x", 2)]).skipped
    write(writer, 1, "b1", [("b", "y", 3)])
    assert write(TableWriter(sink, "orders-job", token=2), 1, "b1-fork", [("b", "y", 4)]).rewound == 1
    with pytest.raises(Fenced):
        write(writer, 2, "b2", [("c", "y", 1)])
    writer.close()
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT k, n, batch_id FROM counts ORDER BY k").fetchall() == [("a", 2, 0), ("b", 4, 1)]


@pytest.mark.spark
def test_a_file_sink_writes_sparks_file_sink_layout_which_spark_reads_back_exactly(spark, tmp_path):
    out = tmp_path / "lake"
    lake = FileSink("lake", path=str(out))

    def batch(b: int, tag: str = "") -> Any:
        return spark.createDataFrame([(f"k{b}{tag}", b), (f"j{b}{tag}", b)], "k string, n long")

    for b in range(13):  # past batch 9, which Spark's readers expect as a compaction of everything before it
        assert write_files(batch(b), lake, b, f"d{b}").rows == 2
    assert (out / "_spark_metadata" / "9.compact").is_file() and not (out / "_spark_metadata" / "9").exists()
    read = spark.read.parquet(str(out))
    assert read.count() == 26 and sorted(r.batch_id for r in read.collect()) == sorted(list(range(13)) * 2)
    assert write_files(batch(12), lake, 12, "d12").skipped, "a replay of the last batch is skipped"

    # a file no commit lists (an attempt that died before its log entry) is not read by Spark
    stray = out / "part-stray.snappy.parquet"
    shutil.copy(next(out.glob("part-b000000012-*.parquet")), stray)
    assert spark.read.parquet(str(out)).count() == 26
    # an attempt that placed its files and died: the next attempt moves them aside before writing
    log = FileLog(out)
    log.pending(13, [stray.name])
    write_files(batch(13), lake, 13, "d13")
    assert not stray.exists() and (out / "_statekeeper" / "orphans" / stray.name).exists()

    # a fork at batch 4: batch 5 under another digest drops batches 5–13 (their files leave the log and the folder)
    forked = write_files(batch(5, "b"), lake, 5, "d5-fork")
    assert forked.rewound == 9
    assert FileLog(out).batches() == [0, 1, 2, 3, 4, 5]
    got = sorted(r.k for r in spark.read.parquet(str(out)).collect())
    assert got == sorted([f"{p}{b}" for b in range(5) for p in "kj"] + ["k5b", "j5b"])
    assert len(list((out / "_statekeeper" / "rewound").rglob("*.parquet"))) == 9
    assert FileLog(out).position().recent[0] == (5, 2)

    # a sink that starts late (added to a job at batch 51 by an upgrade): Spark still reads it
    late = tmp_path / "late"
    for b in (51, 52):
        write_files(batch(b), FileSink("late", path=str(late)), b, f"d{b}")
    assert sorted(r.batch_id for r in spark.read.parquet(str(late)).collect()) == [51, 51, 52, 52]


@pytest.mark.spark
def test_a_sink_that_cannot_write_fails_the_batch_naming_itself(spark, team_database):
    """The team's database refuses (here: it does not exist): the batch fails, and the cause the console shows is the
    sink's, not py4j's wrapper."""
    gone = TableSink(**{**COUNTS.__dict__, "dsn": team_database.rsplit("/", 1)[0] + "/no_such_database"})
    sinks = SinkSet(job_id=0, job_name="orders-job", token=1, pipeline=replace(get_pipeline("url-counts"),
                    sinks=(gone,)), parameters={})  # fmt: skip
    frame = spark.createDataFrame([("a", "x", 1)], "k string, end string, n long")
    with pytest.raises(SinkError) as failed:
        sinks.write(frame, 0, "d0", [])
    cause = root_cause("".join(traceback.format_exception(failed.value)))
    assert cause.startswith("SinkError: sink counts (counts in postgresql://") and "no_such_database" in cause, cause
    assert "OperationalError" in cause


@pytest.mark.spark
@pytest.mark.django_db
def test_a_standbys_rehearsal_of_a_batch_writes_nothing_and_leaves_nothing_cached(spark, tmp_path):
    """A warm standby consumes its scratch batches as the results sink would, short of the write: the results a table
    could store are counted (not the one it would refuse), none reaches the results table, and the batch does not stay
    in Spark's cache for the standby's hours of waiting. A file sink is written as a batch would write it, into the
    scratch directory only (the Parquet writer loaded before a takeover's first batch needs it)."""
    frame = spark.createDataFrame([("/a", 3), ("/b", 1), ("/" + "x" * 600, 2)], "url string, requests long")
    assert rehearse(get_pipeline("url-counts"), frame) == 2
    assert not ResultRow.objects.exists()
    assert not frame.storageLevel.useMemory and not frame.storageLevel.useDisk

    lake = tmp_path / "lake"
    with_files = replace(get_pipeline("url-counts"), sinks=(ResultsTable(), FileSink("lake", path=str(lake))))
    scratch = tmp_path / "scratch"
    for _ in range(2):  # again, as its next warm batch: the whole write each time, never skipped as a replay
        assert rehearse(with_files, frame, scratch) == 2
        assert FileLog(str(scratch / "lake")).record(0)["rows"] == 3
    assert len(list((scratch / "lake").glob("part-*.snappy.parquet"))) == 1
    assert not lake.exists() and not ResultRow.objects.exists(), "nothing reaches the job's own sinks"


@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_the_team_job_writes_its_own_table_and_parquet_once_through_a_replay_and_a_fork(
    make_job, start_driver, redis, stream_name, spark, team_database, tmp_path, client, django_user_model
):
    lake = tmp_path / "lake" / "customer_spend"
    orders = Orders(redis, stream_name)
    orders.send(30, seed=1)
    orders.send_poison()
    job = make_job(pipeline="customer-spend", parallelism=1, max_records_per_batch=10,
                   parameters={"orders_dsn": team_database, "lake_dir": str(lake)})  # fmt: skip
    run_through(start_driver(job), redis, redis.xlen(stream_name))
    assert_every_sink_exact(spark, job, orders, team_database, lake)

    # kill -9 between the sinks' commits and Spark's: the checkpoint lacks the last commit, so that batch runs again
    # with the same offsets, and each sink skips it
    last = committed_batches(job.checkpoint_location)[-1]
    first_commit = table(team_database, f"SELECT committed_at FROM {COMMITS} WHERE batch_id = {last}")
    for name in (str(last), f".{last}.crc"):
        (job.checkpoint_location / "commits" / name).unlink(missing_ok=True)
    orders.send(20, seed=2)
    run_through(start_driver(job), redis, redis.xlen(stream_name))
    assert_every_sink_exact(spark, job, orders, team_database, lake)
    assert table(team_database, f"SELECT committed_at FROM {COMMITS} WHERE batch_id = {last}") == first_commit
    assert not (lake / "_statekeeper" / "rewound").exists(), "the replayed batch was skipped, not written again"

    # a fork at a middle batch, as a rollback makes it: the preview says what each sink undoes, the replay rewrites it
    batches = committed_batches(job.checkpoint_location)
    middle = batches[len(batches) // 2]
    admin = django_user_model.objects.create_superuser("admin", "a@example.com", "pw")
    client.force_login(admin)
    preview = client.get(f"/jobs/{job.name}/rollback?batch={middle}").content.decode()
    lines = re.findall(r"<li>((?:team-db|lake) \(.*?)</li>", preview.split('id="sink-consequences"')[1])
    assert len(lines) == 2 and all(f"batches {middle + 1}–{batches[-1]} are removed" in line for line in lines), lines
    copy_checkpoint(job.checkpoint_location, job.directory / "checkpoint-fork", middle)
    switch_to_fork(job, "checkpoint-fork")
    orders.send(10, seed=3)
    run_through(start_driver(job), redis, redis.xlen(stream_name))
    assert_every_sink_exact(spark, job, orders, team_database, lake)
    assert list((lake / "_statekeeper" / "rewound").rglob("*.parquet")), "the undone batches' files moved aside"
    dead = {f[b"entry"].decode() for _, f in redis.xrange(job.dead_letter_stream)}
    assert dead == set(orders.poison)

    # the Results tab shows each sink against the checkpoint
    page = client.get(f"/jobs/{job.name}/results").content.decode()
    newest = committed_batches(Job.objects.get(id=job.id).checkpoint_location)[-1]
    for name in ("results", "team-db", "lake"):
        assert f'data-sink="{name}"' in page
    for name in ("team-db", "lake"):
        row = re.search(rf'data-sink="{name}">.*?</tr>', page, re.S)
        assert row and row.group(0).count(f'<td class="num">{newest}</td>') == 2, (name, "sink and checkpoint agree")


@pytest.mark.spark
def test_a_sinks_bookkeeping_is_trimmed_to_what_a_restore_or_rollback_can_still_reach(spark, tmp_path):
    """One commit row a batch, one log entry a batch: trimmed below the oldest batch a restore or rollback can go back
    to, and the sink stays exactly-once from there (a replay skipped, a fork rewound) and read whole by Spark."""
    sink = TableSink(**{**COUNTS.__dict__, "dsn": str(tmp_path / "team.db"), "driver": "sqlite3"})
    writer = TableWriter(sink, "orders-job", token=1)
    for b in range(30):
        write(writer, b, f"b{b}", [(f"k{b}", "x", b)])
    assert trim_commits(writer, 25) == 25
    with sqlite3.connect(tmp_path / "team.db") as db:
        assert [b for (b,) in db.execute(f"SELECT batch_id FROM {COMMITS} ORDER BY batch_id")] == [25, 26, 27, 28, 29]
    assert write(writer, 29, "b29", [("k29", "x", 29)]).skipped, "a replay from the floor on is still skipped"
    assert write(writer, 27, "b27-fork", [("k27", "x", 270)]).rewound == 3, "a fork after the floor still rewinds"
    writer.close()

    out = tmp_path / "lake"
    lake = FileSink("lake", path=str(out))
    for b in range(33):
        write_files(spark.createDataFrame([(f"k{b}", b)], "k string, n long"), lake, b, f"d{b}")
    log = FileLog(out)
    assert trim_file_log(log, 25) > 0
    assert log.batches()[0] == 19 and (out / "_spark_metadata" / "19.compact").is_file(), "kept from the compaction"
    assert not (out / "_statekeeper" / "batches" / "3.json").exists()
    assert spark.read.parquet(str(out)).count() == 33, "Spark still reads every batch's file"
    assert write_files(spark.createDataFrame([("k26b", 26)], "k string, n long"), lake, 26, "d26-fork").rewound == 7
    assert sorted(r.n for r in spark.read.parquet(str(out)).collect()) == list(range(27))
