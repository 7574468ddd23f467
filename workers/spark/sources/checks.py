"""The checks every source's rows pass, on an executor: the Redis source's ``parse_entries`` (size, UTF-8, JSON,
required fields, numbers, text bounds, event time against the arrival), with the rejected rows written to the job's
dead-letter stream (each once: a replayed batch rejects them again)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

from statekeeper_sdk import Limits, PayloadFormat, Rejected
from statekeeper_sdk._runtime.events import parse_entries

from workers.spark.sources.redis_streams import dead_letter

# (entry id, [b"v", payload]) pairs to check, the rows already rejected on the way, and where each entry came from
# (entry id -> a place named in its dead letter's reason; empty when the id says enough). Only a rejected entry's
# place is looked up: a mapping that works it out from the id costs nothing for the others.
Entries = tuple[list[tuple[bytes, list[bytes]]], list[Rejected], Mapping[str, str]]


def check_batches(
    batches: Iterator[Any], payload_option: str, limits: Limits, dead_letters: str, redis_url: str,
    entries_of: Callable[[Any], Entries],
) -> Iterator[Any]:  # fmt: skip
    """Arrow batches of a source's rows in, Arrow batches of checked events (``_id`` first) out."""
    import redis

    fmt, client = PayloadFormat.from_option(payload_option), None
    for batch in batches:
        raw, dead, where = entries_of(batch)
        good, rejected = parse_entries(raw, fmt, limits)
        dead += rejected
        dead = [replace(r, reason=f"{r.reason} (in {where[r.entry]})") if r.entry in where else r for r in dead]
        if dead:
            client = client or redis.Redis.from_url(redis_url, socket_timeout=30)
            dead_letter(client, dead_letters, dead)
        if good.num_rows:
            yield good
