"""The running driver's liveness lock: a PostgreSQL session-level advisory lock per job, held on a connection of its
own for the whole life of the driver process. When the process dies, however it dies (kill -9 included), the kernel
closes the connection and PostgreSQL frees the lock at once: a standby blocked on it wakes within milliseconds, with
no polling beat. The lock only says "the holder's process is gone"; the lease and its fencing token stay the
authority on who may write."""

from __future__ import annotations

import time
from typing import Any

import psycopg
from django.conf import settings
from django.db import connection

LOCK_CLASS = 0x5354_4B50  # "STKP": the first key of the two-key advisory lock; the job's id is the second


def lock_connection() -> psycopg.Connection[Any]:
    """A connection of its own (never Django's, which other threads use and Django may close between requests)."""
    db = {key: str(value or "") for key, value in settings.DATABASES["default"].items() if isinstance(value, str | int)}
    return psycopg.connect(
        host=db.get("HOST") or None,
        port=db.get("PORT") or None,
        dbname=db.get("NAME"),
        user=db.get("USER") or None,
        password=db.get("PASSWORD") or None,
        autocommit=True,
        application_name="statekeeper-job-lock",
    )


def supported() -> bool:
    return connection.vendor == "postgresql"


def hold(job_id: int, within_seconds: float = 30.0) -> psycopg.Connection[Any] | None:
    """Take the job's lock for this process (a standby that is checking on the previous holder lets go within
    milliseconds); the connection must stay open for as long as the lock is held. None on SQLite."""
    if not supported():
        return None
    conn = lock_connection()
    deadline = time.monotonic() + within_seconds
    while not conn.execute("SELECT pg_try_advisory_lock(%s, %s)", [LOCK_CLASS, job_id]).fetchone()[0]:  # type: ignore[index]
        if time.monotonic() > deadline:
            conn.close()
            raise TimeoutError(f"job {job_id}'s driver lock was not free within {within_seconds:.0f} s")
        time.sleep(0.05)
    return conn


def wait(conn: psycopg.Connection[Any], job_id: int, timeout_seconds: float) -> bool:
    """Block until the job's lock is free and take it (True), or give up after the timeout (False)."""
    conn.execute(f"SET lock_timeout = '{int(timeout_seconds * 1000)}ms'")
    try:
        conn.execute("SELECT pg_advisory_lock(%s, %s)", [LOCK_CLASS, job_id])
    except psycopg.errors.LockNotAvailable:
        return False
    return True


def release(conn: psycopg.Connection[Any], job_id: int) -> None:
    conn.execute("SELECT pg_advisory_unlock(%s, %s)", [LOCK_CLASS, job_id])
