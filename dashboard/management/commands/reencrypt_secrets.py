"""Re-encrypt every secret with the first key of STATEKEEPER_SECRETS_KEY: the step between putting a new key first
(``NEW,OLD``) and taking the old one out, so that no value has to be in anyone's hands to rotate the key."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError

from dashboard.services.audit import audit_record
from dashboard.services.secrets import secrets_reencrypt


class Command(BaseCommand):
    help = "Re-encrypt every secret with the first key of STATEKEEPER_SECRETS_KEY (rotating the key); no value shown."

    def handle(self, *args: Any, **opts: Any) -> None:
        done, unreadable = secrets_reencrypt()
        audit_record(None, verb="secrets-reencrypt", outcome="failed" if unreadable else "succeeded", origin="system",
                     params={"reencrypted": done, "unreadable": unreadable})  # fmt: skip
        self.stdout.write(f"{done} secret(s) re-encrypted with the first key of STATEKEEPER_SECRETS_KEY.")
        if unreadable:
            raise CommandError(
                f"{len(unreadable)} secret(s) cannot be read with any current key ({', '.join(unreadable)}): the key "
                "they were set with is not in STATEKEEPER_SECRETS_KEY. Put it back (after the first) and run this "
                "again, or set them again."
            )
