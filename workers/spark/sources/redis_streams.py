"""A PySpark streaming data source over one Redis stream.

Offsets are ``{"id": <stream entry id>, "n": <entries added up to that id>}``. The entry id makes a restart replay
exactly what was not committed; ``n`` (Redis' ``entries-added`` counter) turns the gap between two offsets into a
record count, so every progress event carries the backlog in records.

The reader parses payloads in bulk with Arrow (``pyarrow.json`` or an RE2 regex over the whole batch). No input can
stop the job: an entry that fails anywhere on its way (decoding, parsing, a bound) goes to a dead-letter stream with
its entry id, the stage and the reason, once, however often its batch is replayed, and the batch goes on without it.
Every check is a function of the entry alone (a timestamp is judged against the entry's own arrival time, the id),
so a replay rejects exactly what the first attempt rejected.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows

FORMAT_NAME = "redis-streams"
MAX_SEQ = 18446744073709551615  # the largest sequence part of a stream id: "<ms>-MAX_SEQ" ends a millisecond
PAGE = 20_000  # entries per XRANGE call: bounds a reader's memory whatever the batch size

MAX_PAYLOAD_BYTES = 1 << 20  # a larger payload is dead-lettered (its first MAX_PAYLOAD_BYTES kept), never parsed
MAX_STRING_CHARS = 400  # a longer text field is dead-lettered: result keys are stored in 500 characters
MAX_FUTURE_SECONDS = 300  # an event time further than this after the entry's arrival would move the watermark
LONG_MIN, LONG_MAX = -(2**63), 2**63 - 1

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
class Rejected:
    """An entry that did not make it into a batch: where it failed and why."""

    entry: str
    stage: str  # decode | parse | validate | sink | skipped
    reason: str
    payload: bytes


@dataclass(frozen=True)
class Limits:
    max_string_chars: int = MAX_STRING_CHARS
    max_future_seconds: float = MAX_FUTURE_SECONDS
    max_payload_bytes: int = MAX_PAYLOAD_BYTES


def parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # "string" | "long" | "double"
    required: bool = True


@dataclass(frozen=True)
class PayloadFormat:
    """How the payload (the entry's ``v`` field) is parsed: JSON objects, or a regex with named groups."""

    kind: str  # "json" | "regex"
    fields: tuple[Field, ...]
    pattern: str = ""
    event_time: str = ""  # a long field holding the event time in epoch milliseconds, bounded against the arrival

    def to_option(self) -> str:
        return json.dumps(
            {
                "kind": self.kind,
                "pattern": self.pattern,
                "event_time": self.event_time,
                "fields": [[f.name, f.type, f.required] for f in self.fields],
            }
        )

    @classmethod
    def from_option(cls, text: str) -> PayloadFormat:
        raw = json.loads(text)
        fields = tuple(Field(n, t, r) for n, t, r in raw["fields"])
        return cls(raw["kind"], fields, raw.get("pattern", ""), raw.get("event_time", ""))

    def spark_schema(self) -> str:
        spark_type = {"string": "string", "long": "bigint", "double": "double"}
        return ", ".join(["_id string"] + [f"`{f.name}` {spark_type[f.type]}" for f in self.fields])


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

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        client = _connect(self.url)
        latest = stream_position(client, self.stream)
        self._latest = latest
        if self.ending is not None and parse_id(latest["id"]) > parse_id(self.ending["id"]):
            latest = self.ending
        if isinstance(limit, ReadMaxRows) and latest["n"] - start["n"] > limit.max_rows:
            # Only a backlog larger than the limit needs the id of the limit-th entry, which only a read can tell.
            entries = client.xrange(self.stream, min=f"({start['id']}", count=limit.max_rows)
            if entries:
                return {"id": _s(entries[-1][0]), "n": start["n"] + len(entries)}
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
            after = _s(entries[-1][0])

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
        entry_id = _s(entry[0])
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


def parse_entries(entries: list[Any], fmt: PayloadFormat, limits: Limits = Limits()) -> tuple[Any, list[Rejected]]:
    """Turn raw XRANGE entries into one Arrow batch of valid rows, and the rejected rest."""
    import pyarrow as pa

    arrow_types = {"string": pa.string(), "long": pa.int64(), "double": pa.float64()}
    schema = pa.schema([("_id", pa.string())] + [(f.name, arrow_types[f.type]) for f in fmt.fields])
    dead: list[Rejected] = []
    # the common case, one field named v, checked in bulk; anything else is looked at entry by entry
    if all(len(fields) == 2 and fields[0] == b"v" for _, fields in entries):
        raw_ids = [entry_id for entry_id, _ in entries]
        payloads = [fields[1] for _, fields in entries]
    else:
        raw_ids, payloads = [], []
        for entry_id, fields in entries:
            pairs = dict(zip(fields[::2], fields[1::2], strict=False))
            if b"v" not in pairs:
                described = json.dumps({_s(k): _s(v) for k, v in pairs.items()}).encode()
                dead.append(Rejected(_s(entry_id), "decode", "entry has no 'v' field", described))
                continue
            raw_ids.append(entry_id)
            payloads.append(pairs[b"v"])
    if not raw_ids:
        return pa.RecordBatch.from_pylist([], schema=schema), dead
    # JSON is parsed from bytes (its reader and the per-entry check find invalid UTF-8 in the fields read); a regex
    # runs on text, so its payloads are checked for UTF-8 first
    bad = _undecodable(payloads, limits, utf8=fmt.kind == "regex")
    texts = [b"" if i in bad else p for i, p in enumerate(payloads)]
    parse = _parse_regex if fmt.kind == "regex" else _parse_json
    columns, found = parse(texts, fmt, set(bad))
    bad.update({i: reason for i, reason in found.items() if i not in bad})
    ids = pa.array(raw_ids, pa.binary()).cast(pa.string())
    bad.update({i: reason for i, reason in _out_of_bounds(columns, fmt, limits, ids).items() if i not in bad})
    for i, (stage, reason) in sorted(bad.items()):
        dead.append(Rejected(_s(raw_ids[i]), stage, reason, payloads[i]))
    if bad:
        keep = pa.array([i for i in range(len(raw_ids)) if i not in bad], pa.int64())
        columns = {name: col.take(keep) for name, col in columns.items()}
        ids = ids.take(keep)
    arrays = [ids] + [columns[f.name].cast(arrow_types[f.type]) for f in fmt.fields]
    return pa.RecordBatch.from_arrays(arrays, schema=schema), dead


def _undecodable(payloads: list[bytes], limits: Limits, utf8: bool) -> dict[int, tuple[str, str]]:
    """Payloads too large, or (``utf8``) not UTF-8: checked in bulk first, one by one only when something is wrong."""
    import pyarrow as pa

    bad = {
        i: ("decode", f"payload is {len(p):,} bytes (limit {limits.max_payload_bytes:,})")
        for i, p in enumerate(payloads)
        if len(p) > limits.max_payload_bytes
    }
    if not utf8:
        return bad
    try:
        pa.array(payloads, pa.binary()).cast(pa.string())
        return bad
    except pa.ArrowInvalid:
        pass
    for i, payload in enumerate(payloads):
        if i in bad:
            continue
        try:
            payload.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad[i] = ("decode", f"not valid UTF-8: byte {payload[exc.start]:#04x} at position {exc.start}")
    return bad


def _out_of_bounds(columns: dict[str, Any], fmt: PayloadFormat, limits: Limits, ids: Any) -> dict[int, tuple[str, str]]:
    """Values that parsed but that a result, the state or the watermark cannot take: text longer than a result key
    holds or with a NUL (PostgreSQL text refuses it), NaN or infinite numbers, an event time far beyond the entry's
    arrival."""
    import pyarrow as pa
    import pyarrow.compute as pc

    bad: dict[int, tuple[str, str]] = {}

    def mark(mask: Any, reason: Any) -> None:
        for i in pc.indices_nonzero(pc.fill_null(mask, False)).to_pylist():
            bad.setdefault(i, ("validate", reason(i)))

    for f in fmt.fields:
        column = columns[f.name]
        if f.type == "string":
            text = column.cast(pa.string())
            mark(pc.match_substring(text, "\x00"), lambda i, f=f: f"field '{f.name}' holds a NUL character")
            lengths = pc.utf8_length(text)
            mark(
                pc.greater(lengths, limits.max_string_chars),
                lambda i, f=f, lengths=lengths: (
                    f"field '{f.name}' is {lengths[i].as_py():,} characters (limit {limits.max_string_chars})"
                ),
            )
        elif f.type == "double":
            numbers = column.cast(pa.float64())
            mark(pc.invert(pc.is_finite(numbers)), lambda i, f=f: f"field '{f.name}' is not a finite number")
    if fmt.event_time and limits.max_future_seconds > 0:
        arrival = pc.list_element(pc.split_pattern(ids, "-", max_splits=1), 0).cast(pa.int64())
        times = columns[fmt.event_time].cast(pa.int64())
        ahead = pc.subtract(times, arrival)
        mark(
            pc.greater(ahead, int(limits.max_future_seconds * 1000)),
            lambda i: (
                f"event time {times[i].as_py()} is {ahead[i].as_py() / 1000:,.0f} s after the entry arrived "
                f"(limit {limits.max_future_seconds:g} s): it would move the watermark"
            ),
        )
    return bad


def _s(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _parse_regex(
    payloads: list[bytes], fmt: PayloadFormat, skip: set[int]
) -> tuple[dict[str, Any], dict[int, tuple[str, str]]]:
    import pyarrow as pa
    import pyarrow.compute as pc

    matched = pc.extract_regex(pa.array(payloads, pa.binary()).cast(pa.string()), pattern=fmt.pattern)
    bad = {
        i: ("parse", "line does not match the expected format")
        for i in pc.indices_nonzero(pc.is_null(matched)).to_pylist()
        if i not in skip
    }
    columns: dict[str, Any] = {}
    for f in fmt.fields:
        text = pc.struct_field(matched, f.name)
        if f.type == "string":
            columns[f.name] = text
            continue
        if f.type == "long":  # 18 digits always fit in 64 bits; more are out of range
            numeric = pc.and_(pc.utf8_is_digit(text), pc.less_equal(pc.utf8_length(text), 18))
        else:
            numeric = pc.match_substring_regex(text, r"^-?\d+(\.\d+)?$")
        for i in pc.indices_nonzero(pc.invert(pc.fill_null(numeric, True))).to_pylist():
            bad.setdefault(i, ("parse", f"field '{f.name}' is not a number in range"))
        columns[f.name] = pc.if_else(pc.fill_null(numeric, False), text, None)
    return columns, bad


def _parse_json(
    payloads: list[bytes], fmt: PayloadFormat, skip: set[int]
) -> tuple[dict[str, Any], dict[int, tuple[str, str]]]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    arrow_types = {"string": pa.string(), "long": pa.int64(), "double": pa.float64()}
    schema = pa.schema([(f.name, arrow_types[f.type]) for f in fmt.fields])
    bad: dict[int, tuple[str, str]] = {}
    block = b"\n".join(payloads)
    if not skip and b"\n" not in b"".join(payloads):
        try:
            table = pj.read_json(
                pa.BufferReader(block),
                read_options=pj.ReadOptions(block_size=max(1 << 20, len(block) + 1)),
                parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
            )
            if table.num_rows == len(payloads):
                columns = {f.name: table.column(f.name).combine_chunks() for f in fmt.fields}
                for f in fmt.fields:  # the reader copies bytes as they are: invalid UTF-8 is found here, in bulk
                    if f.type == "string":
                        columns[f.name].validate(full=True)
                for f in fmt.fields:
                    if f.required and columns[f.name].null_count:
                        for i in pc.indices_nonzero(pc.is_null(columns[f.name])).to_pylist():
                            bad.setdefault(i, ("parse", f"missing field '{f.name}'"))
                return columns, bad
        except pa.ArrowInvalid:
            pass  # some line is not valid for the schema (or not UTF-8): find which, one by one
    rows: list[dict[str, Any]] = []
    for i, payload in enumerate(payloads):
        row, failure = ({}, None) if i in skip else _check_json(payload, fmt)
        if failure:
            bad[i] = failure
        rows.append(row)
    return {f.name: pa.array([r.get(f.name) for r in rows], arrow_types[f.type]) for f in fmt.fields}, bad


def _check_json(payload: bytes, fmt: PayloadFormat) -> tuple[dict[str, Any], tuple[str, str] | None]:
    """One entry's row, or (stage, reason) when it cannot be one."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        return {}, ("decode", f"not valid UTF-8: byte {payload[exc.start]:#04x} at position {exc.start}")
    try:
        obj = json.loads(text)
    except RecursionError:
        return {}, ("parse", "JSON nested too deeply to parse")
    except ValueError as exc:
        return {}, ("parse", f"not valid JSON: {exc}")
    if not isinstance(obj, dict):
        return {}, ("parse", "not a JSON object")
    row: dict[str, Any] = {}
    for f in fmt.fields:
        value = obj.get(f.name)
        if value is None:
            if f.required:
                return {}, ("parse", f"missing field '{f.name}'")
        elif f.type == "string" and not isinstance(value, str):
            return {}, ("parse", f"field '{f.name}' is not a string")
        elif f.type == "string" and not _encodable(value):
            return {}, ("parse", f"field '{f.name}' holds a lone surrogate (e.g. \\ud800): not valid Unicode")
        elif f.type == "long" and (isinstance(value, bool) or not isinstance(value, int)):
            return {}, ("parse", f"field '{f.name}' is not an integer")
        elif f.type == "long" and not LONG_MIN <= value <= LONG_MAX:
            return {}, ("parse", f"field '{f.name}' is out of range for a 64-bit integer")
        elif f.type == "double" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return {}, ("parse", f"field '{f.name}' is not a number")
        elif f.type == "double" and isinstance(value, int) and abs(value) > 2**1023:
            return {}, ("parse", f"field '{f.name}' is out of range for a double")
        row[f.name] = value
    return row, None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
