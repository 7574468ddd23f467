"""Bearer tokens: `Authorization: Bearer sk_…`. Only the SHA-256 of a key is stored."""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from django.http import HttpRequest
from django.utils import timezone

from dashboard.models import ApiToken


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def token_create(*, user: Any, name: str) -> tuple[ApiToken, str]:
    """A new token and its key; the key is not stored and cannot be shown again."""
    key = "sk_" + secrets.token_urlsafe(32)
    token = ApiToken.objects.create(user=user, name=name, prefix=key[:10], key_hash=_digest(key))
    return token, key


def token_user(request: HttpRequest) -> Any:
    """The active user a valid bearer token acts as; None without one (or with a revoked or unknown one)."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    token = (
        ApiToken.objects.select_related("user")
        .filter(key_hash=_digest(key.strip()), revoked_at__isnull=True, user__is_active=True)
        .first()
    )
    if token is None:
        return None
    ApiToken.objects.filter(id=token.id).update(last_used_at=timezone.now())
    return token.user
