"""The results sink: keyed upserts into PostgreSQL, fenced by the checkpoint lease.

A replayed batch writes the same keys with the same values, so it changes nothing. The fencing token is checked before
the batch's frame is computed (computing it writes the state files) and again in the same transaction as the writes: a
driver that lost its lease can never write, even if it still runs.

A result the table cannot store (a key too long, a NUL, a lone surrogate, NaN, nesting past JSON's reach) is not
written: it goes to the job's dead-letter stream with stage "sink", and the batch goes on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from typing import Any

import redis
from django.db import connection, transaction
from pyspark.sql import DataFrame
from statekeeper_sdk import Pipeline, Rejected, Result

from dashboard.models import ResultRow
from workers.spark.sources.redis_streams import dead_letter

CHUNK = 5000
KEY_MAX = ResultRow._meta.get_field("key").max_length or 500


class Fenced(RuntimeError):
    """This driver no longer holds the checkpoint lease: another driver may own the checkpoint now."""


def encoded(key: Any, value: Any) -> tuple[str, str]:
    """The value as the JSON text the table stores, and why PostgreSQL would refuse the result (and fail the whole
    batch with it): empty when it can be stored."""
    if not isinstance(key, str):
        return "", f"the key is a {type(key).__name__}, not text"
    if len(key) > KEY_MAX:
        return "", f"the key is {len(key):,} characters (limit {KEY_MAX})"
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
        (key + text).encode("utf-8")
    except RecursionError:
        return "", "the value is nested too deeply for JSON"
    except UnicodeEncodeError:
        return "", "a lone surrogate in the key or value: not valid Unicode"
    except (TypeError, ValueError) as exc:
        return "", f"the value is not JSON: {exc}"
    if "\x00" in key or "\\u0000" in text:
        return "", "a NUL character in the key or value"
    return text, ""


def lease_hold(cursor: Any, *, job_id: int, token: int, batch_id: int) -> None:
    """Raise Fenced unless ``token`` still holds the job's lease; inside a transaction, holds it until the commit."""
    lock = "" if connection.vendor == "sqlite" else " FOR SHARE"
    cursor.execute(f"SELECT lease_token FROM dashboard_job WHERE id = %s{lock}", [job_id])
    row = cursor.fetchone()
    if row is None or int(row[0]) != token:
        raise Fenced(
            f"job {job_id}: fencing token {token} is stale (now {row and row[0]}); not running batch {batch_id}"
        )


def write_results(
    *, job_id: int, token: int, batch_id: int, results: Iterable[Result], rejected: list[Rejected] | None = None
) -> int:
    """Upsert the results; the ones that cannot be stored are appended to ``rejected`` instead. A key given twice
    keeps its last value. Returns how many distinct keys were written."""
    latest = _storable(batch_id, results, rejected if rejected is not None else [])
    with transaction.atomic(), connection.cursor() as cursor:
        lease_hold(cursor, job_id=job_id, token=token, batch_id=batch_id)
        if connection.vendor == "postgresql":
            _copy_upsert(cursor, job_id, batch_id, latest)
        else:
            rows = [(job_id, kind, key, text, batch_id) for (kind, key), text in latest.items()]
            for start in range(0, len(rows), CHUNK):
                cursor.executemany(
                    f"INSERT INTO dashboard_resultrow (job_id, kind, key, value, batch_id, updated_at) "
                    f"VALUES (%s, %s, %s, %s, %s, CURRENT_TIMESTAMP) {UPSERT}",
                    rows[start : start + CHUNK],
                )
    return len(latest)


UPSERT = (
    "ON CONFLICT (job_id, kind, key) DO UPDATE SET value = EXCLUDED.value, batch_id = EXCLUDED.batch_id, "
    "updated_at = EXCLUDED.updated_at"
)


def _copy_upsert(cursor: Any, job_id: int, batch_id: int, latest: dict[tuple[str, str], str]) -> None:
    """COPY the batch into this session's scratch table, then one upsert from it: a round trip per batch, not per
    row. The scratch table is emptied first: inside an outer transaction no commit has emptied it yet."""
    cursor.execute(
        "CREATE TEMP TABLE IF NOT EXISTS sink_batch (kind text, key text, value jsonb) ON COMMIT DELETE ROWS"
    )
    cursor.execute("TRUNCATE sink_batch")
    with cursor.cursor.copy("COPY sink_batch (kind, key, value) FROM STDIN") as copy:
        for (kind, key), text in latest.items():
            copy.write_row((kind, key, text))
    cursor.execute(
        "INSERT INTO dashboard_resultrow (job_id, kind, key, value, batch_id, updated_at) "
        f"SELECT %s, kind, key, value, %s, CURRENT_TIMESTAMP FROM sink_batch {UPSERT}",
        [job_id, batch_id],
    )


def _storable(batch_id: int, results: Iterable[Result], rejected: list[Rejected]) -> dict[tuple[str, str], str]:
    """The results that can be stored, one per key (the last: an upsert cannot change a row twice in one statement),
    as JSON text; the others go to ``rejected``."""
    latest: dict[tuple[str, str], str] = {}
    for kind, key, value in results:
        text, reason = encoded(key, value)
        if reason:
            digest = hashlib.sha1(repr((kind, key)).encode("utf-8", "backslashreplace")).hexdigest()[:16]
            payload = repr((kind, key, value))[:65536].encode("utf-8", "backslashreplace")
            rejected.append(Rejected(f"batch-{batch_id}:{kind}:{digest}", "sink", reason, payload))
        else:
            latest[(kind, key)] = text
    return latest


def batch_writer(
    *, job_id: int, token: int, pipeline: Pipeline, dead_letters: str = "", redis_url: str = ""
) -> Callable[[DataFrame, int], None]:
    client: list[Any] = []

    def write(frame: DataFrame, batch_id: int) -> None:
        # before the frame is computed: computing it runs the stateful operators, which write the batch's state files
        with connection.cursor() as cursor:
            lease_hold(cursor, job_id=job_id, token=token, batch_id=batch_id)
        rejected: list[Rejected] = []
        write_results(
            job_id=job_id,
            token=token,
            batch_id=batch_id,
            results=pipeline.results(frame.collect()),  # every partition at once, not a job each
            rejected=rejected,
        )
        if rejected and dead_letters:
            if not client:
                client.append(redis.Redis.from_url(redis_url, socket_timeout=10))
            dead_letter(client[0], dead_letters, rejected)  # each once: a replayed batch rejects the same results

    return write
