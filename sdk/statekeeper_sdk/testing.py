"""A pipeline tested in the team's own CI, with PySpark and the SDK only (no console): its events in the micro-batches
you give, through the same checks a console's source makes, on a local SparkSession, as a streaming query with its
state, watermark and timers. What comes out is, batch by batch, what each sink would receive and what went to the
dead letters with its reason::

    from statekeeper_sdk.testing import run_batches

    batches = run_batches(CUSTOMER_SPEND, [[order_1, order_2], [late_order, b"not json"]],
                          parameters={"window_minutes": 30})
    assert batches[1].dead_letters[0].reason.startswith("not valid JSON")
    assert batches[0].results == [("spend", "c1|2026-11-26 10:00:00", {"orders": 2})]
    assert batches[0].sinks["team-db"] == [{"customer": "c1", ...}]

Events are given as their payloads (bytes, text, or a dict sent as JSON), or as ``(entry_id, payload)`` to set the
arrival an event time is bounded against (``"1700000000000-0"``, Redis' form: milliseconds, then a sequence). Spark
may run a batch without new events (a watermark to move, a timer to fire): it is in the list too, with no dead letters.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, Row, SparkSession

from statekeeper_sdk._runtime.compatibility import (
    INCOMPATIBLE,
    Verdict,
    compare,
    described,
    forget_batch,
    operator_schemas,
    replayed,
    summary,
)
from statekeeper_sdk._runtime.events import parse_entries
from statekeeper_sdk._runtime.migration import built_state, last_committed, migration_figures, read_state
from statekeeper_sdk._runtime.real_time import refusal
from statekeeper_sdk.events import Limits, Rejected
from statekeeper_sdk.pipeline import Pipeline, ResultRecord, apply, resolve
from statekeeper_sdk.sinks import ResultsTable

Event = bytes | str | Mapping[str, Any] | tuple[str, bytes | str | Mapping[str, Any]]


@dataclass
class Batch:
    """One micro-batch: the pipeline's output rows, what each sink would receive, and the events refused."""

    batch_id: int
    rows: list[Row] = field(default_factory=list)
    results: list[ResultRecord] = field(default_factory=list)  # what the console's results table would upsert
    sinks: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # a declared sink's rows, by its name
    dead_letters: list[Rejected] = field(default_factory=list)


def _payload(value: bytes | str | Mapping[str, Any]) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")  # a lone surrogate reaches the checks as the bytes it would be
    return json.dumps(dict(value)).encode()


def _entries(events: Iterable[Event], first_ms: int) -> list[tuple[bytes, list[bytes]]]:
    entries = []
    for i, event in enumerate(events):
        entry_id, payload = event if isinstance(event, tuple) else (f"{first_ms}-{i}", event)
        entries.append((entry_id.encode(), [b"v", _payload(payload)]))
    return entries


def _files_read(checkpoint: Path) -> dict[str, int]:
    """Which batch read each input file, from the file source's log in the checkpoint."""
    read: dict[str, int] = {}
    for log in sorted((checkpoint / "sources" / "0").glob("*")):
        if log.name.startswith("."):
            continue
        for line in log.read_text().splitlines()[1:]:  # the first line is the log's version
            try:
                entry = json.loads(line)
            except ValueError:  # a line Spark is writing now
                continue
            read[Path(entry["path"].removeprefix("file:")).name] = int(entry["batchId"])
    return read


def _session() -> SparkSession:
    """The active session, else a local one whose Python workers run this interpreter (a transformWithState operator
    imports the package's processor in a worker: the interpreter the package is installed in)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    return SparkSession.getActiveSession() or SparkSession.builder.master("local[2]").getOrCreate()


SETTLE_SECONDS = 3.0  # after the last input's batch commits: time for the no-data batch a watermark's advance runs


def _until_read(query: Any, checkpoint: Path, files: int) -> None:
    """Wait for the query to read every input file; then for it to end, as an available-now query does, or stop it
    SETTLE_SECONDS after the last file's batch committed: a query with processing-time timers or state with a time to
    live runs batches without data for as long as any is left, and would not end by itself."""
    settled_at: float | None = None
    while not query.awaitTermination(0.2):
        read = _files_read(checkpoint)
        last = max(read.values(), default=-1)
        if len(read) < files or not (checkpoint / "commits" / str(last)).exists():
            continue
        settled_at = settled_at or time.monotonic()
        if time.monotonic() - settled_at > SETTLE_SECONDS:
            query.stop()
            break
    if (failure := query.exception()) is not None:
        raise failure


def run_batches(
    pipeline: Pipeline,
    batches: Sequence[Iterable[Event]],
    *,
    parameters: Mapping[str, Any] | None = None,
    spark: SparkSession | None = None,
    workdir: str | Path | None = None,
    limits: Limits | None = None,
    shuffle_partitions: int = 2,
    initial_state: DataFrame | None = None,
) -> list[Batch]:
    """Run ``pipeline`` over ``batches`` of events, one micro-batch each, and return every batch Spark ran, in order.
    ``parameters``: the job's values (the pipeline's defaults fill the rest; a bad value raises ValueError, as a job's
    form refuses it). ``spark``: the session (the active one, else a local one). ``workdir``: where the events and
    the checkpoint go (a new temporary directory by default). ``limits``: the job's bounds on an event (its text, its
    event time ahead of its arrival), a console's defaults unless given. ``initial_state``: a migration's output
    (``migrate_state``), which the first batch starts from, as a migrated job's first batch does."""
    import pyarrow.parquet as pq

    values = dict(resolve(pipeline.parameters, parameters or {}))  # checked, the defaults filling the rest
    session = spark or _session()
    root = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="statekeeper-test-"))
    inbox, checkpoint = root / "events", root / "checkpoint"
    inbox.mkdir(parents=True, exist_ok=True)
    refused: dict[str, list[Rejected]] = {}
    now_ms = int(time.time() * 1000)
    for number, events in enumerate(batches):
        good, dead = parse_entries(_entries(events, now_ms + number), pipeline.payload, limits or Limits())
        name = f"batch-{number:06d}.parquet"
        pq.write_table(_table(good), inbox / name)
        os.utime(inbox / name, ns=(time.time_ns(), (now_ms + number) * 1_000_000))  # read in the order given
        refused[name] = dead

    with _settings(session, pipeline, shuffle_partitions):
        return _run(pipeline, session, inbox, checkpoint, values, refused, initial_state)


@contextmanager
def _settings(session: SparkSession, pipeline: Pipeline, shuffle_partitions: int) -> Iterator[None]:
    """The pipeline's session settings (and RocksDB where it needs it) while it runs, put back after: the session
    may run other pipelines."""
    conf = {"spark.sql.shuffle.partitions": str(shuffle_partitions), **pipeline.conf}
    if pipeline.needs_rocksdb:
        conf["spark.sql.streaming.stateStore.providerClass"] = (
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
        )
    before: dict[str, str | None] = {key: session.conf.get(key, None) for key in conf}
    for key, value in conf.items():
        session.conf.set(key, value)
    try:
        yield
    finally:
        for key, was in before.items():
            if was is None:
                session.conf.unset(key)
            else:
                session.conf.set(key, was)


def _run(
    pipeline: Pipeline, session: SparkSession, inbox: Path, checkpoint: Path, values: dict[str, Any],
    refused: dict[str, list[Rejected]], initial_state: DataFrame | None,
) -> list[Batch]:  # fmt: skip
    outputs = [sink for sink in pipeline.outputs(values) if not sink.off()]  # a target left empty: off, as in a job
    seen: dict[int, Batch] = {}

    def collect(output: DataFrame, batch_id: int) -> None:
        rows = output.collect()
        batch = Batch(batch_id, rows)
        for sink in outputs:
            if isinstance(sink, ResultsTable):
                batch.results, refused = pipeline.checked_results(rows)
                batch.dead_letters += [
                    Rejected(
                        f"batch-{batch_id}:results", "sink", reason, repr(result).encode("utf-8", "backslashreplace")
                    )
                    for result, reason in refused
                ]  # as the console's results table refuses them
            else:
                columns = list(getattr(sink, "columns", ()) or output.columns)
                batch.sinks[sink.name] = [{c: row[c] for c in columns} for row in rows]
        seen[batch_id] = batch

    query = _start(pipeline, session, inbox, checkpoint, values, collect, initial_state)
    _until_read(query, checkpoint, len(refused))
    for name, batch_id in _files_read(checkpoint).items():
        if batch_id in seen:
            seen[batch_id].dead_letters[:0] = refused.get(name, [])  # the events' first, then the outputs
    return [seen[b] for b in sorted(seen)]


def _start(
    pipeline: Pipeline, session: SparkSession, inbox: Path, checkpoint: Path, values: dict[str, Any],
    sink: Any, initial_state: DataFrame | None = None,
) -> Any:  # fmt: skip
    """The pipeline as an available-now query over the event files in ``inbox``, one file a batch, into ``sink``."""
    frame = (
        session.readStream.schema(pipeline.payload.spark_schema()).option("maxFilesPerTrigger", 1).parquet(str(inbox))
    )
    return (
        apply(pipeline, frame, values, initial_state)
        .writeStream.outputMode(pipeline.output_mode)
        .foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )


def _table(batch: Any) -> Any:
    import pyarrow as pa

    return pa.Table.from_batches([batch], schema=batch.schema)


def migrate_state(
    pipeline: Pipeline,
    checkpoint: str | Path,
    from_pipeline: str,
    *,
    parameters: Mapping[str, Any] | None = None,
    spark: SparkSession | None = None,
) -> DataFrame:
    """``pipeline``'s migration from ``from_pipeline``, run on the state of ``checkpoint`` (``run_batches``'s
    ``workdir``/checkpoint of the old version) at its last committed batch, as the console runs it: the new version's
    initial state, for ``run_batches(pipeline, ..., initial_state=...)``. ValueError when the pipeline declares no
    such migration, or when its output lacks a key column or gives a key twice (the console refuses both)."""
    session = spark or _session()
    migration = pipeline.migration_from(from_pipeline)
    if migration is None:
        raise ValueError(f"{pipeline.name} declares no migration from {from_pipeline}")
    return built_state(migration, read_state(session, checkpoint), resolve(pipeline.parameters, parameters or {}))


@dataclass
class UpgradeCheck:
    """An upgrade checked offline, as a console's preview checks it: the verdict per operator and state variable,
    the preview's sentence (``summary``, the console's words), and, where the new version declares a migration from
    the old, what the migration gives (``migration``: its figures, as the console's preview shows them, and the
    built ``state`` to start ``run_batches(..., initial_state=...)`` from)."""

    target: str
    batch: int | None  # the old version's last committed batch, re-run by the new version; None: no state yet
    verdicts: list[Verdict]
    summary: str
    migration: dict[str, Any] | None = None

    @property
    def incompatible(self) -> bool:
        return any(v.verdict == INCOMPATIBLE for v in self.verdicts)


def check_upgrade(
    pipeline: Pipeline,
    workdir: str | Path,
    to: Pipeline,
    *,
    parameters: Mapping[str, Any] | None = None,
    to_parameters: Mapping[str, Any] | None = None,
    spark: SparkSession | None = None,
    shuffle_partitions: int = 2,
    timeout: float = 300,
) -> UpgradeCheck:
    """Whether ``to`` can take over ``pipeline``'s state, from the state ``run_batches(pipeline, ...,
    workdir=workdir)`` left: the console's upgrade preview, offline. ``to`` re-runs the last committed batch on a
    copy of the checkpoint (Spark checks the new code against the old state as a restart would); the state schemas
    before and after are compared by the console's own rules (``statekeeper_sdk.compatibility``). ``parameters``:
    the old version's values (as given to ``run_batches``); ``to_parameters``: the values that change, the old ones
    kept for the parameters ``to`` declares too, as an upgrade keeps them. The re-run reads the batch's events as
    the old version's checks parsed them."""
    session = spark or _session()
    root = Path(workdir)
    checkpoint = root / "checkpoint"
    before = dict(resolve(pipeline.parameters, parameters or {}))
    declared = {p.name for p in to.parameters}
    after = dict(resolve(to.parameters, {k: v for k, v in before.items() if k in declared} | dict(to_parameters or {})))
    shown = described(to.name, before, after)
    if (batch := last_committed(checkpoint)) is None:
        return UpgradeCheck(
            to.name, None, [], f"{pipeline.name} has no committed state yet: {shown} starts from the beginning of "
            "the source.",
        )  # fmt: skip
    result: dict[str, Any] = {"before": operator_schemas(session, checkpoint, batch)}
    with tempfile.TemporaryDirectory(prefix="statekeeper-upgrade-") as scratch_root:
        scratch = Path(scratch_root) / "checkpoint"
        shutil.copytree(checkpoint, scratch)
        forget_batch(scratch, batch)
        with _settings(session, to, shuffle_partitions):
            rows, error = _replay(to, session, root / "events", scratch, batch, after, timeout)
        result["output_rows"] = rows
        if error:
            result["replay_error"] = error
        else:
            result["after"] = operator_schemas(session, scratch, batch)
    verdicts = compare(result, pipeline, to)
    check = UpgradeCheck(to.name, batch, verdicts, summary(verdicts, shown, batch, rows))
    if (migration := to.migration_from(pipeline.name)) is not None:
        old = read_state(session, checkpoint, batch)
        built = built_state(migration, old, resolve(to.parameters, after))
        check.migration = {"from": pipeline.name, "target": to.name, **migration_figures(migration, old, built),
                           "state": built}  # fmt: skip
    return check


def check_real_time(
    pipeline: Pipeline,
    *,
    parameters: Mapping[str, Any] | None = None,
    spark: SparkSession | None = None,
    shuffle_partitions: int = 2,
) -> str | None:
    """Why Spark's real-time mode refuses ``pipeline``'s query, in Spark's words, or None when Spark plans it so (a
    console's real-time job starts on it, and its upgrade preview refuses a version this refuses). Spark plans the query
    on an empty in-memory source of the pipeline's events and stops it: a few seconds, no broker::

        assert check_real_time(URL_COUNTS_LIVE) is None

    A pipeline that does not declare ``real_time=True`` is checked all the same (whether it could). Its state is in
    RocksDB, as real-time mode keeps it (checkpoint format 2)."""
    values = dict(resolve(pipeline.parameters, parameters or {}))
    return refusal(spark or _session(), pipeline, values, shuffle_partitions, dict(pipeline.conf))


def _replay(
    pipeline: Pipeline, session: SparkSession, inbox: Path, checkpoint: Path, batch: int, values: dict[str, Any],
    timeout: float,
) -> tuple[int, str]:  # fmt: skip
    """Re-run ``batch`` of the checkpoint copy with ``pipeline``; the rows it produced, and why Spark refused it."""
    rows: list[int] = []

    def count(frame: DataFrame, batch_id: int) -> None:
        rows.append(frame.count())

    error = replayed(_start(pipeline, session, inbox, checkpoint, values, count), checkpoint, batch, timeout)
    return sum(rows), error
