"""Create the console's admin login if it does not exist. No password is known in advance: without
STATEKEEPER_ADMIN_PASSWORD a random one is made, printed once on the operator's own terminal, and kept in
var/admin-password, readable by the owner only."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError


def password_file() -> Path:
    return Path(os.environ.get("STATEKEEPER_ADMIN_PASSWORD_FILE", settings.BASE_DIR / "var" / "admin-password"))


def keep(password: str, path: Path) -> None:
    """Write the password where only this user can read it (created 0600, never widened)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(password + "\n")
    os.chmod(path, 0o600)


class Command(BaseCommand):
    help = "Create the admin login (STATEKEEPER_ADMIN_USER; STATEKEEPER_ADMIN_PASSWORD or a random one) if missing."

    def handle(self, *args: Any, **opts: Any) -> None:
        username = os.environ.get("STATEKEEPER_ADMIN_USER", "admin")
        given = os.environ.get("STATEKEEPER_ADMIN_PASSWORD", "")
        user_model = get_user_model()
        stored = password_file()
        if user_model.objects.filter(username=username).exists():
            where = f"; the generated one is in {stored}" if stored.exists() else ""
            self.stdout.write(f"login: {username} (existing user; password unchanged{where})")
            return
        if given:
            try:
                validate_password(given, user_model(username=username))
            except ValidationError as exc:
                raise CommandError(f"STATEKEEPER_ADMIN_PASSWORD is too weak: {' '.join(exc.messages)}") from None
        password = given or secrets.token_urlsafe(18)
        user_model.objects.create_superuser(username=username, email="", password=password)
        if given:
            self.stdout.write(f"login: {username} (the password in STATEKEEPER_ADMIN_PASSWORD)")
            return
        keep(password, stored)
        self.stdout.write(f"login: {username} / {password}  (kept in {stored}, readable only by you)")
