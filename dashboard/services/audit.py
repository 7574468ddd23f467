"""The audit trail: who did what, when, from where, with which parameters, and how it ended. Append-only: entries are
never updated or deleted (the model refuses, and on PostgreSQL a trigger refuses too)."""

from __future__ import annotations

import csv
import json
import unicodedata
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import Max
from django.http import HttpRequest
from django.utils import timezone

from dashboard.models import AuditEntry
from dashboard.services.secrets import mask_passwords, masked


def client_address(request: HttpRequest | None) -> str:
    """The client's address: REMOTE_ADDR, unless that is one of STATEKEEPER_TRUSTED_PROXIES; then the nearest address
    in X-Forwarded-For that is not a trusted proxy (the rest of that header is the client's to write)."""
    if request is None:
        return ""
    address = str(request.META.get("REMOTE_ADDR", ""))
    trusted = settings.TRUSTED_PROXIES
    if address not in trusted:
        return address
    hops = [h.strip() for h in str(request.META.get("HTTP_X_FORWARDED_FOR", "")).split(",") if h.strip()]
    for hop in reversed(hops):
        if hop not in trusted:
            return hop[:100]
    return address


def login_name(raw: str) -> str:
    """A user name as login throttling counts it: trailing spaces, case and Unicode forms are one name."""
    return unicodedata.normalize("NFKC", raw).strip().casefold()[:150]


def storable(value: Any) -> Any:
    """The value as PostgreSQL can keep it: a lone surrogate or a NUL in any string (a key too) written as its escape."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8").replace("\x00", "\\x00")
    if isinstance(value, dict):
        return {storable(str(k)): storable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(v) for v in value]
    return value


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
        job=storable(job)[:63],
        target=storable(mask_passwords(target))[:500],
        params=storable(masked(params or {})),
        outcome=outcome,
        message=storable(mask_passwords(message))[:2000],
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


def audit_row(e: AuditEntry) -> list[Any]:
    return [
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


async def audit_csv(entries: Any, cap: int) -> AsyncIterator[str]:
    """CSV rows, newest first, at most `cap` of them, streamed asynchronously: under ASGI a synchronous iterator would
    be read whole into memory before the first byte is sent, and would hold a worker thread for the whole export."""
    writer = csv.writer(_Echo())
    yield writer.writerow(COLUMNS)
    async for e in entries[:cap].aiterator(chunk_size=2000):
        yield writer.writerow(audit_row(e))


def login_lockout(username: str, address: str) -> int:
    """Seconds until this user name or address may try again; 0 when it may. Failures are counted from the audit
    trail (durable: a restart forgets nothing), for a user name since its last successful login."""
    username = login_name(username)
    now = timezone.now()
    window_start = now - timedelta(seconds=settings.LOGIN_LOCKOUT_SECONDS)
    logins = AuditEntry.objects.filter(verb="login", at__gte=window_start)
    last_success = logins.filter(username__iexact=username, outcome="succeeded").aggregate(at=Max("at"))["at"]
    by_name = logins.filter(username=username, outcome="failed")
    if last_success:
        by_name = by_name.filter(at__gt=last_success)
    waits = []
    for failures in (by_name, logins.filter(address=address, outcome="failed") if address else None):
        if failures is None:
            continue
        recent = list(failures.order_by("-at").values_list("at", flat=True)[: settings.LOGIN_FAILURES_ALLOWED])
        if len(recent) >= settings.LOGIN_FAILURES_ALLOWED:
            waits.append((recent[-1] + timedelta(seconds=settings.LOGIN_LOCKOUT_SECONDS) - now).total_seconds())
    return max(0, int(max(waits, default=0)) + 1) if any(w > 0 for w in waits) else 0
