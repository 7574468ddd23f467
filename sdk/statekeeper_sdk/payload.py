"""How a pipeline's events are described: JSON objects or a regex's named groups, with their fields either flat
(``Field``: string, long, double) or as a Spark schema (DDL text, nested types allowed)::

    PayloadFormat("json", schema="order_id string NOT NULL, items array<struct<sku: string, qty: int>>")
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pyspark.sql.types import LongType, StructType, TimestampNTZType, TimestampType

from statekeeper_sdk._runtime.nested import SchemaError, parse_ddl, to_ddl

FIELD_TYPES = {"string": "string", "long": "bigint", "double": "double"}
FIELD_ALIASES = {"str": "string", "int": "long", "float": "double"}  # a parameter's words for the same types


@dataclass(frozen=True)
class Field:
    """A flat payload field: text, a whole number or a number. Its type is written in Spark's words (``string``,
    ``long``, ``double``) or in a parameter's (``str``, ``int``, ``float``): one vocabulary for both (1.3)."""

    name: str
    type: str  # "string" | "long" | "double" (or "str" | "int" | "float")
    required: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", FIELD_ALIASES.get(self.type, self.type))


@dataclass(frozen=True)
class PayloadFormat:
    """How the payload (a Redis entry's ``v`` field, a file's line, a Kafka value) is parsed.

    ``fields`` (flat, checked in bulk) or ``schema`` (Spark DDL, checked event by event; JSON only). ``event_time``
    names a top-level field holding the event time (a long of epoch milliseconds, or a timestamp with a schema): it
    is bounded against the event's arrival so that no event can move the watermark far ahead."""

    kind: str  # "json" | "regex"
    fields: tuple[Field, ...] = ()
    pattern: str = ""
    event_time: str = ""
    schema: str = ""

    def __post_init__(self) -> None:
        if self.kind not in ("json", "regex"):
            raise SchemaError(f"a payload is parsed as json or regex, not {self.kind!r}")
        if bool(self.fields) == bool(self.schema):
            raise SchemaError("a payload has either fields or a schema (one of the two)")
        if self.schema and self.kind != "json":
            raise SchemaError("a schema describes JSON payloads; a regex's groups are flat fields")
        for f in self.fields:
            if f.type not in FIELD_TYPES:
                raise SchemaError(f"field {f.name!r}: a flat field is string, long or double, not {f.type!r}")
        if self.event_time:
            found = next((f for f in self.struct.fields if f.name == self.event_time), None)
            allowed = (LongType, TimestampType, TimestampNTZType)
            if found is None or not isinstance(found.dataType, allowed):
                raise SchemaError(f"event_time {self.event_time!r} must name a top-level long or timestamp field")

    @property
    def nested(self) -> bool:
        return bool(self.schema)

    @property
    def struct(self) -> StructType:
        """The payload's fields as a Spark schema (flat fields too: a required one is NOT NULL)."""
        if self.schema:
            return parse_ddl(self.schema)
        return parse_ddl(", ".join(f"`{f.name}` {FIELD_TYPES[f.type]}{'' if not f.required else ' NOT NULL'}"
                                   for f in self.fields))  # fmt: skip

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.struct.fields]

    def columns(self) -> str:
        """The payload's fields as Spark DDL (without ``_id``)."""
        return to_ddl(self.struct)

    def spark_schema(self) -> str:
        """The rows a source gives the pipeline: ``_id`` (the event's id in its source), then the payload's fields."""
        return "_id string, " + self.columns()

    def to_option(self) -> str:
        return json.dumps(
            {
                "kind": self.kind,
                "pattern": self.pattern,
                "event_time": self.event_time,
                "fields": [[f.name, f.type, f.required] for f in self.fields],
                "schema": self.schema,
            }
        )

    @classmethod
    def from_option(cls, text: str) -> PayloadFormat:
        raw = json.loads(text)
        fields = tuple(Field(n, t, r) for n, t, r in raw["fields"])
        return cls(raw["kind"], fields, raw.get("pattern", ""), raw.get("event_time", ""), raw.get("schema", ""))
