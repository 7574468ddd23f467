"""The console's database for a benchmark: migrated before the benchmark starts anything, as ``bin/dev`` migrates it;
a database that cannot be reached or migrated ends the benchmark with the reason, before any process is started."""

from __future__ import annotations

import sys

from django.core.management import call_command
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor
from django.db.utils import Error as DatabaseError


def migrated() -> None:
    """Apply the console's migrations that this database lacks (saying how many), or exit with why it cannot."""
    connection = connections[DEFAULT_DB_ALIAS]
    name = connection.settings_dict.get("NAME")
    try:
        executor = MigrationExecutor(connection)
        missing = executor.migration_plan(executor.loader.graph.leaf_nodes())
        if missing:
            print(f"the console's database {name!r} lacks {len(missing)} migration(s): migrating it first", flush=True)
            call_command("migrate", interactive=False, verbosity=0)
    except DatabaseError as exc:
        sys.exit(f"the benchmark needs the console's database {name!r}, which cannot be used: {exc}".strip())
