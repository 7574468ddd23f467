"""Green's source following the job's checkpoint in a blue/green upgrade, for either source that can: the Redis
stream's (``redis_streams.py``) and the Kafka range reader (``kafka_range.py``). ``BatchFollower`` reads blue's
offsets file of each batch; ``Following`` adds the handover (once the handover file exists and blue's last batch is
read, green reads on by itself) and green's pace after it."""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any


def same_place(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two offsets of one source say the same place: a Redis stream's entry ids, or a Kafka topic's offsets per
    partition (however the JSON ordered them)."""
    if "id" in a or "id" in b:
        return str(a.get("id")) == str(b.get("id"))
    try:
        return _partitions(a) == _partitions(b)
    except (AttributeError, TypeError, ValueError):
        return False


def _partitions(offset: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {t: {str(p): int(o) for p, o in parts.items()} for t, parts in offset.items() if isinstance(parts, dict)}


def unmark_followed(checkpoint: str) -> int:
    """Take green's mark of a no-data batch (``"followed"``, see ``BatchFollower.next_end``) out of a Kafka job's
    offsets files, before Spark's Kafka source reads the checkpoint: that source would take the mark for a topic. The
    place each file says is the same without it. Returns how many files were rewritten."""
    offsets = os.path.join(checkpoint.removeprefix("file:"), "offsets")
    rewritten = 0
    try:
        names = [n for n in os.listdir(offsets) if n.isdigit()]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(offsets, name)
        try:
            with open(path, encoding="utf-8") as handle:
                lines = handle.read().split("\n")
            source = json.loads(lines[2])
        except (OSError, IndexError, ValueError):
            continue
        if not isinstance(source, dict) or "followed" not in source:
            continue
        del source["followed"]
        lines[2] = json.dumps(source, separators=(",", ":"))
        with open(f"{path}.unmarked", "w", encoding="utf-8") as handle:
            handle.write("\n".join(lines))
        os.replace(f"{path}.unmarked", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(offsets, f".{name}.crc"))  # its checksum was of the marked text
        rewritten += 1
    return rewritten


def _source_offset(path: str) -> dict[str, Any] | None:
    """The first source's offset in a Spark offsets-log file (``v1``, the batch's metadata, then a line per source),
    or None when it cannot be read yet."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
        offset = json.loads(lines[2])
    except (OSError, IndexError, ValueError):
        return None
    return offset if isinstance(offset, dict) and offset else None


class BatchFollower:
    """Reads the job's checkpoint (``blue``) for a blue/green upgrade's new version (green), whose checkpoint is a fork
    of blue's, so that their batches keep the same numbers: green's next batch reads the offsets of blue's batch of
    that number, once blue has committed it. After a rescale the numbers stand ``shift`` apart (Spark's offline
    repartition wrote one batch of no input into green's fork): green's batch n reads blue's batch n - shift; after a
    state migration green's fork is a new checkpoint whose batch 0 reads blue's batch K + 1 (``shift`` is -(K + 1)).
    A batch blue ran without new data (a watermark's) ends where it starts: green runs it as a batch that reads
    nothing, under the same watermark (see ``next_end``). ``next_end`` waits a little for blue's batch rather than answer "no new data" while blue runs it: Spark would run a no-data batch of its own there,
    one that blue did not, and the numbers would part. Offsets files never change once written: each is read once."""

    RUNNING_WAIT_SECONDS = 60.0  # longest one call waits for a batch blue is running (a stop waits no longer)

    def __init__(self, blue: str, own: str, interval: float = 0.0, shift: int = 0, mirror: str = "") -> None:
        self.blue, self.own = blue.removeprefix("file:"), own.removeprefix("file:")
        self.shift = shift
        # copies of blue's committed batches the console keeps (checkpoint_dir/files.py: follow_mirror), read where
        # Spark has purged blue's own past its retention
        self.mirror = mirror
        self.ends: dict[int, dict[str, Any]] = {}
        # Blue not even planning a batch this long has none to run: it has no watermark to move either (it would run a
        # no-data batch within an interval), so green, on the same state, has none, and "no new data" is safe.
        self.idle_wait = interval + 2.0

    def _has(self, folder: str, batch: int) -> bool:
        return any(os.path.exists(os.path.join(root, folder, str(batch))) for root in self._roots())

    def _roots(self) -> tuple[str, ...]:
        return (self.blue, self.mirror) if self.mirror else (self.blue,)

    def _end(self, batch: int) -> dict[str, Any] | None:
        if batch not in self.ends:
            for root in self._roots():
                if (found := _source_offset(os.path.join(root, "offsets", str(batch)))) is not None:
                    self.ends[batch] = found
                    break
            else:
                return None
        return self.ends[batch]

    def _next_number(self) -> int:
        """Green's next batch number: after its newest planned one, 0 in a checkpoint with none (a migrated fork)."""
        try:
            planned = [int(name) for name in os.listdir(os.path.join(self.own, "offsets")) if name.isdigit()]
        except OSError:
            planned = []
        return max(planned) + 1 if planned else 0

    def next_end(
        self, start: dict[str, Any], planned: bool = False, until: Any = lambda: False
    ) -> dict[str, Any] | None:
        """The end of blue's batch of green's next number: of a committed one, or (``planned``: after the handover,
        blue fenced) of one blue only planned, whose output green's batch then replaces in every sink. For a batch
        blue ran without new data, ``start`` marked with blue's batch number. None when blue has no such batch (after waiting up to
        WAIT_SECONDS, or until ``until()`` is true)."""
        mine = self._next_number()
        wanted = mine - self.shift  # blue's number for it
        began = time.monotonic()
        while True:
            if self._has("offsets" if planned else "commits", wanted):
                before, end = self._end(wanted - 1), self._end(wanted)
                if before is not None and end is not None and same_place(before, start):
                    if same_place(end, start):  # blue ran it without new data (a watermark's batch)
                        # Spark runs a no-data batch only after a batch of the same query: green, just started on
                        # its fork, would not, and its numbers would stop. An end that differs from the start only
                        # by this mark makes it run the batch, reading nothing, under the same watermark as blue's.
                        # (a Kafka job's next run with Spark's own source reads its checkpoint unmarked:
                        # ``unmark_followed``)
                        return {**{k: v for k, v in end.items() if k != "followed"}, "followed": wanted}
                    return end
                return None  # the numbers parted (blue's batch does not start where green's does): read on freely
            waited = time.monotonic() - began
            running = self._has("offsets", wanted)  # blue planned it: it is running it now
            if planned or until() or waited >= (self.RUNNING_WAIT_SECONDS if running else self.idle_wait):
                return None
            time.sleep(0.05)


class Following:
    """What a green's source does while it follows blue (``follow`` and the options beside it): each batch ends where
    blue's of that number did; past the handover and blue's last batch, ``end`` answers None and the source reads on
    by itself, ``paced`` to one read per trigger interval."""

    def __init__(self, options: dict[str, str]) -> None:
        self.pace = int(options.get("pacems", "0")) / 1000  # green's trigger interval: see ``paced``
        self.follower = (
            BatchFollower(
                options["follow"],
                options.get("owncheckpoint", ""),
                self.pace,
                int(options.get("followshift", "0")),
                options.get("followmirror", ""),
            )
            if options.get("follow")
            else None
        )
        self.handover_file = options.get("handoverfile", "")
        self._next_read = 0.0  # when a paced reader reads its source next (monotonic seconds)

    def end(self, start: dict[str, Any]) -> dict[str, Any] | None:
        """The end of green's next batch while it follows blue (``start``: none yet); None when it reads on by itself."""
        if self.follower is None:
            return None
        handed_over = self.handed_over()
        followed = self.follower.next_end(start, planned=handed_over, until=self.handed_over)
        if followed is None and not handed_over and self.handed_over():  # it came while waiting
            handed_over = True
            followed = self.follower.next_end(start, planned=True)
        if followed is not None or not handed_over:
            return followed or start
        self.follower = None  # past the job's last batch after the handover: it reads its source from here on
        return None

    def paced(self) -> None:
        """Green's query triggers without pause (to catch up with blue, its batches come as fast as blue committed
        them); once it reads its source itself, this paces it to one read per trigger interval, as Spark's
        processing-time trigger would: it waits here for the next one. A read finds "no new data" at most once an
        interval, so a plan with a watermark runs a no-data batch no more often than under Spark's trigger."""
        if self.pace <= 0:
            return
        now = time.monotonic()
        if now < self._next_read:
            time.sleep(self._next_read - now)
        self._next_read = max(now, self._next_read) + self.pace

    def handed_over(self) -> bool:
        return bool(self.handover_file) and os.path.exists(self.handover_file)
