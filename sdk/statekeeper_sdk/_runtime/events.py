"""The checks every event passes before a pipeline sees it, whichever source it came from (a Redis stream entry, a
file's row, a Kafka record): size, UTF-8, JSON or the regex, the payload's schema, numbers in range, text bounds, an
event time against the event's own arrival. Each check is a function of the event alone, so a replayed batch rejects
exactly what its first read rejected. The sources run them, and so does the test kit (``statekeeper_sdk.testing``)
on a team's sample events.

Flat payloads (``Field``s) are checked in bulk with Arrow; a payload described by a Spark schema (nested structs,
arrays, maps, booleans, timestamps, decimals) is checked event by event, and a rejection names the path
(``items[3].price: not a number``).
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

from statekeeper_sdk._runtime.nested import Bad, arrow_schema, check_object, epoch_ms
from statekeeper_sdk.events import MAX_FUTURE_SECONDS, MAX_PAYLOAD_BYTES, MAX_STRING_CHARS, Limits, Rejected, parse_id
from statekeeper_sdk.payload import PayloadFormat

__all__ = ["MAX_FUTURE_SECONDS", "MAX_PAYLOAD_BYTES", "MAX_STRING_CHARS", "parse_entries", "text_of"]

LONG_MIN, LONG_MAX = -(2**63), 2**63 - 1
DEFAULT_LIMITS = Limits()


def parse_entries(
    entries: list[Any], fmt: PayloadFormat, limits: Limits = DEFAULT_LIMITS
) -> tuple[Any, list[Rejected]]:
    """Turn raw XRANGE entries into one Arrow batch of valid rows, and the rejected rest."""
    import pyarrow as pa

    arrow_types = {"string": pa.string(), "long": pa.int64(), "double": pa.float64()}
    schema = arrow_schema(fmt.struct)
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
                described = json.dumps({text_of(k): text_of(v) for k, v in pairs.items()}).encode()
                dead.append(Rejected(text_of(entry_id), "decode", "entry has no 'v' field", described))
                continue
            raw_ids.append(entry_id)
            payloads.append(pairs[b"v"])
    if not raw_ids:
        return pa.RecordBatch.from_pylist([], schema=schema), dead
    if fmt.nested:
        rows = []
        for entry_id, payload in zip(raw_ids, payloads, strict=True):
            try:
                rows.append({"_id": text_of(entry_id), **_check_nested(text_of(entry_id), payload, fmt, limits)})
            except _Failed as failed:
                dead.append(Rejected(text_of(entry_id), failed.stage, str(failed), payload))
        return pa.RecordBatch.from_pylist(rows, schema=schema), dead
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
        dead.append(Rejected(text_of(raw_ids[i]), stage, reason, payloads[i]))
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


def text_of(value: Any) -> str:
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


class _Failed(ValueError):
    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(reason)
        self.stage = stage


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_nested(entry_id: str, payload: bytes, fmt: PayloadFormat, limits: Limits) -> dict[str, Any]:
    """One event's row against the payload's schema; ``_Failed`` with the stage and the reason (its path) if not."""
    if len(payload) > limits.max_payload_bytes:
        raise _Failed("decode", f"payload is {len(payload):,} bytes (limit {limits.max_payload_bytes:,})")
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Failed("decode", f"not valid UTF-8: byte {payload[exc.start]:#04x} at position {exc.start}") from None
    try:  # decimals stay exact; NaN and Infinity are not JSON
        obj = json.loads(text, parse_float=Decimal, parse_constant=_reject_constant)
    except RecursionError:
        raise _Failed("parse", "JSON nested too deeply to parse") from None
    except ValueError as exc:
        raise _Failed("parse", f"not valid JSON: {exc}") from None
    try:
        row = check_object(obj, fmt.struct, limits.max_string_chars)
    except Bad as exc:
        raise _Failed("parse", str(exc)) from None
    if fmt.event_time and limits.max_future_seconds > 0 and row.get(fmt.event_time) is not None:
        at = epoch_ms(row[fmt.event_time])
        ahead = at - parse_id(entry_id)[0]
        if ahead > limits.max_future_seconds * 1000:
            raise _Failed(
                "validate",
                f"{fmt.event_time}: event time {at} is {ahead / 1000:,.0f} s after the event arrived "
                f"(limit {limits.max_future_seconds:g} s): it would move the watermark",
            )
    return row
