"""The results sink: keyed upserts into PostgreSQL, fenced by the checkpoint lease.

A replayed batch writes the same keys with the same values, so it changes nothing. The fencing token is checked in the
same transaction as the writes: a driver that lost its lease can never write, even if it still runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from itertools import islice

from django.db import connection, transaction
from pyspark.sql import DataFrame

from workers.spark.pipelines.base import Pipeline, Result

CHUNK = 5000


class Fenced(RuntimeError):
    """This driver no longer holds the checkpoint lease: another driver may own the checkpoint now."""


def write_results(*, job_id: int, token: int, batch_id: int, results: Iterable[Result]) -> int:
    written = 0
    lock = "" if connection.vendor == "sqlite" else " FOR SHARE"
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"SELECT lease_token FROM dashboard_job WHERE id = %s{lock}", [job_id])
        row = cursor.fetchone()
        if row is None or int(row[0]) != token:
            raise Fenced(
                f"job {job_id}: fencing token {token} is stale (now {row and row[0]}); not writing batch {batch_id}"
            )
        iterator = iter(results)
        while chunk := list(islice(iterator, CHUNK)):
            cursor.executemany(
                "INSERT INTO dashboard_resultrow (job_id, kind, key, value, batch_id, updated_at) "
                "VALUES (%s, %s, %s, %s, %s, CURRENT_TIMESTAMP) "
                "ON CONFLICT (job_id, kind, key) DO UPDATE SET value = EXCLUDED.value, "
                "batch_id = EXCLUDED.batch_id, updated_at = EXCLUDED.updated_at",
                [(job_id, kind, key, json.dumps(value), batch_id) for kind, key, value in chunk],
            )
            written += len(chunk)
    return written


def batch_writer(*, job_id: int, token: int, pipeline: Pipeline) -> Callable[[DataFrame, int], None]:
    def write(frame: DataFrame, batch_id: int) -> None:
        write_results(
            job_id=job_id, token=token, batch_id=batch_id, results=pipeline.results(list(frame.toLocalIterator()))
        )

    return write
