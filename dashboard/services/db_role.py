"""The database role the running console connects as.

The owner of the tables (the user `migrate` runs as) could disable the audit trail's trigger or truncate it; the app
must not be able to. After every migration the owner (re)creates the app role and grants it SELECT, INSERT, UPDATE
and DELETE on every table and the use of every sequence, except on the audit trail: SELECT and INSERT only. The app
role owns nothing, so it can neither ALTER the table (DISABLE TRIGGER) nor TRUNCATE it. PostgreSQL only: SQLite is
for development and has no roles.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from django.conf import settings
from django.db import connections
from psycopg import sql

log = logging.getLogger(__name__)
AUDIT_TABLE = "dashboard_auditentry"


def app_role_problem(using: str = "default") -> str:
    """Why the app role could not be set up on this database, or ''."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return ""
    role = settings.DB_APP_ROLE
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_user, rolcreaterole OR rolsuper FROM pg_roles WHERE rolname = current_user")
        current, may_create = cursor.fetchone()
        if current == role:
            return ""  # migrating as the app role itself: nothing it may grant
        cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role])
        exists = cursor.fetchone() is not None
        if not exists and not may_create:
            return f"the role {role!r} does not exist and {current!r} may not create roles: create it (LOGIN) as a superuser"
        name = sql.Identifier(role)
        statements: list[Any] = []
        if not exists:  # roles are cluster-wide: another database's migration may create it at the same moment
            statements.append(
                sql.SQL("DO $$ BEGIN CREATE ROLE {} LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$").format(
                    name
                )
            )
        if settings.DB_APP_PASSWORD and may_create:
            statements.append(sql.SQL("ALTER ROLE {} PASSWORD {}").format(name, sql.Literal(settings.DB_APP_PASSWORD)))
        statements += [
            sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(name),
            sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {}").format(name),
            sql.SQL("GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO {}").format(name),
            sql.SQL("REVOKE UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER ON {} FROM {}").format(
                sql.Identifier(AUDIT_TABLE), name
            ),
        ]
        for statement in statements:
            cursor.execute(statement.as_string(cursor.connection))
    return ""


def grant_after_migrate(sender: Any, using: str = "default", **kwargs: Any) -> None:
    """post_migrate receiver: every table a migration added is granted at once."""
    if problem := app_role_problem(using):
        log.warning("audit protection not set up: %s", problem)
        sys.stderr.write(f"WARNING: audit protection not set up: {problem}\n")
