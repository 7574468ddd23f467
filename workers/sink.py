"""The results sink: keyed upserts into PostgreSQL, fenced by the checkpoint lease.

A replayed batch writes the same keys with the same values, so it changes nothing. The fencing token is checked before
the batch's frame is computed (computing it writes the state files) and again in the same transaction as the writes: a
driver that lost its lease can never write, even if it still runs.

A result the table cannot store (a key too long, a NUL, a lone surrogate, NaN, nesting past JSON's reach) is not
written: it goes to the job's dead-letter stream with stage "sink", and the batch goes on.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import redis
from django.db import connection, transaction
from django.db.models import Subquery
from django.utils import timezone
from pyspark.sql import DataFrame, Row
from statekeeper_sdk import FileSink, KafkaSink, Pipeline, Rejected, Result, ResultRecord, ResultsTable, TableSink

from dashboard.checkpoint_dir.files import committed_batches, handed_over_after, lineage_base
from dashboard.engine.sinks import (  # Fenced: this driver no longer holds the lease (the console's or a sink's)
    COMMITS,
    COMPACT_INTERVAL,
    UNDO,
    Fenced,
    FileLog,
    KafkaWriter,
    SinkError,
    TableWriter,
    Written,
    chunked,
    kafka_rows,
    lineage_digest,
    probe_files,
    rejected_output,
    write_files,
)
from dashboard.models import ResultRow, ResultUndo, Savepoint, SavepointStatus
from dashboard.pipelines import result_bound
from workers.spark.sources.redis_streams import dead_letter

CHUNK = 5000
log = logging.getLogger(__name__)
KEY_MAX = ResultRow._meta.get_field("key").max_length or 500


def encoded(key: Any, value: Any) -> tuple[str, str]:
    """The value as the JSON text the table stores, and why PostgreSQL would refuse the result (and fail the whole
    batch with it): empty when it can be stored."""
    if not isinstance(key, str):
        return "", f"the key is a {type(key).__name__}, not text"
    if len(key) > KEY_MAX:
        return "", f"the key is {len(key):,} characters (limit {KEY_MAX})"
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
        (key + text).encode("utf-8")
    except RecursionError:
        return "", "the value is nested too deeply for JSON"
    except UnicodeEncodeError:
        return "", "a lone surrogate in the key or value: not valid Unicode"
    except (TypeError, ValueError) as exc:
        return "", f"the value is not JSON: {exc}"
    if "\x00" in key or "\\u0000" in text:
        return "", "a NUL character in the key or value"
    return text, ""


def lease_hold(cursor: Any, *, job_id: int, token: int, batch_id: int) -> None:
    """Raise Fenced unless ``token`` still holds the job's lease; inside a transaction, holds it until the commit."""
    lock = "" if connection.vendor == "sqlite" else " FOR SHARE"
    cursor.execute(f"SELECT lease_token FROM dashboard_job WHERE id = %s{lock}", [job_id])
    row = cursor.fetchone()
    if row is None or int(row[0]) != token:
        raise Fenced(
            f"job {job_id}: fencing token {token} is stale (now {row and row[0]}); not running batch {batch_id}"
        )


def write_results(
    *,
    job_id: int,
    token: int,
    batch_id: int,
    results: Iterable[Result | BadResult],
    rejected: list[Rejected] | None = None,
) -> int:
    """Upsert the results, in chunks, in one transaction; the ones that cannot be stored are appended to ``rejected``
    instead. A key given twice keeps its last value. Returns how many distinct keys each chunk wrote, summed."""
    written = 0
    with transaction.atomic(), connection.cursor() as cursor:
        lease_hold(cursor, job_id=job_id, token=token, batch_id=batch_id)
        results_rewind(job_id, batch_id)
        for chunk in chunked(iter(results), CHUNK):
            latest = _storable(batch_id, chunk, rejected if rejected is not None else [])
            written += len(latest)
            _remember_before(job_id, batch_id, latest)
            if connection.vendor == "postgresql":
                _copy_upsert(cursor, job_id, batch_id, latest)
            else:
                cursor.executemany(
                    f"INSERT INTO dashboard_resultrow (job_id, kind, key, value, batch_id, updated_at) "
                    f"VALUES (%s, %s, %s, %s, %s, CURRENT_TIMESTAMP) {UPSERT}",
                    [(job_id, kind, key, text, batch_id) for (kind, key), text in latest.items()],
                )
    return written


def _remember_before(job_id: int, batch_id: int, latest: dict[tuple[str, str], str]) -> None:
    """Each key's value before this batch first changes it (a key changed by an earlier chunk of the same batch, or by
    the same batch's earlier attempt, has its entry already)."""
    keys = list(latest)
    current = {
        (r.kind, r.key): r
        for r in ResultRow.objects.filter(job_id=job_id, kind__in={k for k, _ in keys}, key__in={k for _, k in keys})
        if (r.kind, r.key) in latest
    }
    ResultUndo.objects.bulk_create(
        ResultUndo(job_id=job_id, batch_id=batch_id, kind=kind, key=key,
                   value=row.value if row is not None else None, prior_batch=row.batch_id if row is not None else None)
        for kind, key in keys
        if (row := current.get((kind, key))) is None or row.batch_id != batch_id
    )  # fmt: skip


def results_rewind(job_id: int, batch_id: int) -> int:
    """Undo what batches from ``batch_id`` on did to the results table, before ``batch_id`` is written (again): the job
    went back (a restore, a rollback, an upgrade's rollback), so a key those batches added goes and a key they changed
    gets its value back, whether or not the replay emits it again. A replay of the same batch undoes and redoes it, to
    the same rows. Returns how many keys went back."""
    undo = ResultUndo.objects.filter(job_id=job_id, batch_id__gte=batch_id)
    if not undo.exists():
        return 0
    oldest: dict[tuple[str, str], ResultUndo] = {}
    for entry in undo.order_by("-batch_id", "-id").iterator(chunk_size=2000):  # the oldest entry of a key wins
        oldest[(entry.kind, entry.key)] = entry
    by_kind: dict[str, list[ResultUndo]] = defaultdict(list)
    for entry in oldest.values():
        by_kind[entry.kind].append(entry)
    for kind, entries in by_kind.items():
        for start in range(0, len(entries), 1000):  # a query per thousand keys, not one per key
            chunk = {e.key: e for e in entries[start : start + 1000]}
            rows = list(ResultRow.objects.filter(job_id=job_id, kind=kind, key__in=list(chunk)))
            added, changed = [], []
            for row in rows:
                before = chunk[row.key]
                if before.prior_batch is None:  # the batches went back over added it
                    added.append(row.id)
                else:
                    row.value, row.batch_id = before.value, before.prior_batch
                    changed.append(row)
            ResultRow.objects.filter(id__in=added).delete()
            ResultRow.objects.bulk_update(changed, ["value", "batch_id"])
    undo.delete()
    return len(oldest)


UPSERT = (
    "ON CONFLICT (job_id, kind, key) DO UPDATE SET value = EXCLUDED.value, batch_id = EXCLUDED.batch_id, "
    "updated_at = EXCLUDED.updated_at"
)


def _copy_upsert(cursor: Any, job_id: int, batch_id: int, latest: dict[tuple[str, str], str]) -> None:
    """COPY the batch into this session's scratch table, then one upsert from it: a round trip per batch, not per
    row. The scratch table is emptied first: inside an outer transaction no commit has emptied it yet."""
    cursor.execute(
        "CREATE TEMP TABLE IF NOT EXISTS sink_batch (kind text, key text, value jsonb) ON COMMIT DELETE ROWS"
    )
    cursor.execute("TRUNCATE sink_batch")
    with cursor.cursor.copy("COPY sink_batch (kind, key, value) FROM STDIN") as copy:
        for (kind, key), text in latest.items():
            copy.write_row((kind, key, text))
    cursor.execute(
        "INSERT INTO dashboard_resultrow (job_id, kind, key, value, batch_id, updated_at) "
        f"SELECT %s, kind, key, value, %s, CURRENT_TIMESTAMP FROM sink_batch {UPSERT}",
        [job_id, batch_id],
    )


@dataclass(frozen=True)
class BadResult:
    """An item a pipeline's ``results`` yielded that ``Pipeline.record`` refused, with the reason."""

    result: Any
    reason: str


def _storable(
    batch_id: int, results: Iterable[Result | BadResult], rejected: list[Rejected]
) -> dict[tuple[str, str], str]:
    """The results that can be stored, one per key (the last: an upsert cannot change a row twice in one statement),
    as JSON text; the others go to ``rejected``."""
    latest: dict[tuple[str, str], str] = {}
    for result in results:
        if isinstance(result, BadResult):
            rejected.append(rejected_output(batch_id, "results", result.result, result.result, result.reason))
            continue
        kind, key, value = result
        text, reason = encoded(key, value)
        if reason:
            rejected.append(rejected_output(batch_id, kind, (kind, key), (kind, key, value), reason))
        else:
            latest[(kind, key)] = text
    return latest


def results_rows(pipeline: Pipeline, rows: Iterator[Row]) -> Iterator[ResultRecord | BadResult]:
    """The pipeline's results for the output rows, handed to it a chunk at a time, each checked (``Pipeline.record``:
    its kind among the views', a text key, a dict value); a refused one says why."""
    for chunk in chunked(rows, CHUNK):
        stored, refused = pipeline.checked_results(chunk)
        yield from stored
        yield from (BadResult(result, reason) for result, reason in refused)


def output_rows(frame: DataFrame, at_once: bool) -> Iterator[Row]:
    """A persisted batch's rows on the driver: at once when it is small, else a partition at a time (never the whole
    of a large batch in the driver's memory)."""
    return iter(frame.collect()) if at_once else frame.toLocalIterator(prefetchPartitions=True)


@contextmanager
def persisted(frame: DataFrame) -> Iterator[DataFrame]:
    """The batch computed once (its stateful operators run, its state files written) and kept while its sinks read it."""
    frame.persist()
    try:
        yield frame
    finally:
        frame.unpersist()


def rehearse(pipeline: Pipeline, frame: DataFrame, files: Path | None = None) -> int:
    """What ``batch_writer`` does with a batch on the driver, short of writing it: persisted, counted, read back and made
    into the pipeline's storable results; returns how many. A standby's warm query consumes its batches so: the JVM's
    code for Spark's cache of a batch (planning it, building its columns, counting and reading it) is then loaded and
    compiled before a takeover's first batch needs it, not during it. With ``files`` (a scratch directory), each of
    the pipeline's file sinks is written there too, as ``write_files`` writes it: a JVM's first Parquet write took
    2.1 s on the busy demo stack, its next ones 0.5 s, and the team job's first batch after a takeover paid it."""
    with persisted(frame):
        at_once = frame.count() <= CHUNK
        stored = len(_storable(-1, results_rows(pipeline, output_rows(frame, at_once)), []))
        if files is not None:
            for sink in (s for s in pipeline.outputs() if isinstance(s, FileSink)):
                target = files / sink.name
                shutil.rmtree(target, ignore_errors=True)  # a batch 0 of its own each time: the whole write, no skip
                write_files(frame, replace(sink, path=str(target)), 0, "rehearsal")
        return stored


def batch_offsets_bytes(checkpoint: str, batch_id: int) -> bytes:
    try:
        return (Path(checkpoint) / "offsets" / str(batch_id)).read_bytes()
    except OSError:
        return b""


def _failure(sink: Any, exc: BaseException) -> str:
    cause = (str(exc).strip() or "no message").splitlines()[0][:500]
    return f"sink {sink.name} ({sink.where()}): {type(exc).__name__}: {cause}"


class SinkSet:
    """Every sink of a job's pipeline, bound to the job's parameters, and how each writes a batch."""

    def __init__(
        self, *, job_id: int, job_name: str, token: int, pipeline: Pipeline, parameters: dict[str, Any]
    ) -> None:
        self.job_id, self.job_name, self.token, self.pipeline = job_id, job_name, token, pipeline
        self.sinks = [s for s in pipeline.outputs(parameters) if not s.off()]
        self.tables = {s.name: TableWriter(s, job_name, token) for s in self.sinks if isinstance(s, TableSink)}
        self.topics = {s.name: KafkaWriter(s, job_name, token) for s in self.sinks if isinstance(s, KafkaSink)}
        # the results table, team tables and Kafka topics read the batch on the driver; files are written by executors
        self.on_driver = any(isinstance(s, (ResultsTable, TableSink, KafkaSink)) for s in self.sinks)
        self.kinds = {view.kind for view in pipeline.views}  # the results' kinds, to be kept to their bounds

    def _noted(self, results: Iterable[Result | BadResult]) -> Iterator[Result | BadResult]:
        for result in results:
            if not isinstance(result, BadResult):
                self.kinds.add(result[0])  # a pipeline without views: each kind it writes
            yield result

    def write(self, frame: DataFrame, batch_id: int, digest: str, rejected: list[Rejected]) -> dict[str, Written]:
        at_once = self.on_driver and frame.count() <= CHUNK  # counted once, on the persisted batch
        done: dict[str, Written] = {}
        for sink in self.sinks:
            if isinstance(sink, ResultsTable):
                written = Written()
                written.rows = write_results(
                    job_id=self.job_id, token=self.token, batch_id=batch_id,
                    results=self._noted(results_rows(self.pipeline, output_rows(frame, at_once))),
                    rejected=written.rejected,
                )  # fmt: skip
            else:
                written = self._own(sink, frame, batch_id, digest, at_once)
            rejected += written.rejected
            done[sink.name] = written
        return done

    def _own(self, sink: Any, frame: DataFrame, batch_id: int, digest: str, at_once: bool) -> Written:
        """One of the job's own sinks; what fails there fails the batch as a SinkError that names the sink."""
        try:
            if isinstance(sink, TableSink):
                columns = list(sink.columns or frame.columns)
                rows = (tuple(r) for r in output_rows(frame.select(*columns), at_once))
                return self.tables[sink.name].write(batch_id, digest, columns, chunked(rows, CHUNK))
            if isinstance(sink, FileSink):
                return write_files(frame, sink, batch_id, digest, self.job_name, self.token)
            return self.topics[sink.name].write(kafka_rows(frame, sink, output_rows(frame, at_once)), batch_id, digest)
        except Fenced:
            raise
        except Exception as exc:
            raise SinkError(_failure(sink, exc)) from exc

    def probe(self) -> list[str]:
        """Each of the job's own tables and file sinks that could not take a write now, named as its batch's failure
        would name it (empty: every one can). Nothing is written (``TableWriter.probe``, ``probe_files``)."""
        problems = []
        for sink in self.sinks:
            try:
                if isinstance(sink, TableSink):
                    self.tables[sink.name].probe()
                elif isinstance(sink, FileSink):
                    probe_files(sink)
            except Exception as exc:
                problems.append(_failure(sink, exc))
        return problems

    def trim(self, floor: int | None) -> None:
        """The results table kept to each view's bound, and the sinks' bookkeeping before ``floor`` removed (see
        ``reachable_floor``; None: nothing is reachable yet, so none is). A failure is logged, and the next trim tries
        again: it never fails a batch."""
        for sink in self.sinks:
            try:
                if isinstance(sink, ResultsTable):
                    trimmed = results_trim(self.job_id, self.pipeline, self.kinds)
                    if floor is not None:
                        trimmed += ResultUndo.objects.filter(job_id=self.job_id, batch_id__lt=floor).delete()[0]
                elif floor is None:
                    continue
                elif isinstance(sink, TableSink):
                    trimmed = trim_commits(self.tables[sink.name], floor)
                elif isinstance(sink, FileSink):
                    trimmed = trim_file_log(FileLog(sink.path), floor)
                else:
                    continue
            except Exception as exc:
                log.warning("job %s: sink %s's bookkeeping was not trimmed: %s", self.job_name, sink.name, exc)
                continue
            if trimmed:
                log.info("job %s: sink %s: bookkeeping before batch %s trimmed (%s)", self.job_name, sink.name, floor,
                         trimmed)  # fmt: skip

    def close(self) -> None:
        for writer in self.tables.values():
            writer.close()
        for topic in self.topics.values():
            topic.close()


def batch_writer(
    *, job_id: int, token: int, pipeline: Pipeline, dead_letters: str = "", redis_url: str = "", job_name: str = "",
    checkpoint: str = "", parameters: dict[str, Any] | None = None, code: str = "", close_connection: bool = False,
    sink_parameters: dict[str, Any] | None = None,
) -> Callable[[DataFrame, int], None]:  # fmt: skip
    """The query's foreachBatch: the batch computed once (its state files written), then into every sink.
    ``close_connection``: the console's database connection is closed after each batch (a shared driver's jobs would
    otherwise each hold one in Spark's callback threads). ``sink_parameters``: the values the sinks' targets are
    filled with, the job's secrets revealed (dashboard/services/secrets.py); the lineage digest keeps ``parameters``,
    which name the secrets, so that no digest is made of a password and a rotation rewinds nothing."""
    client: list[Any] = []
    values = dict(parameters or {})
    # a blue/green upgrade's old version wrote the sinks up to this batch of the checkpoint (checkpoint_dir/files.py)
    written_before = handed_over_after(Path(checkpoint)) if checkpoint else None
    # a migrated line's batch 0 is the sinks' batch ``base`` (checkpoint_dir/files.py: write_lineage)
    base = lineage_base(Path(checkpoint)) if checkpoint else 0
    sinks = SinkSet(
        job_id=job_id, job_name=job_name or str(job_id), token=token, pipeline=pipeline,
        parameters=dict(sink_parameters if sink_parameters is not None else values),
    )  # fmt: skip

    def write(frame: DataFrame, batch_id: int) -> None:
        try:
            write_batch(frame, batch_id)
        finally:
            if close_connection:
                connection.close()

    def write_batch(frame: DataFrame, spark_batch: int) -> None:
        # before the frame is computed: computing it runs the stateful operators, which write the batch's state files
        with connection.cursor() as cursor:
            lease_hold(cursor, job_id=job_id, token=token, batch_id=spark_batch)
        if written_before is not None and spark_batch <= written_before:
            # computed all the same: its stateful operators must run, or Spark has no state files (nor, with
            # checkpoint format 2, their ids) for the batch, and fails it ("CheckpointInfo length: 0")
            frame.write.format("noop").mode("overwrite").save()
            log.info("job %s batch %s: written by the version it took over from; no sink written", job_id, spark_batch)
            return
        batch_id = base + spark_batch
        digest = lineage_digest(batch_offsets_bytes(checkpoint, spark_batch), code, values)
        rejected: list[Rejected] = []
        with persisted(frame):
            written = sinks.write(frame, batch_id, digest, rejected)
        for name, outcome in written.items():
            if outcome.rewound:
                log.warning("job %s batch %s: sink %s rewound (%s rows or files of later batches removed)",
                            job_id, batch_id, name, outcome.rewound)  # fmt: skip
        if rejected and dead_letters:
            if not client:
                client.append(redis.Redis.from_url(redis_url, socket_timeout=10))
            dead_letter(client[0], dead_letters, rejected)  # each once: a replayed batch rejects the same results

        if spark_batch and spark_batch % TRIM_EVERY == 0:
            sinks.trim(reachable_floor(job_id, checkpoint))

    write.sinks = sinks  # type: ignore[attr-defined]
    return write


TRIM_EVERY = 100  # batches between two trims of the sinks' bookkeeping


def reachable_floor(job_id: int, checkpoint: str) -> int | None:
    """The oldest batch a restore or rollback of the job can still go back to: its oldest retained committed batch,
    or the batch of its oldest savepoint that is kept. A sink's bookkeeping of batches before it is never read again
    (a replay starts after a savepoint's or a retained batch's number)."""
    retained = committed_batches(Path(checkpoint)) if checkpoint else []
    kept = Savepoint.objects.filter(job_id=job_id, batch_id__isnull=False).exclude(
        status__in=(SavepointStatus.DISPOSED, SavepointStatus.FAILED)
    )
    # in the sinks' numbers: a savepoint of a migrated line counts from its line's base, as the live checkpoint does
    floors = [
        (lineage_base(Path(p) / "checkpoint") if p else 0) + int(b or 0)
        for b, p in kept.values_list("batch_id", "path")
    ]
    if retained:
        floors.append(lineage_base(Path(checkpoint)) + retained[0])
    return min(floors) if floors else None


def results_trim(job_id: int, pipeline: Pipeline, kinds: Iterable[str]) -> int:
    """Each kind's rows beyond its bound (``dashboard.pipelines.result_bound``) removed: past the count, the rows
    whose last write is oldest; past the age, the rows no batch has written since. Returns how many went."""
    removed = 0
    for kind in sorted(kinds):
        bound = result_bound(pipeline, kind)
        rows = ResultRow.objects.filter(job_id=job_id, kind=kind)
        if bound.hours:
            removed += rows.filter(updated_at__lt=timezone.now() - timedelta(hours=bound.hours)).delete()[0]
        if bound.rows:
            beyond = rows.order_by("-batch_id", "-id").values("id")[bound.rows :]
            removed += ResultRow.objects.filter(id__in=Subquery(beyond)).delete()[0]
    return removed


def trim_commits(writer: TableWriter, floor: int) -> int:
    """Delete a table sink's commit rows, and the rows kept for a rewind, of the batches before ``floor`` (no rewind
    goes back that far)."""
    writer.connect()
    deleted = 0
    with closing(writer.connection.cursor()) as cursor:
        for table in (COMMITS, UNDO) if writer.undoes else (COMMITS,):
            cursor.execute(
                writer.sql(f"DELETE FROM {table} WHERE job = %s AND sink = %s AND batch_id < %s"),
                (writer.job, writer.sink.name, floor),
            )
            deleted += max(0, cursor.rowcount)
    writer.connection.commit()
    return deleted


def trim_file_log(log: FileLog, floor: int) -> int:
    """Delete a file sink's log entries and batch records that no reader or rewind needs: Spark's reader and a rewind to
    ``floor`` or later start at the compaction at or before ``floor - 1``; everything before that compaction goes."""
    start = max(0, floor // COMPACT_INTERVAL * COMPACT_INTERVAL - 1)  # the compaction a rewind to ``floor`` reads from
    removed = 0
    for batch in [b for b in log.batches() if b < start]:
        for name in (str(batch), f"{batch}.compact", f".{batch}.crc", f".{batch}.compact.crc"):
            path = log.log / name
            if path.exists():
                path.unlink()
                removed += 1
        record = log.own / "batches" / f"{batch}.json"
        if record.exists():
            record.unlink()
    return removed
