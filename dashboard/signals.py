"""Logins and logouts go to the audit trail, failures included (they are what login throttling counts)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.signals import user_logged_in, user_logged_out, user_login_failed
from django.dispatch import receiver

from dashboard.services.audit import audit_record, login_name


@receiver(user_logged_in)
def _logged_in(sender: Any, request: Any, user: Any, **kwargs: Any) -> None:
    audit_record(request, verb="login", user=user, outcome="succeeded")


@receiver(user_login_failed)
def _login_failed(sender: Any, credentials: dict[str, Any], request: Any = None, **kwargs: Any) -> None:
    name = str(credentials.get("username", ""))[:150]
    # the entry's user name is the name tried, normalised: login throttling counts it per name (the target keeps it
    # as typed)
    audit_record(request, verb="login", username=login_name(name), target=name, outcome="failed", origin="anonymous")


@receiver(user_logged_out)
def _logged_out(sender: Any, request: Any, user: Any, **kwargs: Any) -> None:
    if user is not None:
        audit_record(request, verb="logout", user=user, outcome="succeeded")
