"""The running driver's liveness lock: a PostgreSQL session-level advisory lock per job, held on a connection of its
own for the whole life of the driver process. When the process dies, however it dies (kill -9 included), the kernel
closes the connection and PostgreSQL frees the lock at once: a standby blocked on it wakes within milliseconds, with
no polling beat. The lock only says "the holder's process is gone"; the lease and its fencing token stay the
authority on who may write."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
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

    def attempt(evicting: bool) -> bool:
        if try_lock(conn, job_id):
            return True
        if evicting:
            evict(conn, job_id)
        return False

    try:
        wait_for(job_id, attempt, within_seconds, grace_seconds)
    except TimeoutError:
        conn.close()
        raise
    return conn


def try_lock(conn: psycopg.Connection[Any], job_id: int) -> bool:
    return bool(conn.execute("SELECT pg_try_advisory_lock(%s, %s)", [LOCK_CLASS, job_id]).fetchone()[0])  # type: ignore[index]


def wait_for(job_id: int, attempt: Callable[[bool], bool], within_seconds: float, grace_seconds: float) -> None:
    """Call ``attempt`` every 50 ms until it takes the lock, telling it to end the holder's session once the holder
    has had ``grace_seconds``; TimeoutError after ``within_seconds``."""
    began = time.monotonic()
    while True:
        waited = time.monotonic() - began
        if attempt(waited > grace_seconds):
            return
        if waited > within_seconds:
            raise TimeoutError(f"job {job_id}'s driver lock was not free within {within_seconds:.0f} s")
        time.sleep(0.05)


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


class LockSet:
    """Several jobs' locks held on one connection, as a shared driver holds its jobs' (one connection, not one per
    job): taken and let go job by job, all freed at once when the process dies. A successor that evicts one job's
    holder ends the session, which frees the others' too: ``check`` (the shared driver's main loop calls it every
    second) reconnects and takes theirs again. Does nothing on SQLite."""

    def __init__(self) -> None:
        self.conn: psycopg.Connection[Any] | None = None
        self.held: set[int] = set()
        self.mutex = threading.Lock()

    def _connection(self) -> psycopg.Connection[Any]:
        if self.conn is None or self.conn.closed:
            self.conn = lock_connection()
            for job_id in sorted(self.held):  # after an eviction: take again what is still free
                if not try_lock(self.conn, job_id):
                    self.held.discard(job_id)
        return self.conn

    def take(self, job_id: int, within_seconds: float = 30.0, grace_seconds: float = 2.0) -> None:
        """As ``hold``: wait for the lock, ending the session of a holder still there after ``grace_seconds``."""
        if not supported():
            return

        def attempt(evicting: bool) -> bool:
            with self.mutex:
                try:
                    conn = self._connection()
                    if try_lock(conn, job_id):
                        self.held.add(job_id)
                        return True
                    if evicting:
                        evict(conn, job_id)
                except psycopg.OperationalError:
                    self.conn = None
            return False

        wait_for(job_id, attempt, within_seconds, grace_seconds)

    def let_go(self, job_id: int) -> None:
        if not supported():
            return
        with self.mutex:
            if job_id not in self.held:
                return
            self.held.discard(job_id)
            try:
                self._connection().execute("SELECT pg_advisory_unlock(%s, %s)", [LOCK_CLASS, job_id])
            except psycopg.Error:
                self.conn = None  # the session is gone, and the lock with it

    def check(self) -> None:
        if not supported() or not self.held:
            return
        with self.mutex:
            try:
                self._connection().execute("SELECT 1")
            except psycopg.Error:
                self.conn = None
                self._connection()
