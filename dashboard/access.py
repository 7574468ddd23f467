"""Who may do what: three roles, checked on the server for every request that acts, and a read-only switch.

- viewer: reads every page, chart and report (any logged-in user without a role group)
- operator: also starts and stops jobs, takes savepoints, restores, rolls back, rescales, counts rows, discards
- admin: also creates and edits jobs, and manages users (in Django's admin); superusers are admins

Roles are Django groups named after them. STATEKEEPER_READ_ONLY=1 refuses every action, whatever the role.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.db.models import Max
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.shortcuts import render
from django.utils import timezone

from dashboard.models import AuditEntry
from dashboard.services.audit import audit_record, login_name

VIEWER, OPERATOR, ADMIN = "viewer", "operator", "admin"
ROLES = (VIEWER, OPERATOR, ADMIN)


def role_of(user: Any) -> str:
    if not getattr(user, "is_authenticated", False):
        return ""
    if user.is_superuser:
        return ADMIN
    names = {g.name for g in user.groups.all()}
    for role in reversed(ROLES):
        if role in names:
            return role
    return VIEWER


def may(user: Any, needed: str) -> bool:
    role = role_of(user)
    return bool(role) and ROLES.index(role) >= ROLES.index(needed)


def refusal(user: Any, needed: str) -> str:
    """Why this user may not act now; empty when they may."""
    if settings.READ_ONLY:
        return "The console is read-only (STATEKEEPER_READ_ONLY): every action is off."
    if not may(user, needed):
        return f"This needs the {needed} role; {user.get_username()} is {role_of(user) or 'not logged in'}."
    return ""


def forbidden(request: HttpRequest, reason: str) -> HttpResponse:
    audit_record(request, verb="denied", target=request.path, outcome="denied", message=reason)
    return render(request, "403.html", {"reason": reason}, status=403)


def requires(
    needed: str, methods: tuple[str, ...] | None = None
) -> Callable[[Callable[..., HttpResponseBase]], Callable[..., HttpResponseBase]]:
    """Login, then the role (and, for anything above viewer, not read-only); 403 with the reason otherwise. With
    `methods`, the role is checked only for those (a page anyone may read that an operator acts from)."""

    def decorate(view: Callable[..., HttpResponseBase]) -> Callable[..., HttpResponseBase]:
        @login_required
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
            checked = methods is None or request.method in methods
            if checked and (reason := refusal(request.user, needed)):
                return forbidden(request, reason)
            return view(request, *args, **kwargs)

        return wrapped

    return decorate


def context(request: HttpRequest) -> dict[str, Any]:
    """For templates: the role, and whether the user may act, so buttons show what the server will allow."""
    user = getattr(request, "user", None)
    return {
        "role": role_of(user),
        "read_only": settings.READ_ONLY,
        "can_operate": not settings.READ_ONLY and may(user, OPERATOR),
        "can_admin": not settings.READ_ONLY and may(user, ADMIN),
    }


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
