"""Sample payloads for a pipeline that has no demo generator: its package's own JSON-lines file, or events made
from its payload's schema (a standby warms the pipeline's Python workers up on them; nothing is written anywhere)."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    MapType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)
from statekeeper_sdk._runtime.nested import INTEGER_RANGE


def sample_events(pipeline: Any, rng: random.Random) -> Callable[[int], str]:
    """now_ms -> one payload: the pipeline's generator, else its samples file (in turn), else one made from its
    schema (a regex payload without either has no form to make one from: ValueError)."""
    if getattr(pipeline, "generator", None) is not None:
        return pipeline.generator(rng)
    struct, event_time = pipeline.payload.struct, pipeline.payload.event_time
    if lines := _sample_lines(pipeline):
        at = iter(range(1 << 62))

        def sample(now_ms: int) -> str:
            line = lines[next(at) % len(lines)]
            if not event_time or pipeline.payload.kind != "json":
                return line
            value = json.loads(line)  # a sample's event time is now, or the watermark would drop it as late
            if isinstance(value, dict):
                value[event_time] = now_ms if "long" in str(struct[event_time].dataType).lower() else _iso(now_ms)
            return json.dumps(value)

        return sample
    if pipeline.payload.kind != "json":
        raise ValueError(f"{pipeline.name} parses {pipeline.payload.kind} and has neither a generator nor samples")

    def event(now_ms: int) -> str:
        value = _made(struct, rng, now_ms, 0)
        if event_time:
            value[event_time] = now_ms if "long" in str(struct[event_time].dataType).lower() else _iso(now_ms)
        return json.dumps(value)

    return event


def _sample_lines(pipeline: Any) -> list[str]:
    name = getattr(pipeline, "samples", "")
    if not name:
        return []
    path = Path(name)
    if not path.is_absolute():
        module = sys.modules.get(getattr(pipeline.transform, "__module__", ""), None)
        path = Path(module.__file__).parent / name if module and module.__file__ else path
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _iso(now_ms: int) -> str:
    return datetime.fromtimestamp(now_ms / 1000, UTC).isoformat()


def _made(data_type: DataType, rng: random.Random, now_ms: int, depth: int) -> Any:
    if isinstance(data_type, StructType):
        return {f.name: _made(f.dataType, rng, now_ms, depth + 1) for f in data_type.fields}
    if isinstance(data_type, ArrayType):
        return [_made(data_type.elementType, rng, now_ms, depth + 1) for _ in range(rng.randrange(1, 4))]
    if isinstance(data_type, MapType):
        return {f"k{i}": _made(data_type.valueType, rng, now_ms, depth + 1) for i in range(rng.randrange(1, 3))}
    if isinstance(data_type, StringType):
        return f"s{rng.randrange(20)}"
    if isinstance(data_type, BooleanType):
        return rng.random() < 0.5
    if type(data_type) in INTEGER_RANGE:
        return rng.randrange(0, 100)
    if isinstance(data_type, (DoubleType, FloatType)):
        return round(rng.uniform(0, 100), 2)
    if isinstance(data_type, DecimalType):
        return round(rng.uniform(0, min(10 ** (data_type.precision - data_type.scale) - 1, 1000)), data_type.scale)
    if isinstance(data_type, (TimestampType, TimestampNTZType)):
        return _iso(now_ms)
    if isinstance(data_type, DateType):
        return _iso(now_ms)[:10]
    return None
