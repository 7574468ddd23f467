"""The class archive Spark's JVMs map (``workers.spark.class_archive``): the test session's own JVM maps it when the
set-up made it, a JVM handed an archive it cannot use still starts, and the operator can switch it off."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from workers.spark import class_archive
from workers.spark.class_archive import archive_options, archive_path


def archive_pages(pid: int, path: Path) -> dict[str, int]:
    """The JVM's resident and private (patched) kB of its mappings of the archive file."""
    sizes = {"Rss": 0, "Private_Dirty": 0}
    mine = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            mine = line.endswith(str(path))
        elif mine and (found := re.match(r"^(Rss|Private_Dirty):\s+(\d+) kB", line)):
            sizes[found[1]] += int(found[2])
    return sizes


@pytest.mark.spark
def test_the_session_jvm_maps_the_archive_the_set_up_made(spark):
    path = archive_path()
    if path is None or not path.is_file():
        pytest.skip("no class archive here: bin/test and bin/dev make it before anything starts a JVM")
    jvm = int(spark.sparkContext._gateway.proc.pid)
    options = Path(f"/proc/{jvm}/cmdline").read_bytes().split(b"\0")
    assert f"-XX:SharedArchiveFile={path}".encode() in options
    assert str(path) in Path(f"/proc/{jvm}/maps").read_text(), "the JVM mapped the archive's classes"
    # where it was written, so that its read-only part is shared: relocated, every page of it would be patched
    # (private), as in each JVM of the demo stack before (133 of its 167 MB)
    sizes = archive_pages(jvm, path)
    assert sizes["Private_Dirty"] < sizes["Rss"] / 2, sizes


def test_a_jvm_given_an_archive_it_cannot_use_still_starts(tmp_path):
    java = shutil.which("java")
    assert java is not None
    broken = tmp_path / "spark-0000.jsa"
    broken.write_bytes(b"not an archive" * 1000)  # another JDK's, or a partial copy
    done = subprocess.run(
        [java, f"-XX:SharedArchiveFile={broken}", "-Xshare:auto", class_archive.QUIET, "-version"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "cds" not in done.stdout, "nothing said on the driver's log"


def test_the_archive_is_named_per_jdk_and_pyspark_and_can_be_switched_off(monkeypatch, tmp_path):
    monkeypatch.setattr(class_archive, "ARCHIVE_DIR", tmp_path)
    monkeypatch.delenv("STATEKEEPER_CLASS_ARCHIVE", raising=False)
    path = archive_path()
    assert path is not None and path.parent == tmp_path and path.name.startswith("spark-")
    assert archive_options() == "", "not made yet: no option"
    path.write_bytes(b"made")
    assert archive_options().split()[:2] == [f"-XX:SharedArchiveFile={path}", "-Xshare:auto"]
    assert "-XX:ArchiveRelocationMode=0" in archive_options(), "mapped where it was written: shared"
    monkeypatch.setenv("STATEKEEPER_CLASS_ARCHIVE_SHARED", "off")
    assert "ArchiveRelocationMode" not in archive_options(), "at the JDK's randomized address, as asked"
    monkeypatch.setenv("STATEKEEPER_CLASS_ARCHIVE", "off")
    assert archive_options() == ""
