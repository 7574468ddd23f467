"""Who may do what: three roles, checked on the server for every request that acts, and a read-only switch.

- viewer: reads every page, chart and report (any logged-in user without a role group)
- operator: also starts and stops jobs, takes savepoints, restores, rolls back, rescales, counts rows, discards
- admin: also creates and edits jobs, and manages users (in Django's admin); superusers are admins

Roles are Django groups named after them. STATEKEEPER_READ_ONLY=1 refuses every action, whatever the role.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest

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


def context(request: HttpRequest) -> dict[str, Any]:
    """For templates: the role, and whether the user may act, so buttons show what the server will allow."""
    user = getattr(request, "user", None)
    return {
        "role": role_of(user),
        "read_only": settings.READ_ONLY,
        "can_operate": not settings.READ_ONLY and may(user, OPERATOR),
        "can_admin": not settings.READ_ONLY and may(user, ADMIN),
    }
