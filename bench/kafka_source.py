"""What a benchmark needs to run its jobs on Kafka: Spark's Kafka connector on the class path of the drivers it starts
(the set-up's cached jars, var/jars/spark-kafka, unless STATEKEEPER_SPARK_JARS names one), and a topic per job on
STATEKEEPER_KAFKA_BOOTSTRAP (the broker bin/dev starts)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def use_cached_connector() -> None:
    """Name the cached connector's jars in STATEKEEPER_SPARK_JARS for this process and what it starts; SystemExit
    with the reason when the set-up has not fetched them."""
    listed = os.environ.get("STATEKEEPER_SPARK_JARS", "")
    if "spark-sql-kafka" in listed:
        return
    cached = sorted((ROOT / "var" / "jars" / "spark-kafka").glob("*.jar"))
    if not cached:
        raise SystemExit("Spark's Kafka connector is not in var/jars/spark-kafka: run ./bin/dev once")
    os.environ["STATEKEEPER_SPARK_JARS"] = ",".join(filter(None, [listed, *map(str, cached)]))
