"""Create the console's admin login if it does not exist, and print it."""

from __future__ import annotations

import os
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Create the admin login (STATEKEEPER_ADMIN_USER / STATEKEEPER_ADMIN_PASSWORD) if missing."

    def handle(self, *args: Any, **opts: Any) -> None:
        username = os.environ.get("STATEKEEPER_ADMIN_USER", "admin")
        password = os.environ.get("STATEKEEPER_ADMIN_PASSWORD", "statekeeper")
        user_model = get_user_model()
        if not user_model.objects.filter(username=username).exists():
            user_model.objects.create_superuser(username=username, email="", password=password)
            self.stdout.write(f"login: {username} / {password}")
        else:
            self.stdout.write(f"login: {username} (existing user; password unchanged)")
