"""The browsers' live stream (a Redis stream the pages follow by server-sent events): one message shape, written by
the drivers (each committed batch), the console's incidents and its source-lag samples alike."""

from __future__ import annotations

import json
from typing import Any

LIVE_MAX_ENTRIES = 50_000  # what the stream keeps: a page that reconnects within minutes misses nothing


def live_message(job_id: int, **parts: Any) -> str:
    """A message of the live stream: the job, and one of ``record`` (a checkpoint, with its ``run``), ``incident`` or
    ``source`` (a lag sample)."""
    return json.dumps({"job": job_id, **parts}, separators=(",", ":"), default=str)


def live_add(pipe: Any, stream: str, line: str) -> None:
    """Queue ``line`` on the live ``stream`` in a Redis pipeline (or client), kept to LIVE_MAX_ENTRIES."""
    pipe.xadd(stream, {"data": line}, maxlen=LIVE_MAX_ENTRIES, approximate=True)
