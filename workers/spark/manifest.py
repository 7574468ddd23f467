"""RocksDB's MANIFEST kept to a size: a running query's state stores are reopened now and then.

A RocksDB state store stays open from batch to batch. Every commit flushes its memtable and appends a record to the
store's MANIFEST (about 185 bytes a batch, measured), and every snapshot zip carries the whole MANIFEST. Without change
logs a job keeps ``batches_retained`` snapshots per partition, so its checkpoint grew by roughly retained × partitions
× 185 bytes per batch, for as long as the driver ran: about 2.8 GB a day for a 4-partition job at a 2 s trigger. RocksDB
starts a new MANIFEST only when the store is opened again (its ``max_manifest_file_size`` is 1 GB, and Spark 4.3 does
not set it), which a driver's restart did.

Spark's ``spark.sql.streaming.stateStore.unloadOnCommit`` closes a store after its commit, so that the next batch opens
it again, with a new MANIFEST. On for every batch it tripled a small job's batch time here (278 → 934 ms, 1,000 keys at
a 0.2 s trigger), so it is switched on for one batch, when the newest snapshot's MANIFEST has passed
``STATEKEEPER_ROCKSDB_MANIFEST_MAX_KB`` (256), and off again for the next. The setting is read per batch from the query's
own session (the stream's clone of the driver's session, which a foreachBatch frame carries), so no other query of a
shared driver is touched. The next batch pays the reopen once: measured, 1.1–1.9 s instead of 0.3 s for that job.
"""

from __future__ import annotations

import logging
import os
import zipfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

UNLOAD_ON_COMMIT = "spark.sql.streaming.stateStore.unloadOnCommit"
CHECK_EVERY = 100  # batches between two looks at the newest snapshot's MANIFEST


def manifest_limit() -> int:
    return int(float(os.environ.get("STATEKEEPER_ROCKSDB_MANIFEST_MAX_KB", "256")) * 1024)


def _version(snapshot: Path) -> int:
    """A snapshot zip's version: ``12.zip``, or ``12_<unique id>.zip`` in checkpoint format 2."""
    return int(snapshot.name.split(".")[0].split("_")[0])


def manifest_bytes(checkpoint: str | Path) -> int:
    """The largest MANIFEST among the newest snapshots of each stateful operator's first partition (the partitions of
    one operator commit alike); 0 without a RocksDB snapshot."""
    largest = 0
    root = Path(str(checkpoint).removeprefix("file:"))
    for partition in root.glob("state/*/0"):
        snapshots = sorted(partition.glob("*.zip"), key=_version)
        for snapshot in reversed(snapshots[-2:]):  # the newest may be half written: then the one before it
            try:
                with zipfile.ZipFile(snapshot) as archive:
                    size = sum(i.file_size for i in archive.infolist() if Path(i.filename).name.startswith("MANIFEST"))
            except (OSError, zipfile.BadZipFile, ValueError):
                continue
            largest = max(largest, size)
            break
    return largest


class ManifestKeeper:
    """Wraps a query's foreachBatch: after every ``every`` batches, when the newest snapshot's MANIFEST is past the
    limit, the query's state stores close after the next batch's commit and open again in the one after it."""

    def __init__(self, checkpoint: str, sink: Any, limit: int | None = None, every: int = CHECK_EVERY) -> None:
        self.checkpoint, self.sink, self.every = checkpoint, sink, every
        self.limit = manifest_limit() if limit is None else limit
        self.unloading: int | None = None  # the batch that switched unloading on
        self.reopened = 0

    def __call__(self, frame: Any, batch_id: int) -> None:
        self.sink(frame, batch_id)
        self.after(frame.sparkSession, batch_id)

    def after(self, session: Any, batch_id: int) -> None:
        if self.unloading is not None:
            if batch_id > self.unloading:  # the batch planned with it on has committed: its stores were closed
                session.conf.set(UNLOAD_ON_COMMIT, "false")
                self.unloading = None
                self.reopened += 1
            return
        if self.limit <= 0 or batch_id == 0 or batch_id % self.every:
            return
        size = manifest_bytes(self.checkpoint)
        if size > self.limit:
            log.info("%s: RocksDB's MANIFEST is %d bytes (limit %d): the state stores reopen after the next batch",
                     self.checkpoint, size, self.limit)  # fmt: skip
            session.conf.set(UNLOAD_ON_COMMIT, "true")
            self.unloading = batch_id
