"""What the console tells a pipeline about events it did not take: ``Rejected`` (an entry that went to the dead
letters, with where and why), the ``Limits`` the checks apply, and ``parse_id`` (a Redis stream entry id in its order).

The checks themselves (size, UTF-8, JSON or the regex, the payload's schema, numbers in range, text bounds, an event
time against its arrival) are the console's and the test kit's: a team runs them on its own sample events with
``statekeeper_sdk.testing.run_batches``, whose result lists what was rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

from statekeeper_sdk._moved import to_runtime

MAX_PAYLOAD_BYTES = 1 << 20  # a larger payload is dead-lettered (its first MAX_PAYLOAD_BYTES kept), never parsed
MAX_STRING_CHARS = 400  # a longer text field is dead-lettered: result keys are stored in 500 characters
MAX_FUTURE_SECONDS = 300  # an event time further than this after the entry's arrival would move the watermark


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
    """A Redis stream entry id as (milliseconds, sequence), which sort as the stream orders its entries.

    >>> parse_id("1700000000000-3")
    (1700000000000, 3)
    >>> sorted(["1700000000001-0", "1700000000000-12", "1700000000000-2"], key=parse_id)[0]
    '1700000000000-2'
    """
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


# moved to statekeeper_sdk._runtime.events in 1.7
__getattr__ = to_runtime(__name__, {"parse_entries", "text_of"})
