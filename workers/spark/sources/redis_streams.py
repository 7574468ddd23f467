"""A PySpark streaming data source over one Redis stream.

Offsets are ``{"id": <stream entry id>, "n": <entries added up to that id>}``. The entry id makes a restart replay
exactly what was not committed; ``n`` (Redis' ``entries-added`` counter) turns the gap between two offsets into a
record count, so every progress event carries the backlog in records.

The reader parses payloads in bulk with Arrow (``pyarrow.json`` or an RE2 regex over the whole batch); an entry that
does not parse goes to a dead-letter stream with its reason, once, however often its batch is replayed.
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

# SADD the entry id to the job's dead-letter id set; only the first time, append it to the dead-letter stream.
_DEAD_LETTER_ONCE = """
local added = 0
for i = 1, #ARGV, 3 do
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then
    redis.call('XADD', KEYS[1], '*', 'entry', ARGV[i], 'reason', ARGV[i + 1], 'payload', ARGV[i + 2])
    added = added + 1
  end
end
return added
"""


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

    def to_option(self) -> str:
        return json.dumps(
            {"kind": self.kind, "pattern": self.pattern, "fields": [[f.name, f.type, f.required] for f in self.fields]}
        )

    @classmethod
    def from_option(cls, text: str) -> PayloadFormat:
        raw = json.loads(text)
        return cls(raw["kind"], tuple(Field(n, t, r) for n, t, r in raw["fields"]), raw.get("pattern", ""))

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
        self.max_records = int(options.get("maxrecordsperbatch", "0"))
        self.read_partitions = max(1, int(options.get("readpartitions", "2")))
        self.starting = options.get("startingposition", "earliest")
        self.format_option = options["format"]

    def initialOffset(self) -> dict:
        if self.starting == "latest":
            return stream_position(_connect(self.url), self.stream)
        return {"id": "0-0", "n": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_records) if self.max_records > 0 else ReadAllAvailable()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        client = _connect(self.url)
        latest = stream_position(client, self.stream)
        self._latest = latest
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
        after = partition.after
        while True:
            entries = client.xrange(self.stream, min=f"({after}", max=partition.upto, count=PAGE)
            if not entries:
                return
            batch, dead = parse_entries(entries, fmt)
            if dead:
                dead_letter(client, self.dead_letter, dead)
            if batch.num_rows:
                yield batch
            if len(entries) < PAGE:
                return
            after = _s(entries[-1][0])

    def commit(self, end: dict) -> None:
        pass


def dead_letter(client: Any, stream: str, dead: list[tuple[str, str, str]]) -> int:
    args: list[str] = []
    for entry_id, reason, payload in dead:
        args += [entry_id, reason, payload]
    return int(client.eval(_DEAD_LETTER_ONCE, 2, stream, f"{stream}:ids", *args))


def parse_entries(entries: list[Any], fmt: PayloadFormat) -> tuple[Any, list[tuple[str, str, str]]]:
    """Turn raw XRANGE entries into one Arrow batch of valid rows, and (id, reason, payload) for the rest."""
    import pyarrow as pa

    arrow_types = {"string": pa.string(), "long": pa.int64(), "double": pa.float64()}
    schema = pa.schema([("_id", pa.string())] + [(f.name, arrow_types[f.type]) for f in fmt.fields])
    dead: list[tuple[str, str, str]] = []
    # the common case, one field named v, checked in bulk; anything else is looked at entry by entry
    if all(len(fields) == 2 and fields[0] == b"v" for _, fields in entries):
        raw_ids = [entry_id for entry_id, _ in entries]
        payloads = [fields[1] for _, fields in entries]
    else:
        raw_ids, payloads = [], []
        for entry_id, fields in entries:
            pairs = dict(zip(fields[::2], fields[1::2], strict=False))
            if b"v" not in pairs:
                described = json.dumps({_s(k): _s(v) for k, v in pairs.items()})
                dead.append((_s(entry_id), "entry has no 'v' field", described))
                continue
            raw_ids.append(entry_id)
            payloads.append(pairs[b"v"])
    if not raw_ids:
        return pa.RecordBatch.from_pylist([], schema=schema), dead
    ids = pa.array(raw_ids, pa.binary()).cast(pa.string())
    parse = _parse_regex if fmt.kind == "regex" else _parse_json
    columns, bad = parse(payloads, fmt)
    for i, reason in sorted(bad.items()):
        dead.append((_s(raw_ids[i]), reason, payloads[i].decode("utf-8", "replace")))
    if bad:
        keep = pa.array([i for i in range(len(raw_ids)) if i not in bad], pa.int64())
        columns = {name: col.take(keep) for name, col in columns.items()}
        ids = ids.take(keep)
    arrays = [ids] + [columns[f.name].cast(arrow_types[f.type]) for f in fmt.fields]
    return pa.RecordBatch.from_arrays(arrays, schema=schema), dead


def _s(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _parse_regex(payloads: list[bytes], fmt: PayloadFormat) -> tuple[dict[str, Any], dict[int, str]]:
    import pyarrow as pa
    import pyarrow.compute as pc

    matched = pc.extract_regex(pa.array(payloads, pa.binary()).cast(pa.string()), pattern=fmt.pattern)
    bad = {i: "line does not match the expected format" for i in pc.indices_nonzero(pc.is_null(matched)).to_pylist()}
    columns: dict[str, Any] = {}
    for f in fmt.fields:
        text = pc.struct_field(matched, f.name)
        if f.type == "string":
            columns[f.name] = text
            continue
        numeric = pc.utf8_is_digit(text) if f.type == "long" else pc.match_substring_regex(text, r"^-?\d+(\.\d+)?$")
        for i in pc.indices_nonzero(pc.invert(pc.fill_null(numeric, True))).to_pylist():
            bad.setdefault(i, f"field '{f.name}' is not a number")
        columns[f.name] = pc.if_else(pc.fill_null(numeric, False), text, None)
    return columns, bad


def _parse_json(payloads: list[bytes], fmt: PayloadFormat) -> tuple[dict[str, Any], dict[int, str]]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    arrow_types = {"string": pa.string(), "long": pa.int64(), "double": pa.float64()}
    schema = pa.schema([(f.name, arrow_types[f.type]) for f in fmt.fields])
    bad: dict[int, str] = {}
    block = b"\n".join(payloads)
    if b"\n" not in b"".join(payloads):
        try:
            table = pj.read_json(
                pa.BufferReader(block),
                read_options=pj.ReadOptions(block_size=max(1 << 20, len(block) + 1)),
                parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore"),
            )
            if table.num_rows == len(payloads):
                columns = {f.name: table.column(f.name).combine_chunks() for f in fmt.fields}
                for f in fmt.fields:
                    if f.required and columns[f.name].null_count:
                        for i in pc.indices_nonzero(pc.is_null(columns[f.name])).to_pylist():
                            bad.setdefault(i, f"missing field '{f.name}'")
                return columns, bad
        except pa.ArrowInvalid:
            pass  # some line is not valid for the schema: find which, one by one
    rows: list[dict[str, Any]] = []
    for i, payload in enumerate(payloads):
        row, reason = _check_json(payload, fmt)
        if reason:
            bad[i] = reason
        rows.append(row)
    return {f.name: pa.array([r.get(f.name) for r in rows], arrow_types[f.type]) for f in fmt.fields}, bad


def _check_json(payload: bytes, fmt: PayloadFormat) -> tuple[dict[str, Any], str]:
    try:
        obj = json.loads(payload)
    except ValueError as exc:
        return {}, f"not valid JSON: {exc}"
    if not isinstance(obj, dict):
        return {}, "not a JSON object"
    row: dict[str, Any] = {}
    for f in fmt.fields:
        value = obj.get(f.name)
        if value is None:
            if f.required:
                return {}, f"missing field '{f.name}'"
        elif f.type == "string" and not isinstance(value, str):
            return {}, f"field '{f.name}' is not a string"
        elif f.type == "long" and (isinstance(value, bool) or not isinstance(value, int)):
            return {}, f"field '{f.name}' is not an integer"
        elif f.type == "double" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return {}, f"field '{f.name}' is not a number"
        row[f.name] = value
    return row, ""
