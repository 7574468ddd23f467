"""A job's dead letters, read from their Redis stream: newest first, in keyset pages, and whole for an export."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async

from dashboard.connections import redis_client
from dashboard.models import Job

PREVIEW = 300


@dataclass
class DeadLetter:
    id: str  # the dead-letter entry's id
    entry: str  # the source entry's id (or batch-N:kind:digest for a result the sink refused)
    stage: str
    reason: str
    payload: bytes

    @property
    def preview(self) -> str:
        text = self.payload[: PREVIEW * 4].decode("utf-8", "replace")
        return text[:PREVIEW] + ("…" if len(self.payload) > PREVIEW else "")

    def as_json(self) -> dict[str, Any]:
        try:
            payload: dict[str, str] = {"payload": self.payload.decode("utf-8")}
        except UnicodeDecodeError:  # kept as sent: invalid UTF-8 is exported as base64
            payload = {"payload_base64": base64.b64encode(self.payload).decode()}
        return {"id": self.id, "entry": self.entry, "stage": self.stage, "reason": self.reason, **payload}


def _letter(entry_id: bytes, fields: dict[bytes, bytes]) -> DeadLetter:
    def text(key: bytes) -> str:
        return fields.get(key, b"").decode("utf-8", "replace")

    return DeadLetter(
        entry_id.decode(), text(b"entry"), text(b"stage") or "parse", text(b"reason"), fields.get(b"payload", b"")
    )


@dataclass
class DeadLetterPage:
    letters: list[DeadLetter]
    total: int
    older: str | None  # pass as ?before= for the next page


def dead_letter_page(job: Job, before: str | None = None, per_page: int = 50) -> DeadLetterPage:
    client = redis_client()
    newest = f"({before}" if before else "+"
    rows = client.xrevrange(job.dead_letter_stream, max=newest, min="-", count=per_page + 1)
    letters = [_letter(i, f) for i, f in rows[:per_page]]
    older = letters[-1].id if len(rows) > per_page else None
    return DeadLetterPage(letters, int(client.xlen(job.dead_letter_stream)), older)


async def dead_letters_export(job: Job, page: int = 50) -> AsyncIterator[str]:
    """Every dead letter as a JSON line, oldest first, a page at a time, asynchronously: under ASGI the response is
    sent as it is read (a synchronous iterator would be read whole first: up to 100,000 letters of up to 1 MiB)."""
    client = redis_client(timeout=10)
    read = sync_to_async(client.xrange, thread_sensitive=False)
    after = "-"
    while rows := await read(job.dead_letter_stream, min=after, max="+", count=page):
        for entry_id, fields in rows:
            yield json.dumps(_letter(entry_id, fields).as_json()) + "\n"
        if len(rows) < page:
            return
        after = f"({rows[-1][0].decode()}"
