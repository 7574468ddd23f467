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
    """The console under uvicorn (ASGI: the live pages need it), on 127.0.0.1."""
    return [sys.executable, "-m", "uvicorn", "statekeeper.asgi:application", "--host", "127.0.0.1", "--port", str(port)]


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
