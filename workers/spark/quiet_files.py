"""Hadoop's local file system without a forked `chmod` for each file it creates.

Without Hadoop's native library (PySpark's wheel has none), Hadoop's local file system forks `chmod` for every file
and directory it creates. A RocksDB state store writes each partition's files through it at every commit (the files
and their `.crc`) and copies them back at every load: about ten forks a partition, which on a busy 2-core host made a
url-counts job's state commit 280–300 ms a batch against 80–150 ms without them (``bench.restart_cost``'s setting,
docs/benchmarks.md). The two classes in ``workers/spark/hadoop/`` are Hadoop's own local file systems with the
permission set through java.nio. They are compiled against the Hadoop jar PySpark ships, once, the first time a
session is built, into a cache directory keyed by their sources; a machine without `javac` (a JRE only) keeps Hadoop's
classes, and says so once in the log."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "hadoop"
QUIET_LOCAL = "statekeeper.hadoop.QuietLocalFileSystem"  # the `file:` scheme's class: checksummed, as Hadoop's
QUIET_RAW_LOCAL = "statekeeper.hadoop.QuietRawLocalFileSystem"  # without `.crc` side files, as RawLocalFileSystem


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "statekeeper"


def hadoop_jar() -> Path | None:
    import pyspark

    found = sorted((Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar"))
    return found[-1] if found else None


def javac() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "javac").is_file():
        return str(Path(home) / "bin" / "javac")
    return shutil.which("javac")


def build(target: Path, compiler: str, against: Path, sources: list[Path]) -> None:
    """Compile ``sources`` and write their classes as a jar at ``target``, atomically: processes that build it at
    the same moment each write their own and the last rename wins, with the same content."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        classes = Path(scratch) / "classes"
        subprocess.run(
            [compiler, "--release", "17", "-nowarn", "-cp", str(against), "-d", str(classes), *map(str, sources)],
            check=True, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        built = Path(scratch) / "quiet.jar"
        with zipfile.ZipFile(built, "w") as jar:
            jar.writestr("META-INF/MANIFEST.MF", "Manifest-Version: 1.0\r\n\r\n")
            for path in sorted(classes.rglob("*.class")):
                jar.write(path, path.relative_to(classes).as_posix())
        os.replace(built, target)


@functools.cache
def quiet_files_jar() -> str | None:
    """The jar of the quiet local file systems, built if it is not yet; None where it cannot be (no `javac`, no
    Hadoop jar in PySpark), and Hadoop's own classes are used."""
    sources = sorted(SOURCES.glob("*.java"))
    against = hadoop_jar()
    if not sources or against is None:
        return None
    digest = hashlib.sha256(against.name.encode())
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    target = cache_dir() / f"statekeeper-hadoop-{digest.hexdigest()[:16]}.jar"
    if target.is_file():
        return str(target)
    compiler = javac()
    if compiler is None:
        log.warning("no javac here: Hadoop's local file system forks chmod for each file it writes (a JDK removes it)")
        return None
    try:
        build(target, compiler, against, sources)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("the quiet local file system could not be built, Hadoop's own is used: %s", detail)
        return None
    return str(target)


def quiet_files_conf(master: str) -> dict[str, str]:
    """A session's settings for the quiet local file system: on a local master only (a cluster's executors would need
    the jar too, and their checkpoints are rarely on a local disk)."""
    jar = quiet_files_jar() if master.startswith("local") else None
    if jar is None:
        return {}
    return {"spark.driver.extraClassPath": jar, "spark.hadoop.fs.file.impl": QUIET_LOCAL}
