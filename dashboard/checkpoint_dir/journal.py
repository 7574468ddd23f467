"""A run's progress journal: one JSON line per committed batch, appended by its driver beside the checkpoint
(``<job>/journal/run-<id>.jsonl``), read by the console for any batch the progress stream lost. No Django here.

The console reads each journal from where it stopped last time (its offset kept in ``run-<id>.read``), never from the
start again: a run of weeks keeps its reads small, and a batch whose record has aged out of the console's database is
never recorded a second time. Once read past ``ROTATE_BYTES`` the journal is rotated (``run-<id>.<stamp>.jsonl.done``),
and the driver's next line starts a new one; ``journals_expire`` removes rotated parts, and the journals of ended
runs, older than the raw checkpoint retention. A lock file (``run-<id>.lock``) orders the driver's appends and the
console's read-and-rotate, so that no line is written to a file already rotated away."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

ROTATE_BYTES = 8 << 20  # about 8,000 batches a part
PART = re.compile(r"run-(\d+)(?:\.(\d{8}T\d{6}\d*))?\.jsonl(\.done)?")


@contextlib.contextmanager
def _locked(journal: Path) -> Iterator[None]:
    journal.parent.mkdir(parents=True, exist_ok=True)
    with open(journal.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def journal_append(journal: Path, line: str) -> None:
    """The driver's append of one batch's line."""
    with _locked(journal), open(journal, "a") as out:
        out.write(line + "\n")


@contextlib.contextmanager
def unread_lines(journal: Path, rotate_bytes: int = ROTATE_BYTES) -> Iterator[list[str]]:
    """The complete lines appended since the last read (a line cut short by a kill is left for later). They count as
    read only when the block ends without an error; then a journal read past ``rotate_bytes`` is rotated."""
    if not journal.exists():
        yield []
        return
    offset_file = journal.with_suffix(".read")
    with _locked(journal):
        try:
            offset = int(offset_file.read_text() or 0)
        except (OSError, ValueError):
            offset = 0
        with open(journal, "rb") as source:
            source.seek(offset)
            data = source.read()
        whole = data[: data.rfind(b"\n") + 1]
        yield [line for line in whole.decode(errors="replace").splitlines() if line.strip()]
        offset += len(whole)
        if offset >= rotate_bytes and offset == journal.stat().st_size:
            stamp = time.strftime("%Y%m%dT%H%M%S") + f"{time.time_ns() % 1_000_000:06d}"
            journal.rename(journal.with_name(f"{journal.stem}.{stamp}.jsonl.done"))
            offset_file.unlink(missing_ok=True)
        elif whole:
            scratch = offset_file.with_suffix(".read-tmp")
            scratch.write_text(str(offset))
            os.replace(scratch, offset_file)


def journal_parts(directory: Path) -> dict[int, list[Path]]:
    """Each run's journal files by run number, oldest part first (rotated parts, then the current one)."""
    found: dict[int, list[Path]] = {}
    for path in sorted(directory.glob("run-*.jsonl*")) if directory.is_dir() else []:
        if match := PART.fullmatch(path.name):
            found.setdefault(int(match.group(1)), []).append(path)
    for parts in found.values():
        parts.sort(key=lambda p: (not p.name.endswith(".done"), p.name))
    return found


def journals_expire(directory: Path, older_than_seconds: float, active_runs: set[int]) -> int:
    """Remove rotated parts, and every file of an ended run's journal, not written to for ``older_than_seconds``; the
    number of files removed."""
    horizon = time.time() - older_than_seconds
    removed = 0
    for run, parts in journal_parts(directory).items():
        for part in parts:
            ended = run not in active_runs
            if (part.name.endswith(".done") or ended) and part.stat().st_mtime < horizon:
                part.unlink(missing_ok=True)
                removed += 1
        if run not in active_runs and not any(p.exists() for p in parts):
            for suffix in (".read", ".lock"):
                (directory / f"run-{run}{suffix}").unlink(missing_ok=True)
    return removed
