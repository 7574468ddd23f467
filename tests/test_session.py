"""A driver's Python process holds pandas, numpy and pyarrow only when its pipeline uses them
(``workers.spark.testing_stand_in``): a real url-counts query on a real Redis stream, in a process of its own, as a
job's own driver runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

DRIVER = """
import json, random, sys, time
import django
django.setup()
import redis
from dashboard import pipelines
from workers.spark.query import JobSpec, start_query
from workers.spark.session import build_session

stream, checkpoint = sys.argv[1], sys.argv[2]
pipeline = pipelines.get("url-counts")
client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
line = pipeline.generator(random.Random(3))
now = int(time.time() * 1000)
for n in range(40):
    client.xadd(stream, {"v": line(now + n)})
spark = build_session("stand-in-check", "local[1]")
spec = JobSpec(
    job_id=1, name="stand-in-check", pipeline="url-counts", stream=stream, redis_url="redis://127.0.0.1:6379/0",
    backend="rocksdb", trigger_seconds=1, partitions=2, parallelism=1, checkpoint=checkpoint, batches_retained=10,
    max_records=1000, dead_letter=stream + ":dead", available_now=True,
)
rows = []
query = start_query(spark, spec, pipeline, lambda batch, batch_id: rows.extend(batch.collect()))
query.awaitTermination(180)
client.delete(stream, stream + ":dead")
imported = sorted(m for m in ("pandas", "numpy", "pyarrow") if m in sys.modules)
counted = sum(r["requests"] for r in rows)

import numpy
from pyspark.sql import functions as F
numpy_lit = spark.range(1).select(F.lit(numpy.int64(41)) + 1).first()[0]  # numpy's values once a pipeline has numpy
from pyspark.testing import assertDataFrameEqual  # a team's test helper: PySpark's own
assertDataFrameEqual(spark.range(2), spark.range(2))
print(json.dumps({"imported": imported, "counted": counted, "numpy_lit": numpy_lit,
                  "helper": assertDataFrameEqual.__module__}))
"""


@pytest.mark.spark
def test_a_url_counts_driver_runs_its_batch_without_pandas_numpy_or_pyarrow_and_gets_them_when_asked(tmp_path):
    stream = f"test:stand-in:{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "statekeeper.settings_test", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, stream, str(tmp_path / "checkpoint")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["counted"] == 40, seen
    assert seen["imported"] == [], f"the driver imported {seen['imported']} for a pipeline that uses none of them"
    assert seen["numpy_lit"] == 42
    assert seen["helper"] == "pyspark.testing.utils"
