"""The command lines of the console's own processes, for the tests and benchmarks that start them (bin/dev starts the
same ones from the shell)."""

from __future__ import annotations

import sys
from pathlib import Path


def celery_worker_command(schedule: Path | None, loglevel: str = "INFO", concurrency: int = 2) -> list[str]:
    """A Celery worker with beat embedded, keeping beat's schedule in `schedule` (None: a worker alone, for a second
    host: one beat per deployment)."""
    beat = ["--beat", "--schedule", str(schedule)] if schedule else []
    return [
        sys.executable, "-m", "celery", "-A", "statekeeper", "worker",
        "--concurrency", str(concurrency), "--loglevel", loglevel, *beat,
    ]  # fmt: skip


def web_command(port: int) -> list[str]:
    """The console under uvicorn (ASGI: the live pages need it), on 127.0.0.1, as bin/dev runs it."""
    return [sys.executable, "-m", "uvicorn", "statekeeper.asgi:application", "--host", "127.0.0.1", "--port", str(port),
            *UVICORN_FLAGS]  # fmt: skip


# uvicorn believes X-Forwarded-For from 127.0.0.1 unless told not to: the console reads it itself, and only from the
# proxies STATEKEEPER_TRUSTED_PROXIES lists (dashboard.services.audit.client_address)
UVICORN_FLAGS = ("--no-proxy-headers",)


def celery_beat_command(schedule: Path, loglevel: str = "INFO") -> list[str]:
    """Celery beat on its own (the deployment's single scheduler, beside workers on several hosts)."""
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "statekeeper",
        "beat",
        "--loglevel",
        loglevel,
        "--schedule",
        str(schedule),
    ]
