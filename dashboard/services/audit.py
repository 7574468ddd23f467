"""The audit trail: who did what, when, from where, with which parameters, and how it ended. Append-only: entries are
never updated or deleted (the model refuses, and on PostgreSQL a trigger refuses too)."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from django.http import HttpRequest

from dashboard.models import AuditEntry


def client_address(request: HttpRequest | None) -> str:
    # REMOTE_ADDR only: X-Forwarded-For is the client's to write, so it is not evidence
    return str(request.META.get("REMOTE_ADDR", "")) if request is not None else ""


def audit_record(
    request: HttpRequest | None,
    *,
    verb: str,
    job: str = "",
    target: str = "",
    params: dict[str, Any] | None = None,
    outcome: str = "",
    message: str = "",
    user: Any = None,
    origin: str = "",
    username: str = "",
) -> AuditEntry:
    user = user if user is not None else getattr(request, "user", None)
    authenticated = bool(user is not None and getattr(user, "is_authenticated", False))
    return AuditEntry.objects.create(
        user_id=user.pk if authenticated else None,
        username=user.get_username() if authenticated else username,
        address=client_address(request),
        origin=origin or ("user" if authenticated else "anonymous"),
        verb=verb,
        job=job,
        target=target[:500],
        params=params or {},
        outcome=outcome,
        message=message[:2000],
    )


def audit_filter(*, job: str = "", user: str = "", since: datetime | None = None, until: datetime | None = None) -> Any:
    entries = AuditEntry.objects.order_by("-at", "-id")
    if job:
        entries = entries.filter(job=job)
    if user:
        entries = entries.filter(username=user)
    if since:
        entries = entries.filter(at__gte=since)
    if until:
        entries = entries.filter(at__lt=until)
    return entries


COLUMNS = ("id", "at", "username", "address", "origin", "verb", "job", "target", "params", "outcome", "message")


class _Echo:
    def write(self, value: str) -> str:
        return value


def audit_csv(entries: Any) -> Iterator[str]:
    """CSV rows, streamed: an export of a year of entries never sits in memory."""
    writer = csv.writer(_Echo())
    yield writer.writerow(COLUMNS)
    for e in entries.iterator(chunk_size=2000):
        yield writer.writerow(
            [
                e.id,
                e.at.isoformat(),
                e.username,
                e.address,
                e.origin,
                e.verb,
                e.job,
                e.target,
                json.dumps(e.params, sort_keys=True),
                e.outcome,
                e.message,
            ]
        )
