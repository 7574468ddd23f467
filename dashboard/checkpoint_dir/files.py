"""Reading and copying a Spark checkpoint directory as of one committed batch. Plain files, no Spark, no Django.

A copy "as of batch K" holds the commit log up to K and the state versions up to K + 1 (state version v is written by
batch v - 1), plus every file that belongs to no batch (metadata, sources, schemas, RocksDB's shared SST files). It is
a checkpoint Spark restarts from at batch K + 1. The live directory is only ever read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dashboard.checkpoint_dir.disk import TEMPORARIES, file_batch, scan


class CheckpointError(Exception):
    """The checkpoint directory is missing, incomplete or unreadable; the message says what is wrong."""


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str


def _batch_files(root: Path, log: str) -> list[int]:
    folder = root / log
    if not folder.is_dir():
        return []
    return sorted(int(name) for name in os.listdir(folder) if name.isdigit())


def committed_batches(root: Path) -> list[int]:
    return _batch_files(root, "commits")


def latest_committed(root: Path) -> int:
    batches = committed_batches(root)
    if not batches:
        raise CheckpointError(f"{root} has no committed batch")
    return batches[-1]


def batch_offsets(root: Path, batch: int) -> dict[str, Any]:
    """What offsets/<batch> says: the batch's metadata (watermark, timestamp, frozen conf) and source end offsets."""
    path = root / "offsets" / str(batch)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise CheckpointError(f"offsets/{batch} is missing from {root}") from None
    if len(lines) < 2 or not lines[0].startswith("v"):
        raise CheckpointError(f"offsets/{batch} in {root} is truncated or not an offset log entry")
    try:
        metadata = json.loads(lines[1])
        sources = [json.loads(line) if line != "-" else None for line in lines[2:]]
    except ValueError as exc:
        raise CheckpointError(f"offsets/{batch} in {root} is corrupt: {exc}") from None
    return {"metadata": metadata, "sources": sources}


@dataclass(frozen=True)
class PlannedBatch:
    """A batch whose offsets were written ahead but whose commit was not: what a restart replays first."""

    batch: int
    after: dict[str, Any]  # the source offset it starts after ({"id", "n"} for a Redis stream)
    upto: dict[str, Any]  # the source offset it ends at, inclusive

    @property
    def entries(self) -> int | None:
        if "n" in self.after and "n" in self.upto:
            return int(self.upto["n"]) - int(self.after["n"])
        return None


def planned_batch(root: Path) -> PlannedBatch | None:
    """The uncommitted batch at the end of the offset log, if any; None when every planned batch committed or the
    log cannot be read."""
    planned = _batch_files(root, "offsets")
    committed = committed_batches(root)
    if not planned or (committed and committed[-1] >= planned[-1]):
        return None
    batch = planned[-1]
    try:
        upto = batch_offsets(root, batch)["sources"][0] or {}
        after = (batch_offsets(root, batch - 1)["sources"][0] or {}) if batch > 0 else {"id": "0-0", "n": 0}
    except (CheckpointError, IndexError):
        return None
    return PlannedBatch(batch, after, upto)


def state_lineage(root: Path, batch: int) -> dict[tuple[int, int], str] | None:
    """With checkpoint format version 2, the id of the state file each (operator, partition) committed at ``batch``
    (state version batch + 1), from ``commits/<batch>``: a file of the same version with another id is a lineage no
    commit chose (an aborted attempt, or a fenced driver's) and is never read. None for format version 1 (one file per
    version, no id) or when the commit is gone."""
    try:
        lines = (root / "commits" / str(batch)).read_text().splitlines()
        ids = json.loads(lines[1]).get("stateUniqueIds") if lines and lines[0] == "v2" and len(lines) > 1 else None
    except (OSError, ValueError):
        return None
    if not isinstance(ids, dict):
        return None
    return {
        (int(op), part): str(unique[0])
        for op, partitions in ids.items()
        for part, unique in enumerate(partitions)
        if isinstance(unique, list) and unique
    }


def checkpoint_format(root: Path) -> int:
    """The state store checkpoint format of the newest commit: 2 records state file ids with each commit, 1 does not."""
    batches = committed_batches(root)
    if not batches:
        return 0
    try:
        with open(root / "commits" / str(batches[-1])) as reader:
            return 2 if reader.readline().strip() == "v2" else 1
    except OSError:
        return 0


def frozen_settings(root: Path, batch: int) -> dict[str, str]:
    conf = batch_offsets(root, batch)["metadata"].get("conf", {})
    return {
        "partitions": conf.get("spark.sql.shuffle.partitions", ""),
        "provider": conf.get("spark.sql.streaming.stateStore.providerClass", ""),
    }


def _keep(relative: str, upto: int) -> bool:
    if relative.endswith(TEMPORARIES):
        return False
    owner, _ = file_batch(relative)
    return owner is None or owner <= upto


def _copy_hashing(src: Path, dst: Path) -> FileEntry | None:
    digest = hashlib.sha256()
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(src, "rb") as reader, open(dst, "wb") as writer:
            while chunk := reader.read(1 << 20):
                digest.update(chunk)
                writer.write(chunk)
    except FileNotFoundError:  # Spark's cleanup removed it while we copied: verification decides if it mattered
        dst.unlink(missing_ok=True)
        return None
    return FileEntry(str(dst), dst.stat().st_size, digest.hexdigest())


def _bare(name: str) -> str:
    """A file's name without its checksums' dressing (Hadoop's ``.NAME.crc``, Spark's ``NAME.crc`` and Hadoop's
    ``.NAME.crc.crc`` of that)."""
    name = name.removeprefix(".")
    while name.endswith(".crc"):
        name = name.removesuffix(".crc")
    return name


def snapshot_only(src: Path, upto: int) -> dict[str, set[str]] | None:
    """What a copy of batch ``upto`` alone needs of each state partition, when every partition is a RocksDB store
    that writes a full snapshot each batch (changelog checkpointing off): the snapshot of version ``upto + 1`` and the
    SST files its metadata lists, by the partition's directory. None when any partition keeps change files (RocksDB's
    changelogs, the memory backend's deltas) or lacks that snapshot: then every retained file is copied."""
    needs: dict[str, set[str]] = {}
    for part in sorted(p for p in (src / "state").glob("*/*") if p.is_dir() and p.name.isdigit()):
        names = [n for n in os.listdir(part) if not n.endswith(TEMPORARIES)]
        if any(_bare(n).endswith((".changelog", ".delta")) for n in names):
            return None
        # the snapshot of version upto + 1 is batch upto's (disk.file_batch reads a state file's name)
        zips = sorted(
            {_bare(n) for n in names if _bare(n).endswith(".zip") and file_batch(f"state/{n}") == (upto, True)}
        )
        if not zips:
            return None
        kept = set(zips)
        for name in zips:
            if (listed := _snapshot_ssts(part, name)) is None:
                return None
            kept |= listed
        needs[str(part.relative_to(src))] = kept
    return needs or None


def _snapshot_ssts(part: Path, name: str) -> set[str] | None:
    """The SST files a RocksDB snapshot (``name``, a zip in partition directory ``part``) lists, as ``SSTs/<file>``;
    None when its metadata cannot be read."""
    try:
        with zipfile.ZipFile(part / name) as snapshot:
            text = snapshot.read("metadata").decode()
        listed = json.loads(text.split("\n", 1)[1])["sstFiles"]  # "v1", then the JSON
    except (OSError, KeyError, IndexError, ValueError, zipfile.BadZipFile):
        return None
    return {f"SSTs/{f['dfsSstFileName']}" for f in listed}


def replay_only(src: Path, upto: int) -> dict[str, set[str]]:
    """What re-running committed batch ``upto`` on a copy needs of each state partition (an upgrade's preview): the
    state the batch began with, version ``upto``, is the newest snapshot at or below it and the change files after
    it; the files of version ``upto + 1`` (the batch's own, which the re-run writes again) are kept as a full copy
    keeps them, and the SST files each kept RocksDB snapshot lists. The hundred batches Spark retains before that
    snapshot are left out. A partition is left out of the answer (every retained file copied) when it has no snapshot
    at or below ``upto``, holds a folder other than RocksDB's ``SSTs`` and ``_metadata``, holds two files of one
    version (two lineages: with checkpoint format 2 the one the commit chose may start from an older snapshot) or a
    snapshot that cannot be read."""
    needs: dict[str, set[str]] = {}
    for part in sorted(p for p in (src / "state").glob("*/*") if p.is_dir() and p.name.isdigit()):
        try:
            entries = list(os.scandir(part))
        except FileNotFoundError:
            continue
        if any(e.is_dir() and e.name not in ("SSTs", "_metadata") for e in entries):
            continue
        versions: dict[str, int] = {}  # a state file's bare name -> its state version
        stems: dict[tuple[int, bool], set[str]] = {}  # (version, snapshot) -> its files' stems (one per lineage)
        for entry in entries:
            bare = _bare(entry.name)
            if entry.is_dir() or entry.name.endswith(TEMPORARIES):
                continue
            owner, snapshot = file_batch(f"state/{bare}")
            if owner is None:
                continue
            versions[bare] = owner + 1
            stems.setdefault((owner + 1, snapshot), set()).add(bare.split(".")[0])  # "12" or "12_<id>"
        if any(len(ids) > 1 for ids in stems.values()):
            continue
        base = max((v for (v, snapshot) in stems if snapshot and v <= upto), default=None)
        if base is None:
            continue
        kept = {name for name, version in versions.items() if base <= version <= upto + 1}
        ssts = [_snapshot_ssts(part, name) for name in kept if name.endswith(".zip")]
        if any(listed is None for listed in ssts):
            continue
        needs[str(part.relative_to(src))] = kept.union(*[listed for listed in ssts if listed is not None])
    return needs


def _needed(relative: str, upto: int, needs: dict[str, set[str]], commits: tuple[int, ...]) -> bool:
    """Whether a copy that takes only some of the checkpoint (``snapshot_only``'s or ``replay_only``'s answer in
    ``needs``) takes this file: of the offsets, ``upto - 1`` and ``upto`` (Spark reads both to restart) and of the
    commits those in ``commits``; of a partition in ``needs``, the files it lists; everything else (metadata, schemas,
    the source's log, a partition not in ``needs``) as a full copy takes it."""
    owner, _ = file_batch(relative)
    if relative.startswith("offsets/") and owner is not None:
        return owner in (upto - 1, upto)
    if relative.startswith("commits/") and owner is not None:
        return owner in commits
    for part, kept in needs.items():
        if relative.startswith(part + "/"):
            inside = relative[len(part) + 1 :]
            folder, _, name = inside.rpartition("/")
            bare = f"{folder}/{_bare(name)}" if folder else _bare(name)
            if bare in kept:
                return True
            return not (folder == "SSTs" or file_batch(f"state/{name}")[0] is not None)
    return True


def copy_checkpoint(src: Path, dst: Path, upto: int, batch_only: bool = False, replay: bool = False) -> list[FileEntry]:
    """Copy the checkpoint at ``src`` as of committed batch ``upto`` into ``dst`` (which must not exist).

    ``batch_only``: what restarting at ``upto`` needs, not every batch the checkpoint retains (a savepoint): for a
    RocksDB job that writes a snapshot each batch, the newest snapshot and its SST files instead of a hundred
    snapshots (``snapshot_only``); other state is copied whole. ``replay``: what re-running batch ``upto`` needs (an
    upgrade's preview, after ``forget_batch``): the state from the newest snapshot the batch can start from
    (``replay_only``), the offsets of ``upto - 1`` and ``upto``, the commits of both."""
    if upto not in committed_batches(src):
        raise CheckpointError(f"batch {upto} is not committed in {src}")
    if dst.exists():
        raise CheckpointError(f"{dst} already exists")
    needs = replay_only(src, upto) if replay else snapshot_only(src, upto) if batch_only else None
    commits = (upto - 1, upto) if replay else (upto,)
    entries = []
    for dirpath, _, names in os.walk(src):
        for name in sorted(names):
            source = Path(dirpath) / name
            relative = str(source.relative_to(src))
            if not _keep(relative, upto) or (needs is not None and not _needed(relative, upto, needs, commits)):
                continue
            entry = _copy_hashing(source, dst / relative)
            if entry is not None:
                entries.append(FileEntry(relative, entry.size, entry.sha256))
    return entries


SCHEMA_DIRS = ("_metadata", "_stateSchema")  # an operator's metadata and state schema files, beside its partitions


def schema_view(root: Path, batch: int, commit: bytes, dst: Path) -> Path:
    """The state schemas of ``root`` at ``batch`` as Spark has just planned them, for its state reader to read before
    the batch commits (an upgrade's preview gives its verdict from them as soon as the new version is planned): the
    query's metadata, the batch's offsets, ``commit`` (the batch's commit file as it was before the re-run) and each
    operator's metadata and schema files, copied into ``dst`` (made anew); no state, which a schema read does not
    open. Spark's state schema files name their own paths, which stay readable where they are."""
    remove_tree(dst)
    (dst / "offsets").mkdir(parents=True)
    (dst / "commits").mkdir()
    shutil.copy2(root / "metadata", dst / "metadata")
    shutil.copy2(root / "offsets" / str(batch), dst / "offsets" / str(batch))
    (dst / "commits" / str(batch)).write_bytes(commit)
    for operator in sorted((root / "state").iterdir()) if (root / "state").is_dir() else []:
        places = [operator / name for name in SCHEMA_DIRS]
        places += [part / "_metadata" for part in operator.iterdir() if part.name.isdigit()]
        for place in places:
            if place.is_dir():
                shutil.copytree(place, dst / place.relative_to(root), ignore=shutil.ignore_patterns("*.crc"))
    return dst


def verify_files(root: Path, files: list[dict[str, Any]]) -> list[str]:
    """Problems with the files a manifest lists: missing, wrong size, wrong checksum."""
    problems = []
    for item in files:
        path = root / item["path"]
        if not path.is_file():
            problems.append(f"{item['path']} is missing")
            continue
        if path.stat().st_size != item["size"]:
            problems.append(f"{item['path']} has {path.stat().st_size} bytes, the manifest says {item['size']}")
            continue
        digest = hashlib.sha256()
        with open(path, "rb") as reader:
            while chunk := reader.read(1 << 20):
                digest.update(chunk)
        if digest.hexdigest() != item["sha256"]:
            problems.append(f"{item['path']} does not match its checksum")
    return problems


def directory_bytes(root: Path) -> int:
    """The bytes of every file under root, as `du -sb` counts them less the directories' own entries."""
    return sum(scan(root, temporaries=True).values())


def entries_json(entries: list[FileEntry]) -> list[dict[str, Any]]:
    return [asdict(e) for e in entries]


def write_whole(path: Path, data: bytes) -> None:
    """Write ``path`` so that a reader finds it whole or not at all, through a temporary file of this writer's own
    (two processes writing the same file at once each rename their own: the last one stands)."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        scratch.write_bytes(data)
        scratch.replace(path)
    finally:
        scratch.unlink(missing_ok=True)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def handover_file(checkpoint: Path) -> Path:
    """A blue/green upgrade's handover file (dashboard/services/blue_green.py): its presence tells the new version's
    source that the job's old version is fenced, and that it reads on from the stream after the old version's last
    planned batch. Beside the new version's checkpoint directory, named after it."""
    return checkpoint.parent / f"{checkpoint.name}.handover"


def closing_file(checkpoint: Path) -> Path:
    """A stopping driver's word to its query's source (a spread Redis stream source, whose batches start at the job's
    phase of the interval): admit what has arrived now, so the last batch before the stop takes it and the next run
    starts right after a commit; the source removes it as it admits. Beside the checkpoint directory, named after it."""
    return checkpoint.parent / f"{checkpoint.name}.closing"


def follow_mirror(checkpoint: Path) -> Path:
    """Where a blue/green upgrade keeps copies of the job's committed batches' offset and commit files for its new
    version, whose checkpoint is ``checkpoint``: Spark purges the job's own past its retention (``batches_retained``),
    and a new version that started late (a long repartition, a driver's start) still needs every batch after its
    fork. Beside the new version's checkpoint, named after it."""
    return checkpoint.parent / f"{checkpoint.name}.follow"


def mirror_committed(blue: Path, mirror: Path, since: int) -> int:
    """Copy each batch ``blue`` committed from ``since`` on (its offsets file, then its commit) into ``mirror``,
    unless there already; returns how many were copied. Both files never change once the commit is written, so a copy
    made once stays true."""
    copied = 0
    have = set(_batch_files(mirror, "commits"))
    for batch in _batch_files(blue, "commits"):
        if batch < since or batch in have:
            continue
        for log in ("offsets", "commits"):
            try:
                text = (blue / log / str(batch)).read_bytes()
            except FileNotFoundError:  # purged meanwhile: it stays missing, as it would have been without a mirror
                break
            (mirror / log).mkdir(parents=True, exist_ok=True)
            write_whole(mirror / log / str(batch), text)
        else:
            copied += 1
    return copied


def mark_handed_over(checkpoint: Path, batch: int) -> None:
    """Write the handover file: the old version's last committed batch, after which the new version writes."""
    path = handover_file(checkpoint)
    if handed_over_after(checkpoint) != batch:  # the console and green's driver both write it, maybe at once
        write_whole(path, json.dumps({"after_batch": batch, "at": time.time()}).encode())


def handed_over_after(checkpoint: Path) -> int | None:
    """The batch after which a blue/green upgrade's new version took over this checkpoint (None: no handover here).
    The old version wrote the job's sinks up to it: a run of this checkpoint that replays such a batch (the new
    version was killed in it) writes no sink for it."""
    try:
        found = json.loads(handover_file(checkpoint).read_text()).get("after_batch")
    except (OSError, ValueError, AttributeError):
        return None
    return int(found) if isinstance(found, int) else None


LINEAGE = "statekeeper-lineage.json"


def write_lineage(checkpoint: Path, base: int, **about: Any) -> None:
    """Start a new line of the job's batches in this (new, empty) checkpoint: Spark numbers its batches from 0 again,
    and the job's sinks number them from ``base`` on (``base`` is the batch after the old line's last, N + 1), so a
    state migration or an empty-state upgrade continues the sinks' history rather than rewinding it. Inside the
    checkpoint directory, so a savepoint, a restore and a blue/green fork of the new line keep it."""
    checkpoint.mkdir(parents=True, exist_ok=True)
    write_whole(checkpoint / LINEAGE, json.dumps({"base": int(base), **about}, sort_keys=True, default=str).encode())


def lineage(checkpoint: Path) -> dict[str, Any]:
    """What ``write_lineage`` wrote in this checkpoint ({}: a line numbered as Spark numbers it). CheckpointError when
    the file is there and damaged."""
    path = checkpoint / LINEAGE
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        found = exc
    if not isinstance(found, dict) or not isinstance(found.get("base"), int):
        # read as no base, the sinks would take the line's batch 0 for a rollback to before their whole history
        raise CheckpointError(f"{path} is damaged ({found}): the sinks cannot tell which batches this line's are")
    return found


def lineage_base(checkpoint: Path) -> int:
    """The sinks' number of this checkpoint's batch 0 (0 unless a migration or an empty-state upgrade began it)."""
    return int(lineage(checkpoint).get("base", 0))


def seed_dir(checkpoint: Path) -> Path:
    """A state migration's output (Parquet), beside the new checkpoint it seeds: the new version's first batch reads
    it as its transformWithState operator's initial state; Spark keeps it in the state from then on."""
    return checkpoint.parent / f"{checkpoint.name}.seed"
