"""A user's pipeline, found only through settings.PIPELINES: url-counts with a bug that fails every batch holding a
request for /boom (the kind of failure no source check can see)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from pyspark.sql import Row

from workers.spark.pipelines import url_counts
from workers.spark.pipelines.base import Result


def results(rows: list[Row]) -> Iterable[Result]:
    for kind, key, value in url_counts.results(rows):
        if key == "/boom":
            raise ValueError(f"cannot count {key}: a bug in this pipeline")
        yield kind, key, value


PIPELINE = replace(url_counts.PIPELINE, name="failing-urls", title="Requests per URL, but for /boom", results=results)
