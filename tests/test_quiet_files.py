"""The quiet local file system: Hadoop's local file system with permissions set without forking `chmod`."""

from __future__ import annotations

import stat
import zipfile
from pathlib import Path
from typing import Any

import pytest

from workers.spark import quiet_files
from workers.spark.quiet_files import QUIET_LOCAL, QUIET_RAW_LOCAL, quiet_files_conf
from workers.spark.session import RAW_LOCAL_FILES, quiet_raw_local


def local_fs(spark: Any) -> Any:
    jvm = spark._jvm
    return jvm.org.apache.hadoop.fs.FileSystem.getLocal(spark._jsc.hadoopConfiguration())


def test_the_sessions_local_file_system_is_the_quiet_one_and_keeps_checksums(spark, tmp_path):
    fs = local_fs(spark)
    assert fs.getClass().getName() == QUIET_LOCAL
    assert fs.getRawFileSystem().getClass().getName() == QUIET_RAW_LOCAL
    out = fs.create(spark._jvm.org.apache.hadoop.fs.Path(f"file:{tmp_path}/state.zip"), True)
    out.write(bytearray(b"state"))
    out.close()
    assert (tmp_path / "state.zip").read_bytes() == b"state"
    assert (tmp_path / ".state.zip.crc").exists(), "RocksDB's file manager relies on the checksummed file system"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o600, 0o755, 0o700, 0o000, 0o1777])
def test_permissions_are_set_as_hadoop_sets_them(spark, tmp_path, mode):
    """Every mode a file or directory may be given comes out as asked; those java.nio cannot set (the sticky bit)
    go through Hadoop's own way."""
    jvm = spark._jvm
    target = tmp_path / "made"
    target.mkdir()
    path = jvm.org.apache.hadoop.fs.Path(f"file:{target}")
    local_fs(spark).setPermission(path, jvm.org.apache.hadoop.fs.permission.FsPermission(mode))
    assert stat.S_IMODE(target.stat().st_mode) == mode
    target.chmod(0o700)  # for the clean-up


def test_a_memory_jobs_raw_file_system_is_the_quiet_raw_one_in_a_session_that_has_it(spark):
    conf = {**RAW_LOCAL_FILES, "spark.sql.shuffle.partitions": "2"}
    assert quiet_raw_local(spark, conf)["fs.file.impl"] == QUIET_RAW_LOCAL
    assert quiet_raw_local(spark, {"spark.sql.shuffle.partitions": "2"}) == {"spark.sql.shuffle.partitions": "2"}


def test_the_jar_is_built_once_into_the_cache_and_found_there(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    jar = quiet_files.quiet_files_jar.__wrapped__()
    assert jar is not None and Path(jar).parent == tmp_path / "statekeeper"
    names = set(zipfile.ZipFile(jar).namelist())
    assert {
        "statekeeper/hadoop/QuietLocalFileSystem.class",
        "statekeeper/hadoop/QuietRawLocalFileSystem.class",
    } <= names
    monkeypatch.setattr(quiet_files, "javac", lambda: pytest.fail("built again"))
    assert quiet_files.quiet_files_jar.__wrapped__() == jar


def test_without_javac_sessions_keep_hadoops_file_system_and_say_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(quiet_files, "javac", lambda: None)
    assert quiet_files.quiet_files_jar.__wrapped__() is None
    assert "no javac" in caplog.text
    assert not list(tmp_path.rglob("*.jar"))


def test_a_cluster_session_keeps_hadoops_file_system():
    assert quiet_files_conf("spark://127.0.0.1:7077") == {}
    assert quiet_files_conf("local[2]")["spark.hadoop.fs.file.impl"] == QUIET_LOCAL
