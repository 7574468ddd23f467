"""The pages' role checks: a view that needs a role refuses with the 403 page and a line in the audit trail. The
roles themselves are dashboard/access.py's; the API checks them in dashboard/api/views.py (``endpoint``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.http.response import HttpResponseBase
from django.shortcuts import render

from dashboard.access import refusal
from dashboard.services.audit import audit_record


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
