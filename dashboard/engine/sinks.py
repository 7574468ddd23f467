"""The engine of a pipeline's sinks: each batch into each sink exactly once per lineage (moved from the SDK, which
keeps the declarations: ``statekeeper_sdk.sinks``).

Each micro-batch's output is handed to every sink with the batch id, the driver's fencing token and the batch's
*lineage digest* (a hash of the checkpoint's offsets file for that batch, the code and the parameters). A sink that
already holds the batch with the same digest skips it: that is a replay after a crash. A sink that holds this batch or
a later one under another digest is *rewound* first: the job was restored, rolled back or upgraded to an earlier
batch, and the output of the batches after that point no longer matches the state, so it is removed before the batch
is written again.

- ``TableWriter``: the rows and a row of the commit table ``statekeeper_sink_commits`` go in one transaction, after a
  fence check in ``statekeeper_sink_fences`` that refuses a stale token. A rewind deletes by the batch column. A keyed
  (upsert) table on PostgreSQL also keeps, in the same transaction, each row as it was before a batch changed it
  (``statekeeper_sink_undo``), and a rewind puts those rows back: a key the rewound batches updated returns to its
  value before them even when the new line never writes that key again (a state migration's new keys, an upgrade
  that drops a kind of row), where deleting it alone would lose it.
- ``FileLog`` and ``write_files``: the data files and a ``_spark_metadata`` log that Spark's readers trust, so a file
  a failed attempt left behind is never read. A rewind drops the log's entries after the fork point and moves those
  batches' files to ``_statekeeper/rewound/``.
- ``KafkaWriter``: each batch one Kafka transaction with a marker of the batch (an offset commit of the sink's own
  group), so a ``read_committed`` consumer sees it whole and once; a replay finds its marker and is skipped.

No Django here: the drivers (``workers/``) and the pages (``dashboard/``) both use it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

from statekeeper_sdk import FileSink, KafkaSink, Rejected, TableSink

from dashboard.kafka import Cluster, client_config, ensure_topic, spark_options

COMMITS = "statekeeper_sink_commits"
FENCES = "statekeeper_sink_fences"
UNDO = "statekeeper_sink_undo"


class Fenced(RuntimeError):
    """A newer driver of the job has written to this sink: this one's token is stale."""


class SinkError(RuntimeError):
    """A sink could not write a batch (its database refused, its directory could not be written): the batch fails,
    and the message names the sink first, then the error under it."""


def lineage_digest(offsets: bytes, code: str, parameters: Mapping[str, Any]) -> str:
    """What a batch is: its offsets file in the checkpoint (written once, kept on a replay, new after a fork), the code
    that runs it and its parameters."""
    h = hashlib.sha256(offsets)
    h.update(b"\0" + code.encode() + b"\0" + json.dumps(dict(parameters), sort_keys=True, default=str).encode())
    return h.hexdigest()[:32]


@dataclass
class Written:
    """What a sink did with one batch."""

    rows: int = 0
    skipped: bool = False  # already held: a replay
    rewound: int = 0  # rows or files of later batches removed first (a fork)
    rejected: list[Rejected] = field(default_factory=list)


@dataclass(frozen=True)
class Position:
    """Where a sink stands: its last batch and the rows of its recent batches (newest first)."""

    last_batch: int | None
    recent: tuple[tuple[int, int], ...] = ()  # (batch, rows)
    error: str = ""


def rejected_output(batch_id: int, sink: str, identity: Any, shown: Any, reason: str) -> Rejected:
    """An output row a sink cannot store, as a dead letter: its entry names the batch, the sink and a digest of
    ``identity``, so that a replay of the batch dead-letters it once."""
    digest = hashlib.sha1(repr(identity).encode("utf-8", "backslashreplace")).hexdigest()[:16]
    payload = repr(shown)[:65536].encode("utf-8", "backslashreplace")
    return Rejected(f"batch-{batch_id}:{sink}:{digest}", "sink", reason, payload)


def plain(value: Any) -> Any:
    """A value a DB-API driver can bind: nested rows, lists and maps as JSON text."""
    if isinstance(value, (str, int, float, bool, Decimal, datetime)) or value is None:
        return value
    return json.dumps(_jsonable(value), ensure_ascii=False, default=str)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "asDict"):
        return {k: _jsonable(v) for k, v in value.asDict().items()}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


# ---------------------------------------------------------------------------------------------------------------------
# A table of the team's database


class TableWriter:
    """Writes batches into a ``TableSink`` through its DB-API driver, exactly once per lineage."""

    def __init__(self, sink: TableSink, job: str, token: int) -> None:
        self.sink, self.job, self.token = sink, job, token
        self.db = importlib.import_module(sink.driver)
        self.connection: Any = None
        self.created = False  # the commit tables (and the sink's DDL) made on this connection
        self.marker = "?" if getattr(self.db, "paramstyle", "format") == "qmark" else "%s"
        # rows as they were before each batch, for a rewind: a keyed table on PostgreSQL (its JSON functions)
        self.undoes = bool(sink.key) and sink.driver.startswith("psycopg")

    def sql(self, text: str) -> str:
        return text.replace("%s", self.marker)

    def connect(self, create: bool = True) -> Any:
        """The connection, opened once; ``create``: the commit tables (and the sink's own DDL) made first."""
        if self.connection is None:
            extra = {"connect_timeout": 5} if self.sink.driver.startswith("psycopg") else {}
            self.connection = self.db.connect(self.sink.dsn, **extra)
        if create and not self.created:
            with self._cursor() as cursor:
                for statement in _commit_tables(self.sink.create, self.undoes):
                    cursor.execute(statement)
            self.connection.commit()
            self.created = True
        return self.connection

    def close(self) -> None:
        if self.connection is not None:
            try:
                self.connection.close()
            finally:
                self.connection, self.created = None, False

    def probe(self) -> None:
        """What a batch's write takes of the database, tried in a transaction that is rolled back: the connection,
        the commit tables and the sink's own DDL (made, as a first write makes them), and the rights of each kind of
        statement a write runs, on statements that touch no row. A new target's grants are so known before a
        blue/green upgrade hands the job's output to it. Raises what the database raised."""
        table, column = quoted(self.sink.table), quoted(self.sink.batch_column)
        try:
            self.connect()
            with self._cursor() as cursor:
                for statement in (
                    f"UPDATE {FENCES} SET token = token WHERE 1 = 0",
                    f"INSERT INTO {FENCES} SELECT * FROM {FENCES} WHERE 1 = 0",
                    f"DELETE FROM {COMMITS} WHERE 1 = 0",
                    f"INSERT INTO {COMMITS} SELECT * FROM {COMMITS} WHERE 1 = 0",
                    *(
                        [f"DELETE FROM {UNDO} WHERE 1 = 0", f"INSERT INTO {UNDO} SELECT * FROM {UNDO} WHERE 1 = 0"]
                        if self.undoes
                        else []
                    ),
                    f"DELETE FROM {table} WHERE 1 = 0",
                    f"UPDATE {table} SET {column} = {column} WHERE 1 = 0",
                    f"INSERT INTO {table} SELECT * FROM {table} WHERE 1 = 0",
                ):
                    cursor.execute(statement)
        finally:
            self._abandon()

    def _cursor(self) -> Any:
        cursor = self.connection.cursor()
        return cursor if hasattr(cursor, "__enter__") else _Closing(cursor)

    def write(self, batch_id: int, digest: str, columns: list[str], chunks: Iterable[list[tuple]]) -> Written:
        """One batch in one transaction: fence, skip or rewind, the rows in chunks, the commit row. A connection that
        died since the last batch (the database restarted) is replaced once, before any row is read."""
        source, begun = iter(chunks), [False]

        def rows() -> Iterator[list[tuple]]:
            begun[0] = True
            yield from source

        try:
            return self._write_once(batch_id, digest, columns, rows())
        except (self.db.OperationalError, self.db.InterfaceError):
            if begun[0]:
                raise
        return self._write_once(batch_id, digest, columns, rows())

    def _write_once(self, batch_id: int, digest: str, columns: list[str], chunks: Iterable[list[tuple]]) -> Written:
        try:
            self.connect()
            with self._cursor() as cursor:
                written = self._begin(cursor, batch_id, digest)
                if written.skipped:
                    self.connection.commit()
                    return written
                self._rows(cursor, batch_id, columns, chunks, written)
                cursor.execute(
                    self.sql(
                        f"INSERT INTO {COMMITS} (job, sink, batch_id, digest, token, rows, committed_at) "
                        "VALUES (%s, %s, %s, %s, %s, %s, %s)"
                    ),
                    (self.job, self.sink.name, batch_id, digest, self.token, written.rows, _now()),
                )
            self.connection.commit()
            return written
        except BaseException:
            self._abandon()
            raise

    def _abandon(self) -> None:
        """Roll the transaction back; a connection that cannot be is dropped (the next batch opens another)."""
        try:
            if self.connection is not None:
                self.connection.rollback()
        except Exception:
            self.close()

    def _begin(self, cursor: Any, batch_id: int, digest: str) -> Written:
        """The fence checked and taken; then the batch skipped (a replay) or begun, after a rewind when the sink holds
        this batch under another digest or a later one."""
        sink, job = self.sink.name, self.job
        cursor.execute(
            self.sql(f"UPDATE {FENCES} SET token = %s WHERE job = %s AND sink = %s AND token <= %s"),
            (self.token, job, sink, self.token),
        )
        if cursor.rowcount == 0:
            cursor.execute(self.sql(f"SELECT token FROM {FENCES} WHERE job = %s AND sink = %s"), (job, sink))
            row = cursor.fetchone()
            if row is not None:
                raise Fenced(
                    f"sink {sink}: token {self.token} is stale ({row[0]} has written since); not writing batch "
                    f"{batch_id}"
                )
            cursor.execute(
                self.sql(f"INSERT INTO {FENCES} (job, sink, token) VALUES (%s, %s, %s)"), (job, sink, self.token)
            )
        cursor.execute(
            self.sql(f"SELECT batch_id, digest FROM {COMMITS} WHERE job = %s AND sink = %s AND batch_id >= %s"),
            (job, sink, batch_id),
        )
        later = dict(cursor.fetchall())
        if later.get(batch_id) == digest and len(later) == 1:
            return Written(skipped=True)
        begun = Written()
        if later:
            table, column = quoted(self.sink.table), quoted(self.sink.batch_column)
            cursor.execute(self.sql(f"DELETE FROM {table} WHERE {column} >= %s"), (batch_id,))
            begun.rewound = max(0, cursor.rowcount)
            if self.undoes:  # each key the rewound batches changed, as it was before the first of them
                keys = ", ".join(f"(previous::json->>'{k}')" for k in self.sink.key)
                cursor.execute(
                    f"INSERT INTO {table} SELECT (json_populate_record(NULL::{table}, kept.previous::json)).* FROM "
                    f"(SELECT DISTINCT ON ({keys}) previous FROM {UNDO} WHERE job = %s AND sink = %s AND "
                    f"batch_id >= %s ORDER BY {keys}, batch_id) kept",
                    (job, sink, batch_id),
                )
                cursor.execute(f"DELETE FROM {UNDO} WHERE job = %s AND sink = %s AND batch_id >= %s",
                               (job, sink, batch_id))  # fmt: skip
            cursor.execute(
                self.sql(f"DELETE FROM {COMMITS} WHERE job = %s AND sink = %s AND batch_id >= %s"),
                (job, sink, batch_id),
            )
        return begun

    def _rows(
        self, cursor: Any, batch_id: int, columns: list[str], chunks: Iterable[list[tuple]], written: Written
    ) -> None:
        names = [*columns, self.sink.batch_column]
        statement = self.sql(self._insert(names))
        copy = _copier(cursor, self.sink, names, self._undo(cursor, batch_id)) if hasattr(cursor, "copy") else None
        for chunk in chunks:
            rows = [(*(plain(v) for v in row), batch_id) for row in chunk]
            if not rows:
                continue
            cursor.execute("SAVEPOINT statekeeper_chunk")
            try:
                if copy is not None:
                    copy(rows)
                else:
                    cursor.executemany(statement, rows)
                written.rows += len(rows)
            except (self.db.DataError, self.db.IntegrityError, self.db.ProgrammingError) as exc:
                if isinstance(exc, self.db.ProgrammingError) and "column" in str(exc).lower():
                    raise  # a table that does not match the sink's columns: the job's mistake, not a row's
                cursor.execute("ROLLBACK TO SAVEPOINT statekeeper_chunk")
                self._one_by_one(cursor, statement, columns, rows, batch_id, written)
            cursor.execute("RELEASE SAVEPOINT statekeeper_chunk")

    def _undo(self, cursor: Any, batch_id: int) -> Callable[..., None] | None:
        """What keeps the rows a batch is about to change as they were (``UNDO``), before the batch changes them:
        called with the rows to write as a table (the chunk's scratch table), or one row's key as a SELECT of
        ``params``. A row the batch already changed (a chunk's second row of a key) is not kept again."""
        if not self.undoes:
            return None
        table, column = quoted(self.sink.table), quoted(self.sink.batch_column)
        joined = " AND ".join(f"t.{quoted(k)} = s.{quoted(k)}" for k in self.sink.key)

        def keep(source: str, params: tuple[Any, ...] = ()) -> None:
            cursor.execute(
                f"INSERT INTO {UNDO} (job, sink, batch_id, previous) SELECT %s, %s, %s, row_to_json(t)::text "
                f"FROM {table} t JOIN {source} s ON {joined} WHERE t.{column} < %s",
                (self.job, self.sink.name, batch_id, *params, batch_id),
            )

        return keep

    def _one_by_one(
        self, cursor: Any, statement: str, columns: list[str], rows: list[tuple], batch_id: int, written: Written
    ) -> None:
        """The chunk row by row, each in a savepoint: a row the table refuses goes to ``rejected``."""
        keep = self._undo(cursor, batch_id)
        names = [*columns, self.sink.batch_column]
        picked = "(SELECT " + ", ".join(f"%s AS {quoted(k)}" for k in self.sink.key) + ")"
        for row in rows:
            cursor.execute("SAVEPOINT statekeeper_row")
            try:
                if keep is not None:
                    values = dict(zip(names, row, strict=True))
                    keep(picked, tuple(values[k] for k in self.sink.key))
                cursor.execute(statement, row)
                written.rows += 1
            except (self.db.DataError, self.db.IntegrityError) as exc:
                cursor.execute("ROLLBACK TO SAVEPOINT statekeeper_row")
                reason = f"{self.sink.name}: {str(exc).strip().splitlines()[0][:300]}"
                written.rejected.append(rejected_output(batch_id, self.sink.name, row, row, reason))
            cursor.execute("RELEASE SAVEPOINT statekeeper_row")

    def _insert(self, names: list[str]) -> str:
        marks = ", ".join(["%s"] * len(names))
        return f"INSERT INTO {quoted(self.sink.table)} ({_listed(names)}) VALUES ({marks}){_upsert(self.sink, names)}"

    def position(self, recent: int = 10) -> Position:
        """The sink's last batch and its recent batches' rows, from the commit table."""
        try:
            self.connect(create=False)
            with self._cursor() as cursor:
                cursor.execute(
                    self.sql(
                        f"SELECT batch_id, rows FROM {COMMITS} WHERE job = %s AND sink = %s "
                        f"ORDER BY batch_id DESC LIMIT {int(recent)}"
                    ),
                    (self.job, self.sink.name),
                )
                rows = [(int(b), int(n)) for b, n in cursor.fetchall()]
            self.connection.rollback()
        except Exception as exc:
            self.close()
            text = (str(exc).strip() or type(exc).__name__).splitlines()[0][:300]
            if COMMITS in text and ("does not exist" in text or "no such table" in text):
                return Position(None)  # nothing written yet
            return Position(None, (), text)
        return Position(rows[0][0] if rows else None, tuple(rows))


def quoted(name: str) -> str:
    """An SQL name as a quoted identifier (``end``, ``start`` and their like are reserved words)."""
    return ".".join(f'"{part}"' for part in name.split("."))


def _listed(names: Iterable[str]) -> str:
    return ", ".join(quoted(n) for n in names)


def _upsert(sink: TableSink, names: list[str]) -> str:
    if not sink.key:
        return ""
    updates = ", ".join(f"{quoted(n)} = EXCLUDED.{quoted(n)}" for n in names if n not in sink.key)
    return f" ON CONFLICT ({_listed(sink.key)}) DO UPDATE SET {updates}"


def _copier(cursor: Any, sink: TableSink, names: list[str], keep: Callable[..., None] | None) -> Any:
    """psycopg: COPY each chunk into a scratch table shaped like the target, then one INSERT … SELECT from it (the
    rows it replaces kept first by ``keep``, for a rewind)."""
    scratch = "statekeeper_scratch_" + hashlib.sha1(repr((sink.table, names)).encode()).hexdigest()[:8]
    listed, table = _listed(names), quoted(sink.table)
    cursor.execute(
        f"CREATE TEMP TABLE IF NOT EXISTS {scratch} ON COMMIT DELETE ROWS AS SELECT {listed} FROM {table} WITH NO DATA"
    )

    def copy(rows: list[tuple]) -> None:
        cursor.execute(f"TRUNCATE {scratch}")
        with cursor.copy(f"COPY {scratch} ({listed}) FROM STDIN") as stream:
            for row in rows:
                stream.write_row(row)
        if keep is not None:
            keep(scratch)
        cursor.execute(f"INSERT INTO {table} ({listed}) SELECT {listed} FROM {scratch}{_upsert(sink, names)}")

    return copy


def _commit_tables(create: str, undo: bool) -> list[str]:
    return [
        f"CREATE TABLE IF NOT EXISTS {COMMITS} (job varchar(200) NOT NULL, sink varchar(100) NOT NULL, "
        "batch_id bigint NOT NULL, digest varchar(64) NOT NULL, token bigint NOT NULL, rows bigint NOT NULL, "
        "committed_at varchar(40) NOT NULL, PRIMARY KEY (job, sink, batch_id))",
        f"CREATE TABLE IF NOT EXISTS {FENCES} (job varchar(200) NOT NULL, sink varchar(100) NOT NULL, "
        "token bigint NOT NULL, PRIMARY KEY (job, sink))",
        # its primary key serves the lookups by batch (CREATE INDEX would need the table's owner: the job's role may
        # not be, and a table made once with its key needs none)
        *(
            [
                f"CREATE TABLE IF NOT EXISTS {UNDO} (job varchar(200) NOT NULL, sink varchar(100) NOT NULL, "
                "batch_id bigint NOT NULL, id bigserial, previous text NOT NULL, PRIMARY KEY (job, sink, batch_id, id))"
            ]
            if undo
            else []
        ),
        *[s for s in (part.strip() for part in create.split(";")) if s],
    ]


class _Closing:
    def __init__(self, cursor: Any) -> None:
        self.cursor = cursor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cursor, name)

    def __enter__(self) -> Any:
        return self.cursor

    def __exit__(self, *exc: Any) -> None:
        self.cursor.close()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


# ---------------------------------------------------------------------------------------------------------------------
# Files in Spark's file-sink layout

COMPACT_INTERVAL = 10  # Spark's default (spark.sql.streaming.fileSink.log.compactInterval): its readers expect it
BLOCK_SIZE = 33554432


class FileLog:
    """The ``_spark_metadata`` log of a sink directory, written as Spark's file sink writes it (a ``v1`` line, then one
    JSON line per file; every tenth batch a ``.compact`` file listing everything so far), and the sink's own records
    under ``_statekeeper/`` (each batch's digest and rows; the files an attempt was placing)."""

    def __init__(self, path: str | Path) -> None:
        self.root = Path(path)
        self.log = self.root / "_spark_metadata"
        self.own = self.root / "_statekeeper"

    # -- reading
    def batches(self) -> list[int]:
        if not self.log.is_dir():
            return []
        found = {int(m.group(1)) for p in self.log.iterdir() if (m := re.fullmatch(r"(\d+)(\.compact)?", p.name))}
        return sorted(found)

    def latest(self) -> int | None:
        batches = self.batches()
        return batches[-1] if batches else None

    def entry(self, batch: int) -> list[dict[str, Any]] | None:
        for name in (f"{batch}.compact", str(batch)):
            path = self.log / name
            if path.is_file():
                return [json.loads(line) for line in path.read_text().splitlines()[1:] if line.strip()]
        return None

    def all_files(self) -> list[dict[str, Any]]:
        """Every file the log lists, as Spark's reader finds them: the newest compaction and the batches after it."""
        latest = self.latest()
        if latest is None:
            return []
        start = max(0, (latest + 1) // COMPACT_INTERVAL * COMPACT_INTERVAL - 1)
        files: list[dict[str, Any]] = []
        for batch in range(start, latest + 1):
            entry = self.entry(batch)
            if entry is None:
                raise FileNotFoundError(f"{self.log}: batch {batch} is missing from the log (latest {latest})")
            files += entry
        return files

    def record(self, batch: int) -> dict[str, Any] | None:
        path = self.own / "batches" / f"{batch}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def position(self, recent: int = 10) -> Position:
        latest = self.latest()
        rows: list[tuple[int, int]] = []
        for batch in range(latest if latest is not None else -1, -1, -1):
            if len(rows) >= recent:
                break
            if (record := self.record(batch)) is not None:
                rows.append((batch, int(record.get("rows", 0))))
        return Position(latest, tuple(rows))

    # -- writing
    @contextmanager
    def fenced(self, job: str, token: int | None) -> Iterator[None]:
        """Hold the directory's lock while a batch is written, after a fence check: a driver whose token is older than
        one that has written here for the job refuses (Fenced), as a table sink's fence does. Two drivers of one job
        (a fenced one finishing its batch, and the new version that took over from it) so write one after the other,
        never interleaved. ``token`` None: no fence (a driver of a test, or a tool)."""
        self.own.mkdir(parents=True, exist_ok=True)
        with open(self.own / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if token is not None:
                    fence = self.own / "fences" / (re.sub(r"[^A-Za-z0-9_.-]", "_", job) or "job")
                    try:
                        held = int(fence.read_text() or 0)
                    except (OSError, ValueError):
                        held = 0
                    if held > token:
                        raise Fenced(f"files at {self.root}: token {token} is stale ({held} has written since)")
                    if token > held:
                        self._write(fence, str(token))
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def commit(self, batch: int, files: list[Path], digest: str, rows: int) -> None:
        """The batch's record, then its log entry (the commit point for readers)."""
        self._write(self.own / "batches" / f"{batch}.json", json.dumps({"digest": digest, "rows": rows, "at": _now(),
                    "files": [p.name for p in files]}))  # fmt: skip
        self._log_entry(batch, [_status(p) for p in files])

    def _log_entry(self, batch: int, statuses: list[dict[str, Any]]) -> None:
        """The batch's entry, after empty ones for the batches before it that Spark's reader needs and the log lacks:
        a sink that starts after batch 0 (added by an upgrade, or given a new directory) logs them as Spark's own sink
        logs a batch with no file."""
        latest = self.latest()
        needed = max(0, (batch + 1) // COMPACT_INTERVAL * COMPACT_INTERVAL - 1)  # the reader's first batch
        for missing in range(max(needed, 0 if latest is None else latest + 1), batch):
            self._batch_entry(missing, [])
        self._batch_entry(batch, statuses)

    def _batch_entry(self, batch: int, statuses: list[dict[str, Any]]) -> None:
        if (batch + 1) % COMPACT_INTERVAL == 0:  # a compaction: everything the log lists so far, and this batch
            name, statuses = f"{batch}.compact", self.all_files() + statuses
        else:
            name = str(batch)
        self._write(self.log / name, "\n".join(["v1", *(json.dumps(s, separators=(",", ":")) for s in statuses)]))

    @staticmethod
    def _write(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        scratch.write_text(text)
        os.replace(scratch, path)

    def rewind(self, batch: int) -> int:
        """Forget the batches from ``batch`` on: their log entries go, their files move to ``_statekeeper/rewound``.
        Returns how many data files moved."""
        latest = self.latest()
        if latest is None or latest < batch:
            return 0
        before = [f["path"] for f in self.all_files()]
        for b in range(latest, batch - 1, -1):  # newest first: a crash midway leaves a whole, shorter log
            for name in (str(b), f"{b}.compact", f".{b}.crc", f".{b}.compact.crc"):
                (self.log / name).unlink(missing_ok=True)
            (self.own / "batches" / f"{b}.json").unlink(missing_ok=True)
        after = {f["path"] for f in self.all_files()}
        aside = self.own / "rewound" / f"from-{batch}-{int(time.time())}"
        moved = 0
        for uri in before:
            path = _path(uri)
            if uri not in after and path.is_file() and self.root in path.parents:
                aside.mkdir(parents=True, exist_ok=True)
                shutil.move(path, aside / path.name)
                moved += 1
        return moved

    def pending(self, batch: int, names: list[str]) -> None:
        self._write(self.own / "pending" / f"{batch}.json", json.dumps(names))

    def clear_pending(self) -> int:
        """Move aside the files an attempt placed and did not commit (it died between placing and the log)."""
        folder = self.own / "pending"
        moved = 0
        for marker in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            listed = {_path(f["path"]).name for f in self.all_files()}
            for name in json.loads(marker.read_text() or "[]"):
                path = self.root / name
                if path.is_file() and name not in listed:
                    aside = self.own / "orphans"
                    aside.mkdir(parents=True, exist_ok=True)
                    shutil.move(path, aside / name)
                    moved += 1
            marker.unlink()
        return moved


def _status(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {
        "path": path.resolve().as_uri(), "size": stat.st_size, "isDir": False,
        "modificationTime": int(stat.st_mtime * 1000), "blockReplication": 1, "blockSize": BLOCK_SIZE, "action": "add",
    }  # fmt: skip


def _path(uri: str) -> Path:
    from urllib.parse import unquote, urlparse

    return Path(unquote(urlparse(uri).path))


def probe_files(sink: FileSink) -> None:
    """A file sink's directory made (as a first write makes it) and written to, with a file that is removed at once:
    its rights known before a blue/green upgrade hands the job's output to it."""
    directory = _path(sink.path)
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".statekeeper-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    probe.write_bytes(b"")
    probe.unlink()


def write_files(
    frame: Any, sink: FileSink, batch_id: int, digest: str, job: str = "", token: int | None = None
) -> Written:
    """One batch of ``frame`` (a DataFrame) into the sink's directory, exactly once per lineage, fenced by the job's
    ``token`` (``FileLog.fenced``)."""
    log = FileLog(sink.path)
    log.root.mkdir(parents=True, exist_ok=True)
    with log.fenced(job, token):
        return _write_files(frame, sink, batch_id, digest, log)


def _write_files(frame: Any, sink: FileSink, batch_id: int, digest: str, log: FileLog) -> Written:
    from pyspark.sql import functions as F

    log.clear_pending()
    latest = log.latest()
    written = Written()
    if latest is not None and latest >= batch_id:
        record = log.record(batch_id)
        if latest == batch_id and record is not None and record.get("digest") == digest:
            written.skipped = True
            return written
        written.rewound = log.rewind(batch_id)
    columns = [F.col(c) for c in (sink.columns or frame.columns)]
    output = frame.select(*columns, F.lit(batch_id).cast("long").alias(sink.batch_column))
    staging = log.own / "staging" / f"{batch_id}-{uuid.uuid4().hex[:8]}"
    output.coalesce(sink.files_per_batch).write.format(sink.format).save(str(staging))
    parts = sorted(p for p in staging.iterdir() if p.name.startswith("part-") and not p.name.startswith("."))
    suffix = ".snappy.parquet" if sink.format == "parquet" else ".json"
    tag = uuid.uuid4().hex[:8]
    placed = [log.root / f"part-b{batch_id:09d}-{tag}-{i:05d}{suffix}" for i in range(len(parts))]
    log.pending(batch_id, [p.name for p in placed])
    for source, target in zip(parts, placed, strict=True):
        os.replace(source, target)
    shutil.rmtree(staging, ignore_errors=True)
    # a batch's rows: counted on the files just written, not on the frame (that would compute the batch again)
    written.rows = _rows_in(placed, sink.format)
    log.commit(batch_id, placed, digest, written.rows)
    (log.own / "pending" / f"{batch_id}.json").unlink(missing_ok=True)
    return written


def _rows_in(files: list[Path], fmt: str) -> int:
    if fmt == "json":
        return sum(sum(1 for line in p.open("rb") if line.strip()) for p in files)
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in files)


MARKERS = "statekeeper-sink-commits"  # the topic whose offsets, per job and sink, say the newest batch a sink holds


class KafkaWriter:
    """A Kafka sink, each batch one Kafka transaction, so a consumer reading ``read_committed`` sees a batch whole and
    once. The transaction carries, besides the records, an offset commit of the sink's own consumer group on the
    marker topic: offset = the batch + 1, metadata = the batch's lineage digest and the driver's fencing token. Both
    become visible together or not at all, so the marker says exactly which batch the topic holds.

    - A replay (a restarted driver runs its last batch again, same digest) finds its batch under the marker: skipped.
    - A fork (restore, rollback, an upgrade's rollback: the batch number again under another digest, or a lower one)
      is written again, its records carrying the new lineage in their headers: Kafka keeps what was committed, so a
      consumer that keeps the newest value per key (the records are keyed upserts) holds the state's figures, and one
      that keeps history drops the records of a batch number it sees again under another lineage.
    - Fencing: the producer's transactional id is the job's and the sink's, so a new driver's ``init_transactions``
      aborts whatever a dead one left open and fences it for good; a token older than the marker's is refused too
      (``Fenced``), as the table sinks refuse it.

    Every record carries ``statekeeper-job``, ``statekeeper-batch`` and ``statekeeper-lineage`` headers."""

    def __init__(self, sink: KafkaSink, job: str, token: int, timeout: float = 30.0) -> None:
        self.sink, self.job, self.token, self.timeout = sink, job, token, timeout
        self.group = f"statekeeper-sink.{job}.{sink.name}"
        self.producer: Any = None
        self.consumer: Any = None

    def _open(self) -> None:
        from confluent_kafka import Consumer, Producer

        cluster = Cluster(self.sink.servers, self.sink.security)  # its TLS and SASL, the password revealed
        base: dict[str, Any] = {"bootstrap.servers": self.sink.servers, "socket.timeout.ms": int(self.timeout * 1000),
                                **client_config(cluster.security)}  # fmt: skip
        ensure_topic(cluster, MARKERS, 1, self.timeout)  # every job's Kafka sinks share it
        self.consumer = Consumer(
            {**base, "group.id": self.group, "isolation.level": "read_committed", "enable.auto.commit": False}
        )
        self.producer = Producer(
            {**base, "transactional.id": self.group, "transaction.timeout.ms": 60_000, "linger.ms": 5}
        )
        self.producer.init_transactions(self.timeout)  # fences every earlier producer of this sink

    def held(self) -> tuple[int | None, str, int]:
        """The newest batch the topic holds for this sink, its digest and the token that wrote it."""
        from confluent_kafka import TopicPartition

        if self.consumer is None:
            self._open()
        marker = self.consumer.committed([TopicPartition(MARKERS, 0)], timeout=self.timeout)[0]
        if marker.offset < 0:
            return None, "", 0
        meta = json.loads(marker.metadata or "{}")
        return marker.offset - 1, str(meta.get("digest", "")), int(meta.get("token", 0))

    def write(self, rows: Iterable[tuple[Any, str]], batch_id: int, digest: str) -> Written:
        """``rows``: (key, JSON value) of every output record of the batch."""
        from confluent_kafka import KafkaException, TopicPartition

        batch, held_digest, held_token = self.held()
        if held_token > self.token:
            raise Fenced(f"sink {self.sink.name}: token {self.token} is stale ({held_token} has written since)")
        if batch == batch_id and held_digest == digest:
            return Written(skipped=True)
        written = Written(rewound=int(batch is not None and batch >= batch_id))
        headers = [("statekeeper-job", self.job.encode()), ("statekeeper-batch", str(batch_id).encode()),
                   ("statekeeper-lineage", digest.encode())]  # fmt: skip
        self.producer.begin_transaction()
        try:
            for key, value in rows:
                while True:
                    try:
                        self.producer.produce(
                            self.sink.topic, value=value.encode(), key=None if key is None else str(key).encode(),
                            headers=headers,
                        )  # fmt: skip
                        break
                    except BufferError:
                        self.producer.poll(0.5)
                written.rows += 1
            meta = json.dumps({"digest": digest, "token": self.token})
            self.producer.send_offsets_to_transaction(
                [TopicPartition(MARKERS, 0, batch_id + 1, metadata=meta)],
                self.consumer.consumer_group_metadata(), self.timeout,
            )  # fmt: skip
            self.producer.commit_transaction(self.timeout)
        except KafkaException as exc:
            error = exc.args[0]
            if error.fatal() or "FENCED" in error.name():
                self.close()
                raise Fenced(f"sink {self.sink.name}: a newer driver's producer took over ({error.str()})") from None
            if error.txn_requires_abort():
                self.producer.abort_transaction(self.timeout)
            raise
        except BaseException:
            self.producer.abort_transaction(self.timeout)
            raise
        return written

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
        self.producer = self.consumer = None


def write_kafka(frame: Any, sink: KafkaSink, job: str, batch_id: int) -> Written:
    """One batch into the topic by Spark's own Kafka writer, at least once, each record with the job's name and the
    batch id in its headers. The console writes with ``KafkaWriter``; this stays for ``statekeeper_sdk.sinks``'s
    deprecated name until its 2.0."""
    from pyspark.sql import functions as F

    columns = list(sink.columns or frame.columns)
    headers = F.array(
        F.struct(F.lit("statekeeper-job").alias("key"), F.lit(job).cast("binary").alias("value")),
        F.struct(F.lit("statekeeper-batch").alias("key"), F.lit(str(batch_id)).cast("binary").alias("value")),
    )
    key = F.col(sink.key).cast("string") if sink.key else F.lit(None).cast("string")
    output = frame.select(key.alias("key"), F.to_json(F.struct(*columns)).alias("value"), headers.alias("headers"))
    output.write.format("kafka").option("kafka.bootstrap.servers", sink.servers).option("topic", sink.topic).option(
        "includeHeaders", "true"
    ).options(**spark_options(sink.security)).save()
    return Written(rows=-1)


def kafka_rows(frame: Any, sink: KafkaSink, rows: Iterable[Any]) -> Iterator[tuple[Any, str]]:
    """(key, value as JSON) of each output row, its columns those the sink names (every one by default)."""
    columns = list(sink.columns or frame.columns)
    for row in rows:
        values = row.asDict()
        yield (
            (values.get(sink.key) if sink.key else None),
            json.dumps({c: values[c] for c in columns}, default=str, separators=(",", ":")),
        )


def chunked(rows: Iterator[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for row in rows:
        chunk.append(row)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
