"""What Spark's file source has read, from its log in the checkpoint (``sources/0/<batch>[.compact]``), against the
files in its directory: the backlog of a job that reads files, in files and bytes. Plain files: no Spark, no Django."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass(frozen=True)
class FileBacklog:
    files: int  # files in the directory
    read: int  # of them, read by a committed or planned batch
    unread: int
    unread_bytes: int
    oldest_unread_mtime: float | None  # epoch seconds


def read_paths(checkpoint: Path) -> set[str]:
    """Absolute paths of every file the source has taken into a batch (its log lists them, compacted or not)."""
    found: set[str] = set()
    log = checkpoint / "sources" / "0"
    if not log.is_dir():
        return found
    for entry in log.iterdir():
        if entry.name.startswith(".") or not entry.name.split(".")[0].isdigit():
            continue
        try:
            lines = entry.read_text(errors="replace").splitlines()[1:]  # after the version line
        except OSError:
            continue
        for line in lines:
            try:
                uri = json.loads(line)["path"]
            except (ValueError, KeyError, TypeError):
                continue
            found.add(unquote(urlparse(uri).path))
    return found


def file_backlog(directory: Path, checkpoint: Path) -> FileBacklog:
    """Files Spark would read (not hidden, not starting with "_" or ".") and how many of them it has not read yet."""
    done = read_paths(checkpoint)
    files = read = unread = unread_bytes = 0
    oldest: float | None = None
    try:
        entries = list(os.scandir(directory))
    except OSError:
        entries = []
    for entry in entries:
        if entry.name.startswith((".", "_")) or not entry.is_file():
            continue
        files += 1
        if str(Path(entry.path).resolve()) in done or entry.path in done:
            read += 1
            continue
        stat = entry.stat()
        unread, unread_bytes = unread + 1, unread_bytes + stat.st_size
        oldest = stat.st_mtime if oldest is None else min(oldest, stat.st_mtime)
    return FileBacklog(files, read, unread, unread_bytes, oldest)
