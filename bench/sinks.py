"""The same pipeline (the team job's customer-spend: nested orders, spend per customer and window) at saturation, its
output going to one sink at a time: the console's results table, the team's own PostgreSQL table (a database other
than the console's, with its commit table and fence), and Parquet files in Spark's file-sink layout.

    .venv/bin/python -m bench.sinks [--events 200000] [--batch 50000] [--customers 50000] [--repeat 2]

Each run reads the whole backlog on a fresh checkpoint, batch after batch (trigger 0 s); a rate is over the batches
after the query's first. Output rows are the windows each batch updates (one per customer in the batch, about
``--customers`` a batch): a batch's rows reach a sink through the driver a partition at a time, never one collect()
of the batch, once it holds more than 5,000 rows. Uses Redis database 13, a job row in the development database and a
scratch database, removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import psycopg  # noqa: E402
import redis  # noqa: E402
from django.conf import settings  # noqa: E402
from statekeeper_sdk import ResultsTable  # noqa: E402

from bench.pipeline_throughput import ROOT, run  # noqa: I001 (sets the environment up first)
from dashboard import pipelines  # noqa: E402
from dashboard.models import Job, ResultRow  # noqa: E402
from workers.driver import job_spec  # noqa: E402
from workers.sink import CHUNK, batch_writer  # noqa: E402
from workers.spark.session import build_session  # noqa: E402

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def fill(client: Any, stream: str, events: int, customers: int) -> None:
    rng, now = random.Random(7), time.time()
    client.delete(stream)
    for start in range(0, events, 10_000):
        pipe = client.pipeline(transaction=False)
        for n in range(start, min(events, start + 10_000)):
            order = {
                "order_id": f"o-{n}", "customer": {"id": f"c-{rng.randrange(customers)}", "region": "eu"},
                "placed_at": datetime.fromtimestamp(now - rng.uniform(0, 60), UTC).isoformat(),
                "items": [{"sku": f"S{rng.randrange(40)}", "qty": rng.randint(1, 5), "price": "9.99"}
                          for _ in range(rng.randint(1, 3))],
            }  # fmt: skip
            pipe.xadd(stream, {"v": json.dumps(order)})
        pipe.execute()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=50_000, help="max records per micro-batch")
    parser.add_argument("--customers", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()

    client = redis.Redis.from_url(settings.REDIS_URL)
    database = f"bench_team_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(ADMIN, autocommit=True) as db:
        db.execute(f"CREATE DATABASE {database}")
    dsn = ADMIN.rsplit("/", 1)[0] + f"/{database}"
    base = pipelines.get("customer-spend")
    team, lake = base.sinks[1], base.sinks[2]
    sinks = {
        "results table (console)": (ResultsTable(),),
        "team table (PostgreSQL)": (team,),
        "Parquet files": (lake,),
        "all three": base.sinks,
    }
    job = Job.objects.create(
        name=f"bench-sinks-{int(time.time())}", pipeline="customer-spend", source_stream="bench:sinks",
        state_backend="memory", parallelism=2, max_records_per_batch=args.batch, lease_token=1,
    )  # fmt: skip
    spark = build_session("statekeeper-bench-sinks", "local[2]")
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in sinks}
    try:
        fill(client, job.source_stream, args.events, args.customers)
        for attempt in range(args.repeat + 1):  # the first round warms the code up and is not counted
            for name, chosen in sinks.items():
                pipeline = dataclasses.replace(base, sinks=chosen)
                checkpoint = ROOT / "checkpoints" / f"{job.id}-{attempt}-{len(figures[name])}-{name[:4]}"
                values = pipelines.parameter_values(
                    "customer-spend", {"orders_dsn": dsn, "lake_dir": str(ROOT / f"lake-{attempt}-{name[:4]}")}
                )
                spec = job_spec(job, trigger_seconds=0, checkpoint=str(checkpoint))
                ResultRow.objects.filter(job=job).delete()
                with psycopg.connect(dsn, autocommit=True) as db:
                    db.execute("DROP TABLE IF EXISTS customer_spend, statekeeper_sink_commits, statekeeper_sink_fences")
                sink = batch_writer(job_id=job.id, token=1, pipeline=pipeline, job_name=job.name,
                                    checkpoint=str(checkpoint), parameters=values, code="bench")  # fmt: skip
                figure = run(spark, spec, pipeline, "full", args.events, sink=sink)
                sink.sinks.close()  # type: ignore[attr-defined]
                if team in chosen:
                    with psycopg.connect(dsn) as db:
                        found = db.execute("SELECT sum(rows), count(*) FROM statekeeper_sink_commits").fetchone()
                    figure["team_rows"], figure["team_batches"] = found or (0, 0)
                if attempt:
                    figures[name].append(figure)
    finally:
        spark.stop()
        client.delete(job.source_stream, job.dead_letter_stream)
        ResultRow.objects.filter(job=job).delete()
        job.delete()
        with psycopg.connect(ADMIN, autocommit=True) as db:
            db.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
    print(
        f"customer-spend, {args.events:,} orders of {args.customers:,} customers, at most {args.batch:,} a batch, "
        f"trigger 0 s, local[2], memory state; median of {args.repeat} runs, batches after each query's first "
        f"(a batch's rows reach the driver a partition at a time above {CHUNK:,} rows)\n"
    )
    print("| sink | events/s | against the results table | output rows a batch | batches |\n|---|---:|---:|---:|---:|")
    rates = {n: statistics.median(f["steady_rows"] / f["seconds"] for f in runs) for n, runs in figures.items()}
    results = rates["results table (console)"]
    for name, runs in figures.items():
        rows = runs[0]["team_rows"] / max(1, runs[0]["team_batches"]) if runs[0].get("team_batches") else None
        print(
            f"| {name} | {rates[name]:,.0f} | {rates[name] / results:.2f}× | "
            f"{f'{rows:,.0f}' if rows else '–'} | {runs[0]['batches']} |"
        )


if __name__ == "__main__":
    main()
