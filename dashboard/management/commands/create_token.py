"""Create an API token for a user and print its key (shown once)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from dashboard.api.tokens import token_create


class Command(BaseCommand):
    help = "Create an API token: create_token USER NAME. The token acts with the user's role."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("user")
        parser.add_argument("name")

    def handle(self, *args: Any, **opts: Any) -> None:
        user = get_user_model().objects.filter(username=opts["user"]).first()
        if user is None:
            raise CommandError(f"no user {opts['user']!r}")
        token, key = token_create(user=user, name=opts["name"])
        self.stdout.write(f"token {token.name} for {user.get_username()}: {key}")
        self.stdout.write("Keep it: it is not stored and cannot be shown again.")
