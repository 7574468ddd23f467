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


def hold(job_id: int, within_seconds: float = 30.0, grace_seconds: float = 2.0) -> psycopg.Connection[Any] | None:
    """Take the job's lock for this process, which holds the lease. A standby checking on the previous holder lets go
    within milliseconds; a holder still there after ``grace_seconds`` is a driver that lost the lease (paused, or on
    a host the supervisor cannot reach): its database session is ended, which frees the lock and, when it wakes, its
    lease keeper finds itself fenced. The connection must stay open for as long as the lock is held. None on SQLite."""
    if not supported():
        return None
    conn = lock_connection()
    began = time.monotonic()
    while not conn.execute("SELECT pg_try_advisory_lock(%s, %s)", [LOCK_CLASS, job_id]).fetchone()[0]:  # type: ignore[index]
        waited = time.monotonic() - began
        if waited > within_seconds:
            conn.close()
            raise TimeoutError(f"job {job_id}'s driver lock was not free within {within_seconds:.0f} s")
        if waited > grace_seconds:
            evict(conn, job_id)
        time.sleep(0.05)
    return conn


def evict(conn: psycopg.Connection[Any], job_id: int) -> int:
    """End the database session of whoever holds the job's lock (a driver that lost its lease); how many were ended."""
    ended = conn.execute(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s "
        "AND objid = %s AND objsubid = 2 AND granted AND pid <> pg_backend_pid()",
        [LOCK_CLASS, job_id],
    ).fetchone()
    return int(ended[0]) if ended else 0


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
