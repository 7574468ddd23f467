"""Create the demo jobs and request the start of the first three (memory and RocksDB-incremental on Redis streams, and
url-counts on a Kafka topic of three partitions, and the same count in Spark's real-time mode into the topic
url-counts-live); the next, on the
example package's user-sessions pipeline, waits to be started and upgraded (Deploys tab), as does the fourth, the team
job example's customer-spend (nested orders, with parameters: upgrade it to a shorter window or a lower threshold),
which also writes its own table in the ``team_orders`` database (on PostgreSQL) and Parquet files under var/lake.
Spark's state reader is started too, so that the first preview finds it warm."""

from __future__ import annotations

import os
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

from dashboard import kafka, pipelines
from dashboard.models import ACTIVE_RUN_STATUSES, Job, SourceKind, StateBackend
from dashboard.services.audit import audit_record
from dashboard.services.enqueue import WARM_STATE_READER, enqueue
from dashboard.services.errors import ActionRefused
from dashboard.services.runs import job_request_start
from dashboard.services.secrets import into_secret

DEMO_JOBS = [
    {
        "name": "url-counts-memory",
        "pipeline": "url-counts",
        "source_stream": "events:access-log",
        "state_backend": StateBackend.MEMORY,
        "parallelism": 1,
        "trigger_interval_seconds": 2,
        "driver": "shared",
    },
    {
        "name": "orders-rocksdb",
        "pipeline": "order-state-machine-v2",
        "source_stream": "events:orders",
        "state_backend": StateBackend.ROCKSDB_INCREMENTAL,
        "parallelism": 1,
        "trigger_interval_seconds": 2,
        "driver": "shared",
    },
    {
        "name": "urls-kafka",
        "pipeline": "url-counts",
        "source_kind": SourceKind.KAFKA,
        "source_stream": "access-log",  # on STATEKEEPER_KAFKA_BOOTSTRAP, three partitions (produce_events makes it)
        "state_backend": StateBackend.ROCKSDB_INCREMENTAL,
        "parallelism": 1,
        "trigger_interval_seconds": 2,
        "driver": "shared",
    },
    {  # the same count in Spark's real-time mode, into the topic url-counts-live: each count as it changes
        "name": "urls-live",
        "pipeline": "url-counts-live",
        "source_kind": SourceKind.KAFKA,
        "source_stream": "access-log",
        "state_backend": StateBackend.ROCKSDB,
        "parallelism": 1,
        "state_partitions": 2,
        "trigger_interval_seconds": 5,  # real-time mode: how often a checkpoint is written
        "driver": "own",  # its tasks hold their cores
        "real_time": True,
    },
    {
        "name": "sessions-rocksdb",
        "pipeline": "user-sessions",
        "source_stream": "events:sessions",
        "state_backend": StateBackend.ROCKSDB,
        "parallelism": 1,
        "trigger_interval_seconds": 2,
        "driver": "shared",
        "start": False,
    },
    {
        "name": "spend-rocksdb",
        "pipeline": "customer-spend",
        "source_stream": "events:team-orders",
        "state_backend": StateBackend.ROCKSDB,
        "parallelism": 1,
        "trigger_interval_seconds": 2,
        "driver": "shared",
        "parameters": {"window_minutes": 5, "threshold": 1_000_000},
        "start": False,
    },
]


LIVE_TOPIC = "url-counts-live"  # the real-time job's output


def team_sinks() -> dict[str, str]:
    """The team job's own sinks in the demo: its table in the team_orders database beside the console's (the set-up creates
    it and names it in STATEKEEPER_DEMO_TEAM_DSN), and a Parquet directory under var/."""
    values = {"lake_dir": str(settings.BASE_DIR / "var" / "lake" / "customer_spend")}
    if dsn := os.environ.get("STATEKEEPER_DEMO_TEAM_DSN", ""):  # bin/dev: the owner's address (the app role has none)
        # a password in that address goes into a secret: a job's parameters never hold one
        values["orders_dsn"] = into_secret(dsn, name="demo-team-db-password", username="seed_demo")
    return values


class Command(BaseCommand):
    help = "Create the demo jobs if missing and start them."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--no-start", action="store_true")

    def handle(self, *args: Any, **opts: Any) -> None:
        for demo in DEMO_JOBS:
            spec = {k: v for k, v in demo.items() if k != "start"}
            if spec["pipeline"] == "customer-spend":
                spec["parameters"] = {**dict(spec["parameters"]), **team_sinks()}  # type: ignore[call-overload]
            if spec.get("source_kind") == SourceKind.KAFKA:
                if not pipelines.kafka_connector():
                    self.stdout.write(f"skipped job {spec['name']}: Spark's Kafka connector is not on the class path")
                    continue
                spec["source_path"] = settings.KAFKA_BOOTSTRAP
            if spec.get("real_time"):
                spec["parameters"] = {"kafka": settings.KAFKA_BOOTSTRAP, "counts_topic": LIVE_TOPIC}
                try:
                    kafka.ensure_topic(settings.KAFKA_BOOTSTRAP, LIVE_TOPIC, 3)
                except kafka.KafkaUnavailable as exc:
                    self.stdout.write(f"skipped job {spec['name']}: its output topic cannot be made: {exc}")
                    continue
            if pipelines.find(str(spec["pipeline"])) is None:
                self.stdout.write(f"skipped job {spec['name']}: its pipeline {spec['pipeline']} is not installed")
                continue
            job, created = Job.objects.get_or_create(name=spec["name"], defaults=spec)
            self.stdout.write(f"{'created' if created else 'found'} job {job.name}")
            wanted = demo.get("start", True) and not opts["no_start"]
            if wanted and not job.runs.filter(status__in=ACTIVE_RUN_STATUSES).exists():
                try:
                    run = job_request_start(job=job)
                except ActionRefused as exc:  # a checkpoint an earlier console left: the operator chooses, on its page
                    self.stdout.write(f"  {exc}")  # "Not started: …", and why
                    continue
                self.stdout.write(f"  start requested: run #{run.id}")
                audit_record(
                    None, verb="start", job=job.name, target=f"run #{run.id}", outcome="requested", origin="demo"
                )
        if not opts["no_start"] and settings.STATE_READER_IDLE_SECONDS > 0:
            # Spark's state reader starts with the stack (its JVM and warm-up take a minute on a busy host), so that
            # the operator's first preview or inspection finds it warm; it ends after its idle time as ever
            enqueue(WARM_STATE_READER)
            self.stdout.write("starting Spark's state reader for previews and inspections")
