"""What each committed batch added to the checkpoint directory, and its full size on disk.

A progress event reaches the listener after its batch committed, while the next batch may already be writing. Files
that name a later batch (``offsets/N``, ``commits/N``, state version ``N+1``) wait for that batch's event; every
other new or grown file counts for the batch being measured. So the bytes of all records add up to what appeared.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
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


def scan(root: Path) -> dict[str, int]:
    sizes: dict[str, int] = {}
    if not root.exists():
        return sizes
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                sizes[os.path.relpath(path, root)] = os.stat(path).st_size
            except FileNotFoundError:  # removed by Spark's cleanup between listing and stat
                continue
    return sizes


@dataclass
class Measurement:
    added_bytes: int
    full_bytes: int
    snapshot: bool


class CheckpointDisk:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.seen: dict[str, int] = scan(root)

    def measure(self, batch_id: int) -> Measurement:
        now = scan(self.root)
        added, snapshot = 0, False
        for path, size in now.items():
            before = self.seen.get(path, 0)
            if size <= before:
                continue
            owner, is_snapshot = file_batch(path)
            if owner is not None and owner > batch_id:
                continue
            added += size - before
            snapshot = snapshot or (is_snapshot and owner == batch_id)
            self.seen[path] = size
        for path in list(self.seen):
            if path not in now:
                del self.seen[path]
        # the full size is what belongs to batches up to this one: a later batch's files are not its part yet
        return Measurement(added, sum(self.seen.values()), snapshot)
