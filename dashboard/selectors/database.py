"""The console's own database as the capacity review shows it: its size, its largest tables, and whether PostgreSQL's
autovacuum runs (without it every table the console updates grows with dead rows for good)."""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db import connection

TABLES_SHOWN = 6


@dataclass
class ConsoleDatabase:
    engine: str
    size_bytes: int | None = None
    tables: list[tuple[str, int, int]] = field(default_factory=list)  # (table, bytes, dead rows), largest first
    autovacuum: bool | None = None  # None: not PostgreSQL, or not readable

    @property
    def warning(self) -> str:
        if self.autovacuum is False:
            return (
                "PostgreSQL's autovacuum is off on this server: every table the console updates (results, undo records, "
                "jobs) keeps its dead rows and grows for good. Turn it on (ALTER SYSTEM SET autovacuum = on; SELECT "
                "pg_reload_conf()); ./bin/dev does so for a server it can."
            )
        return ""


def console_database() -> ConsoleDatabase:
    found = ConsoleDatabase(connection.vendor)
    if connection.vendor != "postgresql":
        return found
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_database_size(current_database()), current_setting('autovacuum')")
        size, autovacuum = cursor.fetchone()
        cursor.execute(
            "SELECT relname, pg_total_relation_size(relid), n_dead_tup FROM pg_stat_user_tables "
            "WHERE schemaname = 'public' ORDER BY 2 DESC NULLS LAST LIMIT %s",
            [TABLES_SHOWN],
        )
        found.tables = [(name, int(size_ or 0), int(dead or 0)) for name, size_, dead in cursor.fetchall()]
    found.size_bytes, found.autovacuum = int(size), autovacuum == "on"
    return found
