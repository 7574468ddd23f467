from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models, transaction
from django.utils import timezone
from statekeeper_sdk._runtime.compatibility import parameter_changes
from statekeeper_sdk._runtime.events import MAX_FUTURE_SECONDS

JOB_NAME = RegexValidator(
    r"^[a-z0-9][a-z0-9-]{0,62}$", "Use lower-case letters, digits and hyphens (it names the checkpoint directory)."
)
STREAM_NAME = RegexValidator(r"^[A-Za-z0-9:._-]{1,200}$", "Use letters, digits and : . _ - only.")


class StateBackend(models.TextChoices):
    MEMORY = "memory", "Memory (HDFS-backed state store)"
    ROCKSDB = "rocksdb", "RocksDB"
    ROCKSDB_INCREMENTAL = "rocksdb-incremental", "RocksDB, incremental (changelog checkpointing)"


class AutoscaleMode(models.TextChoices):
    OFF = "off", "Off"
    RECOMMEND = "recommend", "Recommend (show only)"
    APPLY = "apply", "Apply (rescale automatically)"


class RestartStrategy(models.TextChoices):
    NONE = "none", "No automatic restart"
    FIXED = "fixed-delay", "Fixed delay"
    EXPONENTIAL = "exponential", "Exponential back-off"


class SourceKind(models.TextChoices):
    REDIS = "redis-stream", "Redis stream"
    FILES = "files", "Directory of files (Spark's file source)"
    KAFKA = "kafka", "Kafka topic (needs Spark's Kafka connector jars)"


class DriverMode(models.TextChoices):
    OWN = "own", "A driver process of its own"
    SHARED = "shared", "The shared driver, beside other jobs"


class FileFormat(models.TextChoices):
    JSON = "json", "JSON lines"
    CSV = "csv", "CSV with a header line"
    PARQUET = "parquet", "Parquet"


REAL_TIME_SLOTS = 32  # a real-time job's task slots in its own driver (``Job.task_slots``)


class Job(models.Model):
    name = models.CharField(max_length=63, unique=True, validators=[JOB_NAME])
    pipeline = models.CharField(max_length=40, help_text="the name of a registered pipeline (dashboard/pipelines.py)")
    source_kind = models.CharField(max_length=20, choices=SourceKind.choices, default=SourceKind.REDIS)
    source_stream = models.CharField(
        max_length=200,
        validators=[STREAM_NAME],
        help_text="Redis stream key, or Kafka topic (for a file source: the prefix of its dead-letter keys)",
    )
    source_path = models.CharField(
        max_length=500,
        blank=True,
        help_text="a file source's directory, or a Kafka source's bootstrap servers (host:port,...)",
    )
    source_format = models.CharField(max_length=10, choices=FileFormat.choices, default=FileFormat.JSON)
    source_security = models.JSONField(
        default=dict, blank=True,
        help_text="a Kafka source's TLS and SASL settings (security_protocol, sasl_mechanism, sasl_username, "
        "sasl_password as ${secret:NAME}, ssl_ca_file, ssl_check_hostname); none: PLAINTEXT",
    )  # fmt: skip
    parameters = models.JSONField(
        default=dict, blank=True, help_text="values of the pipeline's parameters (its defaults fill the rest)"
    )
    start_offset = models.JSONField(
        null=True, blank=True, editable=False,
        help_text="where a new checkpoint starts reading the stream ({id, n}); set by an upgrade with empty state",
    )  # fmt: skip
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
    # Poison events: what the source refuses, and how much of it the dead-letter stream keeps.
    max_future_seconds = models.PositiveIntegerField(
        default=MAX_FUTURE_SECONDS,
        validators=[MaxValueValidator(366 * 86400)],
        help_text="an event time further than this after the entry's arrival is dead-lettered (0: no limit)",
    )
    dead_letter_max_entries = models.PositiveIntegerField(
        default=100_000, validators=[MinValueValidator(100), MaxValueValidator(10_000_000)]
    )
    dead_letter_max_age_hours = models.PositiveIntegerField(
        default=7 * 24, validators=[MinValueValidator(1), MaxValueValidator(365 * 24)]
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # The checkpoint lease: whoever holds lease_token may run a driver on this job's checkpoint until it expires.
    lease_token = models.BigIntegerField(default=0)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    latest_checkpoint = models.ForeignKey(
        "Checkpoint", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Restores and rollbacks fork into a new directory under the job's; the job runs on the one named here.
    checkpoint_dir = models.CharField(max_length=80, default="checkpoint", editable=False)
    savepoint_interval_minutes = models.PositiveIntegerField(
        default=0, validators=[MaxValueValidator(7 * 24 * 60)], help_text="periodic savepoints; 0 turns them off"
    )
    savepoints_max_count = models.PositiveIntegerField(
        default=10, validators=[MinValueValidator(1), MaxValueValidator(1000)], help_text="verified savepoints kept"
    )
    savepoints_max_age_hours = models.PositiveIntegerField(
        default=7 * 24, validators=[MinValueValidator(1)], help_text="older savepoints are disposed (never the newest)"
    )
    restart_strategy = models.CharField(
        max_length=16, choices=RestartStrategy.choices, default=RestartStrategy.EXPONENTIAL
    )
    restart_delay_seconds = models.PositiveIntegerField(default=5, validators=[MaxValueValidator(3600)])
    restart_max_delay_seconds = models.PositiveIntegerField(default=300, validators=[MaxValueValidator(86400)])
    failure_rate_max = models.PositiveIntegerField(
        default=5,
        validators=[MinValueValidator(1)],
        help_text="failures allowed in the window before the job is FAILED",
    )
    failure_rate_window_minutes = models.PositiveIntegerField(default=30, validators=[MinValueValidator(1)])
    failed_reason = models.TextField(blank=True, help_text="set when the restart strategy gave up; cleared by a start")
    archived_at = models.DateTimeField(
        null=True, blank=True, help_text="set when the job was deleted: stopped with a savepoint, kept, listed no more"
    )
    applied_spec = models.JSONField(
        default=dict, blank=True, help_text="the spec last applied to the job (jobs as code): its page shows any drift"
    )
    standby = models.BooleanField(
        default=False,
        help_text="keep a warm standby driver that takes over within seconds when the running driver dies",
    )
    driver = models.CharField(
        max_length=8,
        choices=DriverMode.choices,
        default=DriverMode.OWN,
        help_text="own: a driver process (JVM and Python) for this job alone; shared: its query runs in the host's "
        "shared driver beside other jobs' (a fraction of the memory; a crash of the host stops all of them)",
    )
    real_time = models.BooleanField(
        default=False,
        help_text="run the query in Spark's real-time mode: records flow through as they come, the trigger interval is "
        "how often a checkpoint is taken, and Spark's Kafka writer writes the pipeline's Kafka sink (a pipeline "
        "declared real_time, on a Kafka source, with RocksDB state, in a driver of its own)",
    )
    rolled_up_to = models.DateTimeField(
        null=True, blank=True, editable=False, help_text="checkpoints recorded up to here are in the roll-ups"
    )
    memory_budget_mb = models.PositiveIntegerField(
        default=1024, validators=[MinValueValidator(1)], help_text="state memory the executors can give this job"
    )
    disk_budget_gb = models.PositiveIntegerField(
        default=50, validators=[MinValueValidator(1)], help_text="disk for this job's checkpoint and savepoints"
    )
    autoscale_mode = models.CharField(max_length=12, choices=AutoscaleMode.choices, default=AutoscaleMode.RECOMMEND)
    autoscale_max_per_day = models.PositiveIntegerField(
        default=2, validators=[MaxValueValidator(24)], help_text="automatic rescales allowed in 24 hours"
    )
    autoscale_window_minutes = models.PositiveIntegerField(
        default=15,
        validators=[MinValueValidator(5), MaxValueValidator(24 * 60)],
        help_text="a recommendation must hold this long (and no rescale happened in it) before it is applied",
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
        return self.directory / self.checkpoint_dir

    @property
    def own_runs(self) -> models.QuerySet[Run]:
        """The job's runs but a blue/green upgrade's new version beside it (``BESIDE_THE_JOB``): what its latest run
        means wherever it is read (the page's header and its live push, the list, the API, a standby's watch and
        takeover, a restart)."""
        return self.runs.exclude(BESIDE_THE_JOB)

    def run_values(self) -> dict[str, Any]:
        """What a query of this job runs with, as plain values (the fields of ``workers.spark.query.JobSpec``): the
        driver, a standby's warm query and the state tool's scratch queries all start from these."""
        return {
            "job_id": self.id, "name": self.name, "pipeline": self.pipeline, "stream": self.source_stream,
            "redis_url": settings.REDIS_URL, "backend": self.state_backend,
            "trigger_seconds": self.trigger_interval_seconds, "partitions": self.state_partitions,
            "parallelism": self.parallelism, "checkpoint": str(self.checkpoint_location),
            "batches_retained": self.batches_retained, "max_records": self.max_records_per_batch,
            "dead_letter": self.dead_letter_stream, "skip_list": self.skip_list,
            "max_future_seconds": self.max_future_seconds, "source_kind": self.source_kind,
            "source_path": self.source_path, "source_format": self.source_format,
            "source_security": json.dumps(self.source_security or {}),
            "starting_offset": json.dumps(self.start_offset) if self.start_offset else "",
            "parameters": json.dumps(self.parameters), "real_time": self.real_time,
        }  # fmt: skip

    @property
    def task_slots(self) -> int:
        """The task slots of the job's own driver on this host (``local[n]``): its parallelism; for a real-time job,
        REAL_TIME_SLOTS. Real-time mode runs its query's stages at once, each task for as long as the query runs (a
        source task per topic partition, one per state partition), and Spark refuses the query when they outnumber
        the slots; a task with nothing to do waits, so a slot beyond the cores costs a thread, not a core."""
        return max(self.parallelism, REAL_TIME_SLOTS) if self.real_time else self.parallelism

    @property
    def savepoint_root(self) -> Path:
        return self.directory / "savepoints"

    @property
    def dead_letter_stream(self) -> str:
        return f"{self.source_stream}:dead:{self.name}"

    @property
    def skip_list(self) -> str:
        """Entry ranges an operator chose to skip: the source sends them to the dead letter instead of the batch."""
        return f"{self.dead_letter_stream}:skip"

    @property
    def reads_files(self) -> bool:
        return self.source_kind == SourceKind.FILES

    @property
    def reads_redis(self) -> bool:
        """Whether the source is a Redis stream the console can read itself (sample lag, replay, re-drive)."""
        return self.source_kind == SourceKind.REDIS

    @property
    def reads_kafka(self) -> bool:
        """Whether the source is a Kafka topic (its lag sampled from the broker's end offsets, per partition)."""
        return self.source_kind == SourceKind.KAFKA

    @property
    def lag_unit(self) -> str:
        """What the job's lag counts: stream entries, or files not yet read."""
        return "files" if self.reads_files else "records"

    def lag_count(self, count: int) -> str:
        """``count`` of what the job's lag counts, in words: "1 file", "250 records"."""
        return f"{count} {self.lag_unit[:-1] if count == 1 else self.lag_unit}"

    def has_state(self) -> bool:
        """True once a batch has been committed to the checkpoint: from then on Spark has frozen its settings."""
        commits = self.checkpoint_location / "commits"
        return self.latest_checkpoint_id is not None or (commits.is_dir() and any(commits.iterdir()))

    def spec_applied(self, values: dict[str, Any]) -> None:
        """An action a spec asked for (``statekeeper apply``) has made these settings the job's: they join the spec last
        applied, so its drift does not report them as changes made in the console."""
        with transaction.atomic():
            locked = Job.objects.select_for_update().only("applied_spec").get(id=self.id)
            Job.objects.filter(id=self.id).update(applied_spec={**(locked.applied_spec or {}), **values})

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
    GREEN = "green", "Green"  # a blue/green upgrade's new version, beside the job's run until the handover


ACTIVE_RUN_STATUSES = (RunStatus.PENDING, RunStatus.STARTING, RunStatus.RUNNING, RunStatus.STOPPING)


class Deploy(models.Model):
    """What a job's driver ran: the pipeline, its code version, its Spark settings, and who started it. A start that
    runs the same code with the same settings as the job's last deploy reuses it."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="deploys")
    pipeline = models.CharField(max_length=40)
    reference = models.CharField(max_length=300, help_text="module:attribute")
    package = models.CharField(max_length=200, blank=True, help_text="the installed distribution and its version")
    code_hash = models.CharField(max_length=64, help_text="sha256 of every file of the pipeline's distribution")
    parameters = models.JSONField(default=dict, help_text="every parameter's value the run used, defaults included")
    secret_versions = models.JSONField(default=dict, help_text="the version of each secret its parameters name")
    spark_conf = models.JSONField(default=dict)
    spark_version = models.CharField(max_length=40, blank=True)
    operator = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    upgrade = models.ForeignKey(
        "Action",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
        help_text="the upgrade that made it",
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"deploy {self.pk}: {self.pipeline} {self.version}"

    @property
    def version(self) -> str:
        return f"{self.package + ' ' if self.package else ''}#{self.code_hash[:10]}"


class HostStatus(models.TextChoices):
    SERVING = "serving", "Serving"
    SPARE = "spare", "Spare (warm: takes the jobs of a serving one that dies)"
    DRAINING = "draining", "Draining (takes no new jobs)"
    GONE = "gone", "Gone"


class DriverHost(models.Model):
    """A shared driver: one process (Python and a JVM) on a host that runs the queries of several jobs, each in a
    SparkSession of its own over one SparkContext, as a Flink session cluster runs several jobs. Each job keeps its own
    run, lease, fencing token, lock, checkpoint, standby and actions."""

    host = models.CharField(max_length=200)
    pid = models.IntegerField(null=True, blank=True)
    status = models.CharField(max_length=10, choices=HostStatus.choices, default=HostStatus.SERVING)
    started_at = models.DateTimeField(default=timezone.now)
    heartbeat_at = models.DateTimeField(null=True, blank=True, help_text="its main loop's last beat")
    ended_at = models.DateTimeField(null=True, blank=True)
    cores = models.PositiveIntegerField(default=2)
    log_path = models.CharField(max_length=500, blank=True)
    message = models.TextField(blank=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"driver host {self.pk} (pid {self.pid} on {self.host})"


class Run(models.Model):
    """One run of a job's query, from start request to its end. Its driver process is its own, a shared driver's, or
    (an upgrade or rescale that restarts the job) the driver of the job's run before it, which waited for it."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="runs")
    status = models.CharField(max_length=12, choices=RunStatus.choices, default=RunStatus.PENDING)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    requested_at = models.DateTimeField(default=timezone.now)
    fencing_token = models.BigIntegerField(null=True, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    host = models.CharField(max_length=200, blank=True)
    spark_master = models.CharField(max_length=200, blank=True)
    executors = models.JSONField(default=list, blank=True, help_text="the hosts its executors run on, on a cluster")
    started_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    heap_after_gc_bytes = models.BigIntegerField(
        null=True, blank=True, help_text="its driver JVM's heap after the latest garbage collection, at the heartbeat"
    )
    heap_max_bytes = models.BigIntegerField(null=True, blank=True, help_text="its driver JVM's maximum heap")
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    message = models.TextField(blank=True)
    error = models.TextField(blank=True)
    log_path = models.CharField(max_length=500, blank=True)
    deploy = models.ForeignKey(Deploy, null=True, blank=True, on_delete=models.SET_NULL, related_name="runs")
    driver_host = models.ForeignKey(
        DriverHost, null=True, blank=True, on_delete=models.SET_NULL, related_name="runs",
        help_text="the shared driver the run's query runs in (its pid is the host's); none: a driver of its own",
    )  # fmt: skip
    released_at = models.DateTimeField(
        null=True, blank=True,
        help_text="when its driver, which lives on, let go of the run's query and lock: a shared driver's, or one of "
        "its own that waits for the job's next run",
    )  # fmt: skip
    reusable_until = models.DateTimeField(
        null=True, blank=True,
        help_text="the run ended and its driver of its own waits until then for the job's next run (an upgrade or "
        "rescale restarts the job): a launch before then hands the run to it rather than starting a new JVM",
    )  # fmt: skip
    green = models.JSONField(
        default=dict, blank=True,
        help_text="a blue/green upgrade's new version (status green until the handover): its action, checkpoint "
        "fork, pipeline, parameters, state partitions, and after the handover the batch it took over after",
    )  # fmt: skip

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

    @property
    def heap_share(self) -> float | None:
        """The share of its driver's heap that live objects held at the latest garbage collection."""
        if not self.heap_after_gc_bytes or not self.heap_max_bytes or self.heap_max_bytes <= 0:
            return None
        return self.heap_after_gc_bytes / self.heap_max_bytes


# A blue/green upgrade's new version that has not taken over: a run beside the job's, not the job's own. The job's
# header, its row in the list and its latest driver are its own run's (``Job.own_runs``).
BESIDE_THE_JOB = models.Q(green__has_key="action") & ~models.Q(green__has_key="handover")


class CheckpointKind(models.TextChoices):
    FULL = "full", "Full"
    INCREMENTAL = "incremental", "Incremental"


class Checkpoint(models.Model):
    """A committed micro-batch: a consistent, restorable snapshot of the job's state and source offsets."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="checkpoints")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.SET_NULL, related_name="checkpoints")
    location = models.CharField(max_length=80, default="checkpoint", help_text="the checkpoint directory (fork)")
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
    state_sst_bytes = models.BigIntegerField(
        null=True, blank=True, help_text="RocksDB's own size of the state: its SST files (none for the memory backend)"
    )
    rows_dropped_by_watermark = models.BigIntegerField(default=0, help_text="late rows the watermark discarded")
    checkpointed_bytes = models.BigIntegerField(default=0, help_text="bytes this batch added to the checkpoint")
    full_size_bytes = models.BigIntegerField(default=0, help_text="checkpoint directory size after this batch")
    kind = models.CharField(max_length=12, choices=CheckpointKind.choices, default=CheckpointKind.INCREMENTAL)
    start_offset = models.JSONField(null=True, blank=True)
    end_offset = models.JSONField(null=True, blank=True)
    latest_offset = models.JSONField(null=True, blank=True)
    lag_records = models.BigIntegerField(null=True, blank=True)
    state_operators = models.JSONField(default=list)
    partitions = models.JSONField(
        default=list, blank=True, help_text="per state partition: op, part, bytes, added, commit_ms"
    )
    recorded_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-batch_id"]
        constraints = [
            models.UniqueConstraint(fields=["job", "location", "batch_id"], name="one_checkpoint_per_batch_and_fork")
        ]
        indexes = [
            models.Index(fields=["job", "-batch_id"], name="checkpoint_job_batch"),
            models.Index(fields=["job", "-committed_at", "-id"], name="checkpoint_job_committed"),
            models.Index(fields=["job", "recorded_at"], name="checkpoint_job_recorded"),
        ]

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
        # a view kept to its bound drops the rows whose last write is oldest (workers/sink.py results_trim)
        indexes = [models.Index(fields=["job", "kind", "batch_id"], name="result_by_last_batch")]

    def __str__(self) -> str:
        return f"{self.kind} {self.key}"


class ResultUndo(models.Model):
    """What a batch changed in the results table, to be undone when the job goes back before it (a restore, a rollback,
    an upgrade's rollback): a key's value before the batch, or none when the batch added the key. The results table is
    a sink held to exactly once like the others; entries older than what a restore or rollback can reach are
    trimmed."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="+")
    batch_id = models.BigIntegerField()
    kind = models.CharField(max_length=40)
    key = models.CharField(max_length=500)
    value = models.JSONField(null=True, help_text="the value before the batch; null: the batch added the key")
    prior_batch = models.BigIntegerField(null=True, help_text="the batch that had last changed it; null: none")

    class Meta:
        indexes = [models.Index(fields=["job", "batch_id"], name="result_undo_job_batch")]

    def __str__(self) -> str:
        return f"before batch {self.batch_id}: {self.kind} {self.key}"


class GreenBatch(models.Model):
    """A batch the new version of a blue/green upgrade ran beside the job before the handover, over the same offsets
    as the job's batch of that number, and how its result rows compare with what the job wrote for that batch."""

    action = models.ForeignKey("Action", on_delete=models.CASCADE, related_name="green_batches")
    batch_id = models.BigIntegerField()
    committed_at = models.DateTimeField(default=timezone.now)
    duration_ms = models.IntegerField(default=0)
    input_rows = models.BigIntegerField(default=0)
    output_rows = models.BigIntegerField(default=0)
    added = models.IntegerField(default=0)
    removed = models.IntegerField(default=0)
    changed = models.IntegerField(default=0)
    same = models.IntegerField(default=0)
    samples = models.JSONField(default=list, blank=True, help_text="a few rows that differ: kind, key, before, after")

    class Meta:
        ordering = ["batch_id"]
        constraints = [models.UniqueConstraint(fields=["action", "batch_id"], name="one_green_batch")]

    def __str__(self) -> str:
        return f"green batch {self.batch_id} of action {self.action_id}"


class ActionKind(models.TextChoices):
    SAVEPOINT = "savepoint", "Savepoint"
    STOP_WITH_SAVEPOINT = "stop-with-savepoint", "Stop with savepoint"
    RESTORE = "restore", "Restore from savepoint"
    ROLLBACK = "rollback", "Roll back to a batch"
    RESCALE = "rescale", "Rescale"
    DISPOSE_SAVEPOINT = "dispose-savepoint", "Dispose savepoint"
    DISCARD_CHECKPOINT = "discard-checkpoint", "Discard old checkpoint directory"
    COUNT_PARTITION_ROWS = "count-partition-rows", "Count state rows per partition"
    CLEAN_ORPHANS = "clean-orphans", "Remove orphaned files"
    INSPECT_STATE = "inspect-state", "Inspect state"
    SKIP_ENTRIES = "skip-entries", "Skip a failing batch's entries"
    REDRIVE_DEAD_LETTERS = "redrive-dead-letters", "Re-drive dead letters"
    UPGRADE_PREVIEW = "upgrade-preview", "Preview an upgrade"
    UPGRADE_SHADOW = "upgrade-shadow", "Shadow run of an upgrade"
    UPGRADE = "upgrade", "Upgrade"
    UPGRADE_ROLLBACK = "upgrade-rollback", "Roll back an upgrade"
    BLUE_GREEN = "blue-green", "Blue/green upgrade"


class ActionStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    ABORTED = "aborted", "Aborted"  # stopped by design before it changed the job (a blue/green's abort)


IN_FLIGHT_ACTIONS = (ActionStatus.PENDING, ActionStatus.RUNNING)
ENDED_ACTIONS = (ActionStatus.SUCCEEDED, ActionStatus.FAILED, ActionStatus.ABORTED)


class Action(models.Model):
    """An operator action on a job: who asked, when, with what, how far it got and how it ended."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="actions")
    kind = models.CharField(max_length=24, choices=ActionKind.choices)
    status = models.CharField(max_length=12, choices=ActionStatus.choices, default=ActionStatus.PENDING)
    origin = models.CharField(max_length=24, default="user", help_text="user, periodic, supervisor, …")
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    requested_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    params = models.JSONField(default=dict, blank=True)
    progress = models.CharField(max_length=300, blank=True)
    outcome = models.TextField(blank=True)
    error = models.TextField(blank=True)
    # The resumable steps (dashboard/services/actions.py): the step it is at, each step's start, end and duration,
    # when a worker should look at it again, and which worker is advancing it now (host:pid, until when).
    step = models.CharField(max_length=40, blank=True)
    phases = models.JSONField(default=list, blank=True)
    wake_at = models.DateTimeField(null=True, blank=True, db_index=True)
    claimed_by = models.CharField(max_length=120, blank=True)
    claimed_until = models.DateTimeField(null=True, blank=True)
    resumed = models.PositiveIntegerField(default=0, help_text="steps run again after their worker died")
    memo = models.JSONField(default=dict, blank=True, help_text="what a step keeps between its visits")
    asked = models.JSONField(
        default=dict, blank=True, help_text="what the operator asked of it while it runs (a blue/green's promote or "
        "abort, with when): written by the console only, read by its steps"
    )  # fmt: skip

    class Meta:
        ordering = ["-id"]
        constraints = [
            # Actions on one job never overlap: a second one is refused while one is pending or running.
            models.UniqueConstraint(
                fields=["job"],
                condition=models.Q(status__in=["pending", "running"]),
                name="one_action_in_flight_per_job",
            )
        ]

    def __str__(self) -> str:
        return f"{self.get_kind_display()} #{self.pk} on {self.job_id}"

    @property
    def in_flight(self) -> bool:
        return self.status in IN_FLIGHT_ACTIONS

    @property
    def step_started_at(self) -> datetime | None:
        """When the current (last) step began: how long it has waited, and which run it may have requested."""
        return datetime.fromisoformat(self.phases[-1]["started"]) if self.phases else None

    @property
    def phase_rows(self) -> list[dict]:
        """Each step it went through: its label, how long it took (the open one: so far), and whether it is open."""
        rows = []
        for phase in self.phases:
            open_ = "ended" not in phase
            seconds = phase.get("seconds")
            if open_:
                seconds = (timezone.now() - datetime.fromisoformat(phase["started"])).total_seconds()
            rows.append({"label": phase["label"], "step": phase["step"], "seconds": seconds, "open": open_})
        return rows

    @property
    def proof_text(self) -> str:
        """What an upgrade's watch knows of its new version, in the operator's words ('' for other actions)."""
        proof = self.proof
        state = proof.get("state")
        if state == "proven":
            return f"proven: its first batch ({proof.get('batch')}) committed"
        if state == "unproven":
            return "running, not yet proven: no first batch yet; it rolls back by itself if that batch fails"
        if state == "failed":
            return f"failed after it returned ({proof.get('cause', '')[:200]}); rolled back by #{proof.get('rollback')}"
        if state == "stopped":
            return "stopped before its first batch: never proven"
        return ""

    @property
    def proof(self) -> dict:
        """An upgrade's watch of its new version: {"state": unproven | proven | failed | stopped, …}."""
        return dict(self.params.get("proof") or {})

    @property
    def parameter_changes(self) -> list[str]:
        """An upgrade's (or its preview's, or shadow run's) parameter changes, as ``name: old → new``."""
        if "from_parameters" not in self.params or "parameters" not in self.params:
            return []
        return parameter_changes(self.params["from_parameters"], self.params["parameters"])


class SavepointStatus(models.TextChoices):
    IN_PROGRESS = "in-progress", "In progress"
    VERIFIED = "verified", "Verified"
    FAILED = "failed", "Failed"
    DISPOSED = "disposed", "Disposed"


class Savepoint(models.Model):
    """A self-contained, verified copy of the checkpoint at a committed batch, with its manifest."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="savepoints")
    action = models.ForeignKey(Action, null=True, blank=True, on_delete=models.SET_NULL, related_name="savepoints")
    origin = models.CharField(max_length=24, default="user")
    deploy = models.ForeignKey(Deploy, null=True, blank=True, on_delete=models.SET_NULL, related_name="savepoints")
    status = models.CharField(max_length=12, choices=SavepointStatus.choices, default=SavepointStatus.IN_PROGRESS)
    batch_id = models.BigIntegerField(null=True, blank=True)
    path = models.CharField(max_length=500, blank=True)
    size_bytes = models.BigIntegerField(default=0)
    duration_ms = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now)
    verified_at = models.DateTimeField(null=True, blank=True)
    disposed_at = models.DateTimeField(null=True, blank=True)
    manifest = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    drilled_at = models.DateTimeField(null=True, blank=True, help_text="the last restore drill")
    drill_ok = models.BooleanField(null=True, blank=True)
    drill_message = models.TextField(blank=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"savepoint {self.pk} of {self.job_id} at batch {self.batch_id}"


class StandbyStatus(models.TextChoices):
    WARMING = "warming", "Warming up"
    READY = "ready", "Ready"
    ACTIVE = "active", "Took over"
    ENDED = "ended", "Ended"


class StandbyDriver(models.Model):
    """A driver process kept warm (SparkSession started, pipeline run once on a scratch input) beside a running job.
    It waits on the running driver's database lock and takes over, with a new fencing token, the moment that driver's
    process dies."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="standbys")
    status = models.CharField(max_length=12, choices=StandbyStatus.choices, default=StandbyStatus.WARMING)
    pid = models.IntegerField(null=True, blank=True)
    host = models.CharField(max_length=200, blank=True)
    started_at = models.DateTimeField(default=timezone.now)
    ready_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    warmup_seconds = models.FloatField(null=True, blank=True)
    rss_bytes = models.BigIntegerField(null=True, blank=True, help_text="the standby's processes (Python, JVM)")
    built_for = models.JSONField(default=dict, help_text="the job settings its SparkSession was built with")
    run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    message = models.TextField(blank=True)
    log_path = models.CharField(max_length=500, blank=True)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"standby {self.pk} of {self.job_id}"


class Recovery(models.Model):
    """An automatic restart after a driver died: the cause, when it came back, and what it replayed."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="recoveries")
    failed_run = models.OneToOneField(Run, on_delete=models.CASCADE, related_name="recovery")
    restart_run = models.ForeignKey(Run, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    cause = models.TextField()
    trace = models.TextField(blank=True)
    failed_at = models.DateTimeField()
    attempt = models.PositiveIntegerField(default=1)
    restart_at = models.DateTimeField(null=True, blank=True, help_text="when the restart strategy restarts it")
    recovered_at = models.DateTimeField(null=True, blank=True, help_text="first batch committed after the restart")
    batches_replayed = models.PositiveIntegerField(default=0)
    gave_up = models.BooleanField(default=False)
    host_crash = models.BooleanField(
        default=False, help_text="the shared driver it ran in died: not the job's own failure, so no back-off"
    )

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"recovery {self.pk} of {self.job_id}"

    @property
    def downtime_seconds(self) -> float | None:
        return (self.recovered_at - self.failed_at).total_seconds() if self.recovered_at else None


class CheckpointRollup(models.Model):
    """Checkpoints summarised per minute or per hour: what long charts read, and what is left once raw records age
    out of their retention window."""

    MINUTE, HOUR = 60, 3600

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="rollups")
    resolution = models.PositiveIntegerField(help_text="bucket length in seconds")
    bucket = models.DateTimeField(help_text="start of the bucket")
    location = models.CharField(max_length=80, default="checkpoint")
    batches = models.PositiveIntegerField()
    batch_first = models.BigIntegerField()
    batch_last = models.BigIntegerField()
    last_committed_at = models.DateTimeField()
    input_rows = models.BigIntegerField()
    duration_ms_avg = models.FloatField()
    duration_ms_max = models.BigIntegerField()
    wal_commit_ms_avg = models.FloatField()
    add_batch_ms_avg = models.FloatField()
    commit_offsets_ms_avg = models.FloatField()
    planning_ms_avg = models.FloatField(help_text="query planning + latestOffset")
    state_commit_ms_avg = models.FloatField()
    input_rate_avg = models.FloatField()
    processed_rate_avg = models.FloatField()
    lag_records_max = models.BigIntegerField(null=True)
    lag_records_last = models.BigIntegerField(null=True)
    end_n_last = models.BigIntegerField(null=True)
    state_rows_last = models.BigIntegerField()
    state_memory_bytes_last = models.BigIntegerField()
    state_sst_bytes_last = models.BigIntegerField(null=True, blank=True)
    rows_dropped_by_watermark_sum = models.BigIntegerField(default=0)
    checkpointed_bytes_sum = models.BigIntegerField()
    full_size_bytes_last = models.BigIntegerField()

    class Meta:
        ordering = ["job", "resolution", "bucket"]
        constraints = [
            models.UniqueConstraint(fields=["job", "resolution", "bucket"], name="one_rollup_per_bucket"),
        ]

    def __str__(self) -> str:
        return f"{self.job_id}@{self.bucket:%Y-%m-%d %H:%M}/{self.resolution}s"


class SourceLag(models.Model):
    """The backlog read from the source itself, on a beat: true while the job is down or stalled, when no progress
    event comes (a stopped job's lag grows here, not as a frozen last value)."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="source_lag")
    sampled_at = models.DateTimeField(default=timezone.now)
    source_n = models.BigIntegerField(help_text="entries ever added to the source (XINFO entries-added)")
    committed_n = models.BigIntegerField(help_text="the job's committed offset, in the same count")
    lag_records = models.BigIntegerField()
    lag_seconds = models.FloatField(null=True, blank=True, help_text="age of the oldest entry not yet read")
    lag_bytes = models.BigIntegerField(null=True, blank=True, help_text="for a file source: bytes not yet read")
    partitions = models.JSONField(
        null=True, blank=True,
        help_text="for a Kafka source, each partition's {end, committed, lag, oldest_s} (partition as text)",
    )  # fmt: skip

    class Meta:
        ordering = ["job", "sampled_at"]
        indexes = [models.Index(fields=["job", "-sampled_at"], name="source_lag_job_time")]

    def __str__(self) -> str:
        return f"{self.job_id}@{self.sampled_at:%H:%M:%S}: {self.lag_records}"


class AlertKind(models.TextChoices):
    LAG_WARN = "lag-warn", "Lag growing (WARN)"
    LAG_STALL = "lag-stall", "Offsets stalled (STALL)"
    LAG_STOP = "lag-stop", "No commits (STOP)"
    CHECKPOINT_STALL = "checkpoint-stall", "Checkpoint stall"
    RESTART_LOOP = "restart-loop", "Restart loop"
    SAVEPOINT_FAILED = "savepoint-failed", "Savepoint failed"
    WATERMARK_DROPS = "watermark-drops", "Rows dropped by the watermark"
    DRIVER_HEAP = "driver-heap", "Driver heap nearly full"
    CLUSTER_WAITING = "cluster-waiting", "Waiting for cluster cores"


class Alert(models.Model):
    """A condition on a job, open until it clears; notified when it opens and when it resolves."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="alerts")
    kind = models.CharField(max_length=24, choices=AlertKind.choices)
    opened_at = models.DateTimeField(default=timezone.now)
    resolved_at = models.DateTimeField(null=True, blank=True)
    clear_since = models.DateTimeField(null=True, blank=True, help_text="the condition is gone since; resolves later")
    message = models.TextField(help_text="what opened it")
    latest = models.TextField(blank=True, help_text="the condition as last evaluated")
    subject_id = models.BigIntegerField(null=True, blank=True, help_text="the savepoint a savepoint alert is about")
    notifications = models.JSONField(default=list, blank=True, help_text="deliveries: channel, event, ok, detail")

    class Meta:
        ordering = ["-opened_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["job", "kind"], condition=models.Q(resolved_at__isnull=True), name="one_open_alert_per_kind"
            )
        ]

    def __str__(self) -> str:
        return f"{self.job_id} {self.kind} {'open' if self.is_open else 'resolved'}"

    @property
    def is_open(self) -> bool:
        return self.resolved_at is None


class AppendOnly(Exception):
    pass


class AuditEntry(models.Model):
    """One line of the audit trail. No foreign keys: deleting a job or a user must not touch its history."""

    at = models.DateTimeField(default=timezone.now, db_index=True)
    user_id = models.IntegerField(null=True, blank=True)
    username = models.CharField(max_length=150, blank=True, db_index=True)
    address = models.CharField(max_length=64, blank=True, help_text="the client's address (REMOTE_ADDR)")
    origin = models.CharField(max_length=24, default="user", help_text="user, api, system, anonymous")
    verb = models.CharField(max_length=64, help_text="what was done: start, savepoint, job-edit, login, …")
    job = models.CharField(max_length=63, blank=True, db_index=True)
    target = models.CharField(max_length=500, blank=True)
    params = models.JSONField(default=dict, blank=True)
    outcome = models.CharField(max_length=24, blank=True, help_text="requested, refused, denied, succeeded, failed")
    message = models.TextField(blank=True)

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.username or self.origin} {self.verb} {self.job}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        if not self._state.adding:
            raise AppendOnly("audit entries are never changed")
        super().save(*args, **kwargs)

    def delete(self, *args: Any, **kwargs: Any) -> Any:
        raise AppendOnly("audit entries are never deleted")


SECRET_NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,62}\Z"
SECRET_NAME = RegexValidator(
    SECRET_NAME_PATTERN, "A secret's name is lower-case letters, digits, '.', '_' and '-' (63 at most)."
)


class Secret(models.Model):
    """A value a job's sink needs and nobody reads back (a password, a key): kept encrypted with
    STATEKEEPER_SECRETS_KEY (dashboard/services/secrets.py). A job's parameters name it as ``${secret:NAME}``; only the
    job's driver decrypts it, when the job starts."""

    name = models.CharField(max_length=63, unique=True, validators=[SECRET_NAME])
    ciphertext = models.TextField(help_text="the value, encrypted (Fernet)")
    version = models.PositiveIntegerField(default=1, help_text="1 when set, one more at each rotation")
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.CharField(max_length=150, blank=True)
    rotated_at = models.DateTimeField(null=True, blank=True)
    rotated_by = models.CharField(max_length=150, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"secret {self.name} (version {self.version})"


class ApiToken(models.Model):
    """A bearer token for automation (the JSON API, Prometheus): it acts as its user, with the user's role. Only a
    hash is stored; the key is shown once, when created."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=12, help_text="the key's first characters, to recognise it")
    key_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…, {self.user})"


class IdempotentRequest(models.Model):
    """An API request that acted, by its Idempotency-Key: a retry with the same key gets the first answer back."""

    key = models.CharField(max_length=200)
    user_id = models.IntegerField()
    method = models.CharField(max_length=8)
    path = models.CharField(max_length=500)
    body_hash = models.CharField(max_length=64)
    status = models.PositiveSmallIntegerField()
    response = models.JSONField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user_id", "key"], name="one_answer_per_idempotency_key")]

    def __str__(self) -> str:
        return f"{self.key} {self.method} {self.path} → {self.status}"
