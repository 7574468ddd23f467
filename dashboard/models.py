from __future__ import annotations

from pathlib import Path

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from workers.pipelines import CATALOG

JOB_NAME = RegexValidator(
    r"^[a-z0-9][a-z0-9-]{0,62}$", "Use lower-case letters, digits and hyphens (it names the checkpoint directory)."
)
STREAM_NAME = RegexValidator(r"^[A-Za-z0-9:._-]{1,200}$", "Use letters, digits and : . _ - only.")


class StateBackend(models.TextChoices):
    MEMORY = "memory", "Memory (HDFS-backed state store)"
    ROCKSDB = "rocksdb", "RocksDB"
    ROCKSDB_INCREMENTAL = "rocksdb-incremental", "RocksDB, incremental (changelog checkpointing)"


class Job(models.Model):
    name = models.CharField(max_length=63, unique=True, validators=[JOB_NAME])
    pipeline = models.CharField(max_length=40, choices=[(name, name) for name in CATALOG])
    source_stream = models.CharField(max_length=200, validators=[STREAM_NAME], help_text="Redis stream key")
    state_backend = models.CharField(max_length=24, choices=StateBackend.choices, default=StateBackend.MEMORY)
    trigger_interval_seconds = models.FloatField(
        default=2.0, validators=[MinValueValidator(0.1), MaxValueValidator(3600)]
    )
    state_partitions = models.PositiveIntegerField(
        default=4,
        validators=[MinValueValidator(1), MaxValueValidator(1024)],
        help_text="spark.sql.shuffle.partitions at the first run; frozen in the checkpoint after it",
    )
    parallelism = models.PositiveIntegerField(
        default=2, validators=[MinValueValidator(1), MaxValueValidator(64)], help_text="cores running the query"
    )
    batches_retained = models.PositiveIntegerField(
        default=100,
        validators=[MinValueValidator(2), MaxValueValidator(10_000)],
        help_text="committed batches kept restorable (spark.sql.streaming.minBatchesToRetain)",
    )
    max_records_per_batch = models.PositiveIntegerField(
        default=20_000, validators=[MinValueValidator(1), MaxValueValidator(10_000_000)]
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # The checkpoint lease: whoever holds lease_token may run a driver on this job's checkpoint until it expires.
    lease_token = models.BigIntegerField(default=0)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    latest_checkpoint = models.ForeignKey(
        "Checkpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def directory(self) -> Path:
        path = (settings.CHECKPOINT_ROOT / self.name).resolve()
        if settings.CHECKPOINT_ROOT not in path.parents:
            raise ValueError(f"job directory {path} is outside the checkpoint root")
        return path

    @property
    def checkpoint_location(self) -> Path:
        return self.directory / "checkpoint"

    @property
    def dead_letter_stream(self) -> str:
        return f"{self.source_stream}:dead:{self.name}"

    def has_state(self) -> bool:
        """True once a batch has been committed to the checkpoint: from then on Spark has frozen its settings."""
        commits = self.checkpoint_location / "commits"
        return self.latest_checkpoint_id is not None or (commits.is_dir() and any(commits.iterdir()))

    def lease_is_held(self) -> bool:
        return self.lease_expires_at is not None and self.lease_expires_at > timezone.now()


class RunStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    STARTING = "starting", "Starting"
    RUNNING = "running", "Running"
    STOPPING = "stopping", "Stopping"
    STOPPED = "stopped", "Stopped"
    FAILED = "failed", "Failed"
    LOST = "lost", "Lost"
    REFUSED = "refused", "Refused"


ACTIVE_RUN_STATUSES = (RunStatus.PENDING, RunStatus.STARTING, RunStatus.RUNNING, RunStatus.STOPPING)


class Run(models.Model):
    """One life of a job's driver process, from start request to exit."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="runs")
    status = models.CharField(max_length=12, choices=RunStatus.choices, default=RunStatus.PENDING)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    requested_at = models.DateTimeField(default=timezone.now)
    fencing_token = models.BigIntegerField(null=True, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    host = models.CharField(max_length=200, blank=True)
    spark_master = models.CharField(max_length=200, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    message = models.TextField(blank=True)
    error = models.TextField(blank=True)
    log_path = models.CharField(max_length=500, blank=True)

    class Meta:
        ordering = ["-id"]
        constraints = [
            # At most one run per job may be in flight: the database refuses a second, whatever the race.
            models.UniqueConstraint(
                fields=["job"],
                condition=models.Q(status__in=["pending", "starting", "running", "stopping"]),
                name="one_active_run_per_job",
            )
        ]

    def __str__(self) -> str:
        return f"{self.job.name} run {self.pk}"

    @property
    def is_active(self) -> bool:
        return self.status in ACTIVE_RUN_STATUSES


class CheckpointKind(models.TextChoices):
    FULL = "full", "Full"
    INCREMENTAL = "incremental", "Incremental"


class Checkpoint(models.Model):
    """A committed micro-batch: a consistent, restorable snapshot of the job's state and source offsets."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.SET_NULL, related_name="checkpoints")
    batch_id = models.BigIntegerField()
    committed_at = models.DateTimeField()
    duration_ms = models.BigIntegerField(help_text="end to end: triggerExecution")
    wal_commit_ms = models.BigIntegerField(default=0)
    add_batch_ms = models.BigIntegerField(default=0)
    commit_offsets_ms = models.BigIntegerField(default=0)
    latest_offset_ms = models.BigIntegerField(default=0)
    query_planning_ms = models.BigIntegerField(default=0)
    state_commit_ms = models.BigIntegerField(default=0)
    input_rows = models.BigIntegerField(default=0)
    input_rate = models.FloatField(default=0)
    processed_rate = models.FloatField(default=0)
    state_rows_total = models.BigIntegerField(default=0)
    state_rows_updated = models.BigIntegerField(default=0)
    state_rows_removed = models.BigIntegerField(default=0)
    state_memory_bytes = models.BigIntegerField(default=0)
    checkpointed_bytes = models.BigIntegerField(default=0, help_text="bytes this batch added to the checkpoint")
    full_size_bytes = models.BigIntegerField(default=0, help_text="checkpoint directory size after this batch")
    kind = models.CharField(max_length=12, choices=CheckpointKind.choices, default=CheckpointKind.INCREMENTAL)
    start_offset = models.JSONField(null=True, blank=True)
    end_offset = models.JSONField(null=True, blank=True)
    latest_offset = models.JSONField(null=True, blank=True)
    lag_records = models.BigIntegerField(null=True, blank=True)
    state_operators = models.JSONField(default=list)
    recorded_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-batch_id"]
        constraints = [models.UniqueConstraint(fields=["job", "batch_id"], name="one_checkpoint_per_batch")]
        indexes = [models.Index(fields=["job", "-batch_id"], name="checkpoint_job_batch")]

    def __str__(self) -> str:
        return f"{self.job_id}#{self.batch_id}"


class ResultRow(models.Model):
    """A pipeline's output, upserted on (job, kind, key) so that a replayed batch changes nothing."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="results")
    kind = models.CharField(max_length=40)
    key = models.CharField(max_length=500)
    value = models.JSONField()
    batch_id = models.BigIntegerField()
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "kind", "key"], name="one_result_per_key")]

    def __str__(self) -> str:
        return f"{self.kind} {self.key}"
