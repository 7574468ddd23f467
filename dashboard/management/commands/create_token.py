"""Create an API token for a user and print its key (shown once).

``create_token USER NAME`` for a user who exists; ``--role operator`` (or viewer, admin) also makes a token-only user
of that name and role when there is none (no password: it cannot log in to the pages). Where a script captures the
output (``STATEKEEPER_TOKEN=$(./manage.py create_token deployer ci --role operator)``), or with ``--quiet``, standard
output holds the key alone and the sentence about it goes to standard error."""

from __future__ import annotations

import sys
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from dashboard.access import ROLES, role_of
from dashboard.api.tokens import token_create
from dashboard.services.audit import audit_record


class Command(BaseCommand):
    help = (
        "Create an API token: create_token USER NAME [--role ROLE] [--quiet]. The token acts with the user's role; "
        "--role makes the user (token-only, that role) when there is none."
    )

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("user")
        parser.add_argument("name")
        parser.add_argument(
            "--role", choices=ROLES, help="make USER, with this role, if there is no such user (a token-only login)"
        )
        parser.add_argument("--quiet", action="store_true", help="print the key alone (the default when captured)")

    def handle(self, *args: Any, **opts: Any) -> None:
        username, role = opts["user"], opts["role"]
        users = get_user_model()
        with transaction.atomic():
            user = users.objects.filter(username=username).first()
            made = False
            if user is None:
                if role is None:
                    raise CommandError(
                        f"no user {username!r}: add --role operator (or viewer, admin) to make a token-only user of "
                        "that name and role, or create the user in the admin (/admin/)"
                    )
                user = users.objects.create_user(username)  # no usable password: it acts through tokens only
                user.groups.add(Group.objects.get_or_create(name=role)[0])
                made = True
            elif role is not None and role_of(user) != role:
                raise CommandError(
                    f"{username} exists with the {role_of(user)} role, not {role}: a token has its user's role; "
                    "change the role in the admin (/admin/), or leave out --role"
                )
            token, key = token_create(user=user, name=opts["name"])
        audit_record(None, verb="token-create", target=f"token {token.name} of {username}",
                     params={"user": username, "role": role_of(user), "user_created": made}, outcome="succeeded",
                     origin="cli")  # fmt: skip
        said = (
            f"made user {username} ({role}, token-only); " if made else ""
        ) + f"token {token.name} for {username} ({role_of(user)}). Keep it: it is not stored and cannot be shown again."
        if opts["quiet"] or not self.stdout.isatty():
            self.stdout.write(key)
            sys.stderr.write(said + "\n")
        else:
            self.stdout.write(f"{said}\n{key}")
