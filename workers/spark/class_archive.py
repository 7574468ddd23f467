"""Class data sharing for Spark's JVMs: the classes a driver loads at its start (Spark's, Hadoop's, Scala's: about
twenty thousand), parsed and verified once into an archive on disk that every later JVM maps instead.

Each driver, standby, spare, state reader and test session is a JVM of its own, and on this project's hosts a JVM's
start is most of a cold start: 7.5–8.6 s to a SparkSession and 3.3–4.4 s more to its first job on an idle 2-core host,
against 5.1–5.2 s and 1.7–2.1 s with the archive (docs/benchmarks.md). The archive is mapped read-only, so the
JVMs of one host also share its pages rather than each holding its own copy of the classes' metadata (mapped where it
was written: ``AT_ITS_ADDRESS``).

It is a dynamic archive of the JDK's (``-XX:ArchiveClassesAtExit``), made once per JDK, pyspark and class path by
``python -m workers.spark.make_class_archive`` (the set-up scripts run it): a JVM started through ``build_session`` runs a
streaming query of every kind the drivers run (a Python data source, RocksDB state, a Python sink), and writes the
archive as it exits. A JVM uses it with ``-Xshare:auto``: an archive the JVM cannot use (another JDK, another class
path) is ignored with a warning, never a failure. ``STATEKEEPER_CLASS_ARCHIVE=off`` starts every JVM without it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
from pathlib import Path

ARCHIVE_DIR = Path(__file__).resolve().parents[2] / "var" / "cache" / "jvm"
# the JVM's sharing says only what fails: it warns on its stdout (the driver's log) of each class it cannot archive
# (signed jars, generated classes: hundreds of lines) and of an archive it cannot map
QUIET = "-Xlog:cds*=error"


def _java() -> Path | None:
    home = os.environ.get("JAVA_HOME", "").strip()
    found = Path(home) / "bin" / "java" if home else None
    if found is None or not found.exists():
        which = shutil.which("java")
        found = Path(which) if which else None
    return found.resolve() if found is not None else None


@functools.cache
def _key() -> str | None:
    """What the archive must match, hashed: the JDK (its binary and when it was installed), pyspark and Spark's jars.
    None without a JDK. Read once a process: neither changes under a running one, and every session's options ask."""
    import pyspark

    java = _java()
    if java is None:
        return None
    jars = sorted(p.name for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar"))
    key = "\n".join([str(java), str(java.stat().st_mtime_ns), pyspark.__version__, *jars])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def archive_path() -> Path | None:
    """Where the archive for this JDK, pyspark and Spark's jars is (or would be); None without a JDK."""
    key = _key()
    return None if key is None else ARCHIVE_DIR / f"spark-{key}.jsa"


# Debian's JDK 17 maps an archive at an address of its own choosing (ArchiveRelocationMode 1, for address-space
# randomization) and then patches every pointer in it: each JVM's copy becomes private (133 MB of the 167 MB archive,
# measured in each of the demo stack's JVMs), and nothing is shared. Mode 0 maps it where it was written, relocating
# only when that address is taken: its read-only part stays shared by every JVM of the host.
AT_ITS_ADDRESS = "-XX:+UnlockDiagnosticVMOptions -XX:ArchiveRelocationMode=0"


def _switched_off(name: str) -> bool:
    return os.environ.get(name, "on").strip().lower() in ("0", "off", "false", "no")


def archive_options() -> str:
    """The JVM options that map the archive, when it has been made and is not switched off; else empty.
    ``STATEKEEPER_CLASS_ARCHIVE_SHARED=off`` keeps the JDK's randomized address (each JVM then holds its own copy)."""
    if _switched_off("STATEKEEPER_CLASS_ARCHIVE"):
        return ""
    path = archive_path()
    if path is None or not path.is_file():
        return ""
    shared = "" if _switched_off("STATEKEEPER_CLASS_ARCHIVE_SHARED") else f" {AT_ITS_ADDRESS}"
    return f"-XX:SharedArchiveFile={path} -Xshare:auto{shared} {QUIET}"
