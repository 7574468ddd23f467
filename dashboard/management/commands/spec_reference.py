from typing import Any

from django.core.management.base import BaseCommand

from dashboard.specs import spec_reference


class Command(BaseCommand):
    help = "Print the job spec reference (docs/specs.md), generated from the form that validates a spec."

    def handle(self, *args: Any, **opts: Any) -> None:
        self.stdout.write(spec_reference(), ending="")
