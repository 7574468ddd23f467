"""Passwords that 0030 did not recognise leave every place that showed them, as 0030 moved the others: quoted
libpq values (``password='…'``), ``password="…"`` (Kafka's SASL JAAS config), ``sslpassword=``, ``pwd=``,
``PGPASSWORD=`` and JDBC's ``&password=…`` / ``;password=…;``. Where jobs run with them they move into secrets (a
quoted one keeps its quotes around the reference); in history they become ***.

Self-contained as 0030 is: the patterns are those of statekeeper_sdk._passwords on the day this landed.
"""

import importlib
import re

from django.db import migrations

_KEY = r"(?<![A-Za-z0-9_])(?:ssl|pg)?(?:password|passwd|pwd)\s*=\s*"
PATTERNS = (
    re.compile(r"(?P<lead>://[^/\s:@]*:)(?P<password>[^@\s]+)(?P<tail>@)"),
    re.compile(rf"(?P<lead>{_KEY}')(?P<password>(?:[^'\\]|\\.)*)(?P<tail>')", re.IGNORECASE),
    re.compile(rf'(?P<lead>{_KEY}")(?P<password>(?:[^"\\]|\\.)*)(?P<tail>")', re.IGNORECASE),
    re.compile(rf"(?P<lead>{_KEY})(?P<password>[^\s'\";&]+)(?P<tail>)", re.IGNORECASE),
)


def forward(apps, schema_editor):
    moved = importlib.import_module("dashboard.migrations.0030_move_inline_passwords_to_secrets")
    moved.forward(apps, schema_editor, PATTERNS)


class Migration(migrations.Migration):
    dependencies = [("dashboard", "0038_action_asked_and_aborted")]

    operations = [migrations.RunPython(forward, migrations.RunPython.noop)]
