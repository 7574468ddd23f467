"""Create the two demo jobs (memory and RocksDB-incremental) and request their start."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from dashboard.models import ACTIVE_RUN_STATUSES, Job, StateBackend
from dashboard.services.audit import audit_record
from dashboard.services.runs import job_request_start

DEMO_JOBS = [
    {
        "name": "url-counts-memory",
        "pipeline": "url-counts",
        "source_stream": "events:access-log",
        "state_backend": StateBackend.MEMORY,
        "parallelism": 1,
        "trigger_interval_seconds": 2,
    },
    {
        "name": "orders-rocksdb",
        "pipeline": "order-state-machine",
        "source_stream": "events:orders",
        "state_backend": StateBackend.ROCKSDB_INCREMENTAL,
        "parallelism": 1,
        "trigger_interval_seconds": 2,
    },
]


class Command(BaseCommand):
    help = "Create the demo jobs if missing and start them."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--no-start", action="store_true")

    def handle(self, *args: Any, **opts: Any) -> None:
        for spec in DEMO_JOBS:
            job, created = Job.objects.get_or_create(name=spec["name"], defaults=spec)
            self.stdout.write(f"{'created' if created else 'found'} job {job.name}")
            if not opts["no_start"] and not job.runs.filter(status__in=ACTIVE_RUN_STATUSES).exists():
                run = job_request_start(job=job)
                self.stdout.write(f"  start requested: run #{run.id}")
                audit_record(
                    None, verb="start", job=job.name, target=f"run #{run.id}", outcome="requested", origin="demo"
                )
