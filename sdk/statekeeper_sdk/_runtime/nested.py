"""Payloads described by a Spark schema: the DDL text read without a JVM (a Python worker has none), and one event's
JSON object checked against it, field by field, with the path of the first thing wrong in the reason
(``items[3].price: not a number``).

Types: string, boolean, tinyint/smallint/int/bigint (and byte, short, integer, long), float, double,
decimal(p, s), date, timestamp, timestamp_ntz, array<T>, map<string, T>, struct<name: T, ...>. A field is required
when its DDL says ``NOT NULL``. In JSON a timestamp is an ISO 8601 text (a time without an offset is UTC) or epoch
milliseconds; a date is ``YYYY-MM-DD``; a decimal is a JSON number or a numeric text and must fit its precision and
scale exactly (a value Spark would round or turn into null is rejected instead).
"""

from __future__ import annotations

import math
import re
from datetime import UTC, date, datetime
from decimal import Decimal, InvalidOperation
from functools import cache
from typing import Any

from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    ByteType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

SIMPLE: dict[str, DataType] = {
    "string": StringType(), "varchar": StringType(), "char": StringType(), "boolean": BooleanType(),
    "bool": BooleanType(), "tinyint": ByteType(), "byte": ByteType(), "smallint": ShortType(), "short": ShortType(),
    "int": IntegerType(), "integer": IntegerType(), "bigint": LongType(), "long": LongType(), "float": FloatType(),
    "real": FloatType(), "double": DoubleType(), "date": DateType(), "timestamp": TimestampType(),
    "timestamp_ltz": TimestampType(), "timestamp_ntz": TimestampNTZType(),
}  # fmt: skip
INTEGER_RANGE: dict[type, tuple[int, int]] = {
    ByteType: (-(2**7), 2**7 - 1), ShortType: (-(2**15), 2**15 - 1), IntegerType: (-(2**31), 2**31 - 1),
    LongType: (-(2**63), 2**63 - 1),
}  # fmt: skip
FLOAT_MAX = 3.4028234663852886e38
MAX_DEPTH = 32  # a schema nested deeper than this is refused (and so is an event that would need it)
TOKEN = re.compile(r"\s*(?:(`(?:[^`]|``)*`)|([A-Za-z_][A-Za-z0-9_]*)|(\d+)|('(?:[^'\\]|\\.)*')|([<>(),:]))")


class SchemaError(ValueError):
    """A DDL text that is not a schema this SDK can check events against."""


class Bad(ValueError):
    """One event's value that does not fit the schema: where and why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}" if path else reason)


@cache
def parse_ddl(text: str) -> StructType:
    """``"a string NOT NULL, b array<struct<c: int>>"`` (or ``struct<...>``) as a StructType.

    >>> schema = parse_ddl("order_id string NOT NULL, items array<struct<sku: string, qty: int>>")
    >>> [(f.name, f.dataType.simpleString(), f.nullable) for f in schema.fields]
    [('order_id', 'string', False), ('items', 'array<struct<sku:string,qty:int>>', True)]
    """
    tokens = _tokens(text)
    if not tokens:
        raise SchemaError("a schema needs at least one field")
    parser = _Parser(tokens, text)
    if len(tokens) > 1 and tokens[0].lower() == "struct" and tokens[1] == "<":
        parser.take("struct")
        struct = parser.struct_body(1)
    else:
        struct = StructType(parser.fields(None, 1))
    if parser.position != len(tokens):
        raise SchemaError(f"unexpected {tokens[parser.position]!r} in the schema {text!r}")
    names = [f.name for f in struct.fields]
    if duplicated := sorted({n for n in names if names.count(n) > 1}):
        raise SchemaError(f"the field {duplicated[0]!r} is named twice")
    return struct


def _tokens(text: str) -> list[str]:
    tokens, at = [], 0
    while at < len(text):
        match = TOKEN.match(text, at)
        if match is None or match.end() == at:
            if text[at:].strip() == "":
                break
            raise SchemaError(f"cannot read the schema {text!r} at position {at}: {text[at : at + 20]!r}")
        tokens.append(next(g for g in match.groups() if g is not None))
        at = match.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[str], text: str) -> None:
        self.tokens, self.text, self.position = tokens, text, 0

    def peek(self) -> str:
        return self.tokens[self.position] if self.position < len(self.tokens) else ""

    def take(self, expected: str = "") -> str:
        token = self.peek()
        if not token or (expected and token.lower() != expected):
            raise SchemaError(
                f"expected {expected or 'more'} in the schema {self.text!r}, found {token or 'its end'!r}"
            )
        self.position += 1
        return token

    def fields(self, closing: str | None, depth: int) -> list[StructField]:
        fields = []
        while True:
            name = self.take()
            if name in "<>(),:":
                raise SchemaError(f"expected a field name in the schema {self.text!r}, found {name!r}")
            name = name[1:-1].replace("``", "`") if name.startswith("`") else name
            if self.peek() == ":":
                self.take()
            data_type = self.type(depth)
            nullable = True
            if self.peek().lower() == "not":
                self.take()
                self.take("null")
                nullable = False
            if self.peek().lower() == "comment":
                self.take()
                self.take()
            fields.append(StructField(name, data_type, nullable))
            if self.peek() == ",":
                self.take()
                continue
            if closing is None or self.peek() == closing:
                return fields
            raise SchemaError(f"expected ',' or {closing!r} in the schema {self.text!r}, found {self.peek()!r}")

    def struct_body(self, depth: int) -> StructType:
        self.take("<")
        struct = StructType(self.fields(">", depth + 1))
        self.take(">")
        return struct

    def type(self, depth: int) -> DataType:
        if depth > MAX_DEPTH:
            raise SchemaError(f"the schema nests deeper than {MAX_DEPTH} levels")
        word = self.take().lower()
        if word == "array":
            self.take("<")
            element = self.type(depth + 1)
            self.take(">")
            return ArrayType(element, True)
        if word == "map":
            self.take("<")
            key = self.type(depth + 1)
            self.take(",")
            value = self.type(depth + 1)
            self.take(">")
            if not isinstance(key, StringType):
                raise SchemaError(f"a map's keys must be strings (JSON object keys), not {key.simpleString()}")
            return MapType(key, value, True)
        if word == "struct":
            return self.struct_body(depth)
        if word in ("decimal", "dec", "numeric"):
            precision, scale = 10, 0
            if self.peek() == "(":
                self.take()
                precision = int(self.take())
                if self.peek() == ",":
                    self.take()
                    scale = int(self.take())
                self.take(")")
            if not 1 <= precision <= 38 or not 0 <= scale <= precision:
                raise SchemaError(f"decimal({precision}, {scale}) is out of range (precision 1–38, scale 0–precision)")
            return DecimalType(precision, scale)
        if word in ("varchar", "char") and self.peek() == "(":
            self.take()
            self.take()
            self.take(")")
        if word in SIMPLE:
            return SIMPLE[word]
        raise SchemaError(f"unknown type {word!r} in the schema {self.text!r}")


def to_ddl(struct: StructType) -> str:
    """The fields as Spark DDL (names quoted), for Spark's own parser: a data source's schema, a file reader's."""
    return ", ".join(f"{_quoted(f.name)} {_type_ddl(f.dataType)}" for f in struct.fields)


def _quoted(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _type_ddl(data_type: DataType) -> str:
    if isinstance(data_type, ArrayType):
        return f"array<{_type_ddl(data_type.elementType)}>"
    if isinstance(data_type, MapType):
        return f"map<{_type_ddl(data_type.keyType)}, {_type_ddl(data_type.valueType)}>"
    if isinstance(data_type, StructType):
        return "struct<" + ", ".join(f"{_quoted(f.name)}: {_type_ddl(f.dataType)}" for f in data_type.fields) + ">"
    return data_type.simpleString()


def check_object(obj: Any, struct: StructType, max_chars: int) -> dict[str, Any]:
    """The event's row (values as Arrow takes them), or ``Bad`` naming the first path that does not fit."""
    if not isinstance(obj, dict):
        raise Bad("", "not a JSON object")
    return _struct(obj, struct, "", max_chars)


def _struct(obj: dict[str, Any], struct: StructType, path: str, max_chars: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for field in struct.fields:
        where = f"{path}.{field.name}" if path else field.name
        value = obj.get(field.name)
        if value is None:
            if not field.nullable:
                raise Bad(where, "missing")
            row[field.name] = None
        else:
            row[field.name] = _value(value, field.dataType, where, max_chars)
    return row


def _value(value: Any, data_type: DataType, path: str, max_chars: int) -> Any:
    if isinstance(data_type, StringType):
        if not isinstance(value, str):
            raise Bad(path, "not a string")
        if "\x00" in value:
            raise Bad(path, "holds a NUL character")
        if len(value) > max_chars:
            raise Bad(path, f"is {len(value):,} characters (limit {max_chars})")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise Bad(path, "holds a lone surrogate (e.g. \\ud800): not valid Unicode") from None
        return value
    if isinstance(data_type, BooleanType):
        if not isinstance(value, bool):
            raise Bad(path, "not true or false")
        return value
    if type(data_type) in INTEGER_RANGE:
        low, high = INTEGER_RANGE[type(data_type)]
        if isinstance(value, bool) or not isinstance(value, int):
            raise Bad(path, "not an integer")
        if not low <= value <= high:
            raise Bad(path, f"{value} is out of range for {data_type.simpleString()} ({low} to {high})")
        return value
    if isinstance(data_type, (DoubleType, FloatType)):
        if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
            raise Bad(path, "not a number")
        number = float(value) if abs(value) < 10**400 else math.inf  # type: ignore[operator]
        if not math.isfinite(number) or (isinstance(data_type, FloatType) and abs(number) > FLOAT_MAX):
            raise Bad(path, f"out of range for {data_type.simpleString()}")
        return number
    if isinstance(data_type, DecimalType):
        return _decimal(value, data_type, path)
    if isinstance(data_type, TimestampNTZType):
        return _timestamp(value, path).replace(tzinfo=None)
    if isinstance(data_type, TimestampType):
        return _timestamp(value, path)
    if isinstance(data_type, DateType):
        try:
            if isinstance(value, str) and len(value) == 10:
                return date.fromisoformat(value)
        except ValueError:
            pass
        raise Bad(path, f"not a date (YYYY-MM-DD): {str(value)[:40]!r}")
    if isinstance(data_type, ArrayType):
        if not isinstance(value, list):
            raise Bad(path, "not an array")
        return [
            None if item is None else _value(item, data_type.elementType, f"{path}[{i}]", max_chars)
            for i, item in enumerate(value)
        ]
    if isinstance(data_type, MapType):
        if not isinstance(value, dict):
            raise Bad(path, "not an object (a map)")
        pairs = []
        for key, item in value.items():
            _value(key, StringType(), f"{path} key", max_chars)
            where = f"{path}[{key!r}]"
            pairs.append((key, None if item is None else _value(item, data_type.valueType, where, max_chars)))
        return pairs
    if isinstance(data_type, StructType):
        if not isinstance(value, dict):
            raise Bad(path, "not an object")
        return _struct(value, data_type, path, max_chars)
    raise Bad(path, f"{data_type.simpleString()} has no JSON form this SDK reads")


def _decimal(value: Any, data_type: DecimalType, path: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, Decimal, str)):
        raise Bad(path, "not a decimal number")
    try:
        number = Decimal(value) if not isinstance(value, str) or len(value) <= 60 else Decimal("nan")
    except InvalidOperation:
        number = Decimal("nan")
    if not number.is_finite():
        raise Bad(path, "not a decimal number")
    exponent = number.as_tuple().exponent
    assert isinstance(exponent, int)
    if -exponent > data_type.scale and number != number.quantize(Decimal(1).scaleb(-data_type.scale)):
        raise Bad(path, f"{value} has more than {data_type.scale} decimal places")
    whole = data_type.precision - data_type.scale
    if abs(number) >= Decimal(10) ** whole:
        raise Bad(path, f"{value} does not fit decimal({data_type.precision}, {data_type.scale})")
    return number.quantize(Decimal(1).scaleb(-data_type.scale))


def _timestamp(value: Any, path: str) -> datetime:
    if isinstance(value, bool):
        raise Bad(path, "not a timestamp")
    try:
        if isinstance(value, int):
            moment = datetime.fromtimestamp(value / 1000, UTC)
        elif isinstance(value, str) and len(value) <= 40:
            moment = datetime.fromisoformat(value)
            moment = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
            moment = moment.astimezone(UTC)
        else:
            raise ValueError
    except (ValueError, OverflowError, OSError):
        shown = value[:40] if isinstance(value, str) else value
        raise Bad(path, f"not a timestamp (ISO 8601 text or epoch milliseconds): {shown!r}") from None
    return moment


def epoch_ms(value: Any) -> int:
    """A checked event-time value (a timestamp, or a long of epoch milliseconds) in epoch milliseconds."""
    if isinstance(value, datetime):
        moment = value if value.tzinfo else value.replace(tzinfo=UTC)
        return int(moment.timestamp() * 1000)
    return int(value)


def arrow_schema(struct: StructType) -> Any:
    """The Arrow schema Spark expects for these fields, with ``_id`` first."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(
        _nullable(StructType([StructField("_id", StringType(), True), *struct.fields])), timezone="UTC"
    )


def _nullable(data_type: Any) -> Any:
    """The type with every level nullable, as the Spark schema a source declares is (NOT NULL is checked here)."""
    if isinstance(data_type, StructType):
        return StructType([StructField(f.name, _nullable(f.dataType), True) for f in data_type.fields])
    if isinstance(data_type, ArrayType):
        return ArrayType(_nullable(data_type.elementType), True)
    if isinstance(data_type, MapType):
        return MapType(data_type.keyType, _nullable(data_type.valueType), True)
    return data_type
