"""What each committed batch added to the checkpoint directory, and its full size on disk.

A progress event reaches the listener after its batch committed, while the next batch may already be writing. Files
that name a later batch (``offsets/N``, ``commits/N``, state version ``N+1``) wait for that batch's event; every
other new or grown file counts for the batch being measured. So the bytes of all records add up to what appeared.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

_LOG_FILE = re.compile(r"^(?:offsets|commits)/\.?(\d+)(?:\.crc)?$")
_STATE_FILE = re.compile(r"(?:^|/)\.?(\d+)(?:_[0-9a-fA-F-]+)?\.(delta|snapshot|zip|changelog)(?:\.crc)?$")
SNAPSHOT_KINDS = {"snapshot", "zip"}


def file_batch(relative: str) -> tuple[int | None, bool]:
    """The batch a checkpoint file belongs to (state version v belongs to batch v - 1) and whether it is a snapshot."""
    if m := _LOG_FILE.match(relative):
        return int(m.group(1)), False
    if relative.startswith("state/") and (m := _STATE_FILE.search(relative)):
        return int(m.group(1)) - 1, m.group(2) in SNAPSHOT_KINDS
    return None, False


TEMPORARIES = (".tmp", ".tmp.crc")  # Hadoop's write-then-rename files: a file Spark is still writing


def scan(root: Path, temporaries: bool = False) -> dict[str, int]:
    """Every file under root (or root itself, if a file) by its relative path, with its size: what du counts. Without
    `temporaries`, files still being written and about to be renamed away are left out."""
    sizes: dict[str, int] = {}
    if root.is_file():
        return {root.name: root.lstat().st_size}
    if not root.exists():
        return sizes
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            if not temporaries and name.endswith(TEMPORARIES):
                continue
            path = os.path.join(dirpath, name)
            try:
                sizes[os.path.relpath(path, root)] = os.lstat(path).st_size
            except FileNotFoundError:  # removed by Spark's cleanup between listing and stat
                continue
    return sizes


def state_version(name: str) -> int | None:
    """The version a state store file name carries (`12.delta`, `12.zip`, `12_<uuid>.zip`, `12.changelog`)."""
    head = name.split(".")[0].split("_")[0]
    return int(head) if head.isdigit() else None


_PARTITION = re.compile(r"^state/(\d+)/(\d+)/")


@dataclass
class Measurement:
    added_bytes: int
    full_bytes: int
    snapshot: bool
    # per state partition: operator, partition, bytes on disk, bytes this batch added, and when its state version
    # file was written, in ms after the batch started (the partition's commit time, as the file system saw it)
    partitions: list[dict[str, int | None]] = field(default_factory=list)


class CheckpointDisk:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.seen: dict[str, int] = scan(root)

    def measure(self, batch_id: int, started_ms: float | None = None) -> Measurement:
        now = scan(self.root)
        added, snapshot = 0, False
        grew: dict[str, int] = {}
        for path, size in now.items():
            before = self.seen.get(path, 0)
            if size <= before:
                continue
            owner, is_snapshot = file_batch(path)
            if owner is not None and owner > batch_id:
                continue
            added += size - before
            grew[path] = size - before
            snapshot = snapshot or (is_snapshot and owner == batch_id)
            self.seen[path] = size
        for path in list(self.seen):
            if path not in now:
                del self.seen[path]
        # the full size is what belongs to batches up to this one: a later batch's files are not its part yet
        return Measurement(added, sum(self.seen.values()), snapshot, self._partitions(batch_id, grew, started_ms))

    def _partitions(self, batch_id: int, grew: dict[str, int], started_ms: float | None) -> list[dict[str, int | None]]:
        found: dict[tuple[int, int], dict[str, int | None]] = {}
        for path, size in self.seen.items():
            if not (m := _PARTITION.match(path)):
                continue
            key = (int(m.group(1)), int(m.group(2)))
            entry = found.setdefault(key, {"op": key[0], "part": key[1], "bytes": 0, "added": 0, "commit_ms": None})
            entry["bytes"] = int(entry["bytes"] or 0) + size
            entry["added"] = int(entry["added"] or 0) + grew.get(path, 0)
            owner, _ = file_batch(path)
            if owner == batch_id and started_ms is not None and not os.path.basename(path).startswith("."):
                try:
                    written_ms = os.stat(self.root / path).st_mtime_ns / 1e6
                except FileNotFoundError:
                    continue
                commit = max(0, round(written_ms - started_ms))
                entry["commit_ms"] = max(commit, int(entry["commit_ms"] or 0))
        return [found[key] for key in sorted(found)]
