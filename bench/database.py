"""The console's database for a benchmark: migrated before the benchmark starts anything, as ``bin/dev`` migrates it;
a database that cannot be reached or migrated ends the benchmark with the reason, before any process is started.

A benchmark that starts its own Celery worker and drivers (action_engine, batch_cost, density, failover) runs on a
database of its own (``own_database``): it ends every shared driver and job it finds recorded there, and must not find
those of a console running beside it (``./bin/dev``). Those that measure a running console (memory, demo_stack,
demo_workers) use the console's database."""

from __future__ import annotations

import os
import sys

from django.core.management import call_command
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.migrations.executor import MigrationExecutor
from django.db.utils import Error as DatabaseError

BENCH_DATABASE = "statekeeper_bench"


def own_database() -> None:
    """Before ``django.setup()``: point the benchmark at PostgreSQL's ``statekeeper_bench`` database (made when
    missing) unless DATABASE_URL names one. Its processes inherit the setting."""
    if os.environ.get("DATABASE_URL"):
        return
    import psycopg

    try:
        with psycopg.connect(host="127.0.0.1", port=5432, user="postgres", dbname="postgres", autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [BENCH_DATABASE]).fetchone():
                conn.execute(f'CREATE DATABASE "{BENCH_DATABASE}"')
    except psycopg.Error as exc:
        sys.exit(f"the benchmark's database {BENCH_DATABASE!r} could not be made: {exc}".strip())
    os.environ["DATABASE_URL"] = f"postgres://postgres@127.0.0.1:5432/{BENCH_DATABASE}"


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
