"""A PySpark streaming data source over one Redis stream.

Offsets are ``{"id": <stream entry id>, "n": <entries added up to that id>}``. The entry id makes a restart replay
exactly what was not committed; ``n`` (Redis' ``entries-added`` counter) turns the gap between two offsets into a
record count, so every progress event carries the backlog in records.

The reader checks payloads with the SDK's ``parse_entries`` (``statekeeper_sdk._runtime.events``). No input can
stop the job: an entry that fails anywhere on its way (decoding, parsing, a bound) goes to a dead-letter stream with
its entry id, the stage and the reason, once, however often its batch is replayed, and the batch goes on without it.
Every check is a function of the entry alone (a timestamp is judged against the entry's own arrival time, the id),
so a replay rejects exactly what the first attempt rejected.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
from statekeeper_sdk import Limits, PayloadFormat, Rejected, parse_id
from statekeeper_sdk._runtime.events import (
    MAX_FUTURE_SECONDS,
    MAX_PAYLOAD_BYTES,
    MAX_STRING_CHARS,
    parse_entries,
    text_of,
)

from workers.spark.sources.following import Following

FORMAT_NAME = "redis-streams"
MAX_SEQ = 18446744073709551615  # the largest sequence part of a stream id: "<ms>-MAX_SEQ" ends a millisecond
PAGE = 20_000  # entries per XRANGE call: bounds a reader's memory whatever the batch size

# ZADD the entry to the job's dead-letter "seen" set (scored by its arrival, so the set can be trimmed by age with the
# stream); only the first time, append it to the dead-letter stream.
_DEAD_LETTER_ONCE = """
local added = 0
for i = 1, #ARGV, 5 do
  if redis.call('ZADD', KEYS[2], 'NX', ARGV[i + 1], ARGV[i]) == 1 then
    redis.call('XADD', KEYS[1], '*', 'entry', ARGV[i], 'stage', ARGV[i + 2], 'reason', ARGV[i + 3],
      'payload', ARGV[i + 4])
    added = added + 1
  end
end
return added
"""


@dataclass(frozen=True)
class StreamRange(InputPartition):
    """Entries with ids in (after, upto]."""

    after: str
    upto: str

    def __init__(self, after: str, upto: str) -> None:
        object.__setattr__(self, "after", after)
        object.__setattr__(self, "upto", upto)


def _connect(url: str) -> Any:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10)
    # Raw XRANGE replies, [id, [field, value, ...]]: building a dict per entry costs more than the parse.
    client.set_response_callback("XRANGE", lambda response, **options: response)
    return client


def stream_position(client: Any, stream: str) -> dict[str, Any]:
    """The stream's newest offset: last generated id and the number of entries ever added."""
    try:
        info = client.xinfo_stream(stream)
    except Exception as exc:  # a stream that does not exist yet has no entries
        if "no such key" in str(exc).lower():
            return {"id": "0-0", "n": 0}
        raise
    last = info["last-generated-id"]
    return {"id": last.decode() if isinstance(last, bytes) else last, "n": int(info["entries-added"])}


def split_range(after: str, upto: str, parts: int) -> list[StreamRange]:
    """Split (after, upto] into up to ``parts`` ranges on millisecond boundaries, for parallel reads."""
    lo_ms, _ = parse_id(after)
    hi_ms, _ = parse_id(upto)
    span = hi_ms - lo_ms
    parts = max(1, min(parts, span + 1))
    if parts == 1:
        return [StreamRange(after, upto)]
    step = span / parts
    ranges, left = [], after
    for i in range(1, parts):
        cut_ms = lo_ms + int(step * i)
        cut = f"{cut_ms}-{MAX_SEQ}"
        if parse_id(cut) <= parse_id(left) or parse_id(cut) >= parse_id(upto):
            continue
        ranges.append(StreamRange(left, cut))
        left = cut
    ranges.append(StreamRange(left, upto))
    return ranges


class RedisStreamDataSource(DataSource):
    """``spark.readStream.format("redis-streams").option("stream", ...)``; see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return FORMAT_NAME

    def schema(self) -> str:
        return PayloadFormat.from_option(self.options["format"]).spark_schema()

    def streamReader(self, schema: Any) -> DataSourceStreamReader:
        return RedisStreamReader(dict(self.options))


class RedisStreamReader(DataSourceStreamReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.url = options.get("url", "redis://127.0.0.1:6379/0")
        self.stream = options["stream"]
        self.dead_letter = options.get("deadletter", f"{self.stream}:dead")
        self.skip_list = options.get("skiplist", "")  # a Redis list of {"after", "upto", "action"} ranges
        self.max_records = int(options.get("maxrecordsperbatch", "0"))
        self.read_partitions = max(1, int(options.get("readpartitions", "2")))
        self.starting = options.get("startingposition", "earliest")
        # {"id", "n"}: read no further (an upgrade's shadow run reads a fixed range beside the live job)
        self.ending = json.loads(options["endingoffset"]) if options.get("endingoffset") else None
        self.format_option = options["format"]
        # Admit new entries once per interval, from this point of it (ms): the shared driver spreads its jobs' batches
        # over the interval (Spark starts every processing-time trigger on the same tick of the clock); see ``admits``.
        self.admit_every = int(options.get("admiteveryms", "0"))
        self.admit_phase = int(options.get("admitphasems", "0"))
        # its driver is stopping: admit now, once (``closing_file``), so the last batch before the stop takes what came
        self.closing_file = options.get("closingfile", "")
        self._admitted: int | None = None  # the interval whose entries the last batch took
        # A blue/green upgrade's new version runs the job's batches: until the handover file exists, each of its
        # batches reads exactly the offsets of the job's batch of that number, once the job has committed it.
        self.following = Following(options)
        self._client: Any = None
        self.limits = Limits(
            max_string_chars=int(options.get("maxstringchars", MAX_STRING_CHARS)),
            max_future_seconds=float(options.get("maxfutureseconds", MAX_FUTURE_SECONDS)),
        )

    def initialOffset(self) -> dict:
        """Where a new checkpoint starts: the beginning, the stream's end ("latest"), or a given offset (JSON
        {"id", "n"}: an upgrade that starts with empty state goes on from where the old version stopped)."""
        if self.starting == "latest":
            return stream_position(_connect(self.url), self.stream)
        if self.starting.startswith("{"):
            given = json.loads(self.starting)
            return {"id": str(given["id"]), "n": int(given["n"])}
        return {"id": "0-0", "n": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_records) if self.max_records > 0 else ReadAllAvailable()

    def interval_at(self, now_ms: float) -> int:
        """Which of the intervals counted from the phase ``now_ms`` falls in."""
        return int((now_ms - self.admit_phase) // self.admit_every)

    def admits(self, now_ms: float) -> bool:
        """With ``admitEveryMs``, whether a batch may take new entries now: once in each interval counted from the
        phase (the query's trigger polls more often). The first call admits, so a restarted job's first batch does not
        wait for its phase."""
        closing = self._closing()  # looked at every time: its removal is the driver's sign that it was seen
        return closing or self.admit_every <= 0 or self.interval_at(now_ms) != self._admitted

    def _closing(self) -> bool:
        """Whether the driver asked for a last batch before its stop (the file's removal tells it the ask was seen)."""
        if not self.closing_file:
            return False
        try:
            os.unlink(self.closing_file)
        except FileNotFoundError:
            return False
        return True

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        if (followed := self.following.end(start)) is not None:
            self._latest = followed
            return followed
        self.following.paced()
        now_ms = time.time() * 1000
        if not self.admits(now_ms):
            return start
        if self._client is None:
            self._client = _connect(self.url)
        client = self._client
        latest = stream_position(client, self.stream)
        self._latest = latest
        if self.admit_every > 0 and parse_id(latest["id"]) > parse_id(start["id"]):
            self._admitted = self.interval_at(now_ms)
        if self.ending is not None and parse_id(latest["id"]) > parse_id(self.ending["id"]):
            latest = self.ending
        if isinstance(limit, ReadMaxRows) and latest["n"] - start["n"] > limit.max_rows:
            # Only a backlog larger than the limit needs the id of the limit-th entry, which only a read can tell.
            entries = client.xrange(self.stream, min=f"({start['id']}", count=limit.max_rows)
            if entries:
                return {"id": text_of(entries[-1][0]), "n": start["n"] + len(entries)}
        return latest if parse_id(latest["id"]) > parse_id(start["id"]) else start

    def reportLatestOffset(self) -> dict | None:
        return getattr(self, "_latest", None)

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        if parse_id(end["id"]) <= parse_id(start["id"]):
            return []
        return split_range(start["id"], end["id"], self.read_partitions)

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, StreamRange)
        client = _connect(self.url)
        fmt = PayloadFormat.from_option(self.format_option)
        skips = [json.loads(r) for r in client.lrange(self.skip_list, 0, -1)] if self.skip_list else []
        after = partition.after
        while True:
            entries = client.xrange(self.stream, min=f"({after}", max=partition.upto, count=PAGE)
            if not entries:
                return
            entries, skipped = skip_entries(entries, skips)
            batch, dead = parse_entries(entries, fmt, self.limits)
            dead += skipped
            if dead:
                dead_letter(client, self.dead_letter, dead)
            if batch.num_rows:
                yield batch
            if len(entries) < PAGE:
                return
            after = text_of(entries[-1][0])

    def commit(self, end: dict) -> None:
        pass


def skip_entries(entries: list[Any], skips: list[dict[str, Any]]) -> tuple[list[Any], list[Rejected]]:
    """Entries inside a range an operator skipped leave the batch for the dead letter. Ranges are only added while
    the job is down, so every replay of a batch skips the same entries."""
    if not skips:
        return entries, []
    bounds = [(parse_id(r["after"]), parse_id(r["upto"]), r.get("action")) for r in skips]
    kept, skipped = [], []
    for entry in entries:
        entry_id = text_of(entry[0])
        at = parse_id(entry_id)
        action = next((a for lo, hi, a in bounds if lo < at <= hi), False)
        if action is False:
            kept.append(entry)
            continue
        payload = dict(zip(entry[1][::2], entry[1][1::2], strict=False)).get(b"v", b"")
        skipped.append(Rejected(entry_id, "skipped", f"skipped by operator action #{action}", payload))
    return kept, skipped


def dead_letter(client: Any, stream: str, dead: list[Rejected]) -> int:
    """Append rejected entries to the dead-letter stream, each once (a replayed batch rejects them again)."""
    args: list[Any] = []
    for r in dead:
        ms = r.entry.partition("-")[0]
        args += [r.entry, ms if ms.isdigit() else "0", r.stage, r.reason, r.payload[:MAX_PAYLOAD_BYTES]]
    return int(client.eval(_DEAD_LETTER_ONCE, 2, stream, f"{stream}:seen", *args))


class PlannerPing(DataSource):
    """A batch source of one row, read by a process that keeps itself ready to take a job over (workers/warm_query.py).

    A query on this stream source starts with a Python process that creates the source, and its first batch waits on
    another that plans its reads (Spark's ``create_data_source`` and ``plan_data_source_read``). Spark forks each from
    a daemon and keeps it, once used, for the next such call, but for 60 s only; a fresh one imports PyArrow and this
    module first, 0.5–1 s of a takeover's first batch on a busy host. Reading this source goes through the same two
    processes: read more often than once a minute, it keeps one of each alive with this module imported."""

    @classmethod
    def name(cls) -> str:
        return "statekeeper-planner-ping"

    def schema(self) -> str:
        return "ok int"

    def reader(self, schema: Any) -> DataSourceReader:
        return PlannerPingReader()


class PlannerPingReader(DataSourceReader):
    def read(self, partition: InputPartition) -> Iterator[tuple[int]]:
        yield (1,)
