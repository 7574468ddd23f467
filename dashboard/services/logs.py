"""The drivers' and workers' logs under ``settings.LOG_ROOT`` kept to a size and an age.

Every process appends to its log (``spawn_process`` opens it for appending, ``bin/dev`` uses ``>>``), so a log past
its size is copied to ``<name>.1`` (older parts shift to ``.2`` … up to ``LOG_KEEP``) and cut in place: the writer
holds its descriptor and goes on writing at the new end, with nothing lost and no process restarted. A log or part
that nothing has written for ``LOG_RETENTION_DAYS`` is removed (an ended run's, a removed job's).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from django.conf import settings


def _parts(log: Path) -> list[Path]:
    return [log.with_name(f"{log.name}.{n}") for n in range(1, settings.LOG_KEEP + 1)]


def log_rotate(log: Path) -> bool:
    """Rotate one log past ``LOG_MAX_MB``; returns whether it did."""
    try:
        if log.stat().st_size <= settings.LOG_MAX_MB * 1024 * 1024:
            return False
    except FileNotFoundError:
        return False
    parts = _parts(log)
    if not parts:  # keep no parts: cut it only
        with log.open("r+b") as live:
            live.truncate(0)
        return True
    parts[-1].unlink(missing_ok=True)
    for older, newer in zip(reversed(parts), reversed(parts[:-1]), strict=False):
        if newer.exists():
            newer.rename(older)
    with log.open("r+b") as live, parts[0].open("wb") as copy:
        shutil.copyfileobj(live, copy, 1 << 20)
        live.truncate(0)  # what was written between the copy and the cut is lost: a few lines at most
    return True


def logs_rotate(root: Path | None = None, now: float | None = None) -> dict[str, int]:
    """Rotate every log under ``root`` past its size and remove the stale ones; returns how many of each."""
    root = root or settings.LOG_ROOT
    now = time.time() if now is None else now
    horizon = now - settings.LOG_RETENTION_DAYS * 86400
    rotated = removed = 0
    if not root.is_dir():
        return {"rotated": 0, "removed": 0}
    for path in sorted(root.iterdir()):
        if not path.is_file() or ".log" not in path.name:
            continue
        try:
            stale = path.stat().st_mtime < horizon
        except FileNotFoundError:
            continue
        if stale:
            path.unlink(missing_ok=True)
            removed += 1
        elif path.name.endswith(".log") and log_rotate(path):
            rotated += 1
    return {"rotated": rotated, "removed": removed}
