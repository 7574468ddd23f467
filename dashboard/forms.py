from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from django import forms
from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.forms import AuthenticationForm
from django.db import connection
from statekeeper_sdk._runtime.real_time import MIN_INTERVAL_SECONDS

from dashboard import pipelines
from dashboard.kafka import security_problems
from dashboard.models import DriverMode, Job, RunStatus, SourceKind, StateBackend
from dashboard.services.audit import audit_record, client_address, login_lockout
from dashboard.services.rescale import MEMORY_REPARTITION
from dashboard.services.secrets import value_problems

KAFKA_SERVERS = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}(,[A-Za-z0-9.\-\[\]:]+:\d{1,5})*$")


FROZEN = {
    "state_partitions": "the number of state partitions is frozen in the checkpoint at the first batch",
    "state_backend": "the state store provider is frozen in the checkpoint at the first batch",
    "name": "the name locates the checkpoint directory",
    "source_kind": "the source's offsets are recorded in the checkpoint in its own form",
    "source_path": "Spark's file source keeps the files it has read, by path, in the checkpoint",
    "real_time": "a checkpoint is written in one mode's batches, and Spark has no switch of it between modes",
}


def _pipeline_choices() -> list[tuple[str, str]]:
    return [(p.name, f"{p.name}: {p.title}") for p in pipelines.registry().pipelines.values()]


class JobForm(forms.ModelForm):
    pipeline = forms.ChoiceField(choices=_pipeline_choices)
    parameters = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3, "placeholder": "window_minutes = 10"}),
        help_text="the pipeline's parameters, one name = value per line (the list beside says which it takes; "
        "defaults fill the rest). On a job with state, change them by an upgrade (Deploys tab).",
    )

    source_security = forms.CharField(
        required=False,
        label="Kafka security (TLS, SASL)",
        widget=forms.Textarea(attrs={"rows": 3, "placeholder": "security_protocol = SASL_SSL"}),
        help_text="a Kafka source's TLS and SASL settings, one name = value per line: security_protocol, "
        "sasl_mechanism, sasl_username, sasl_password (a secret's reference, ${secret:NAME}), ssl_ca_file, "
        "ssl_check_hostname. None: PLAINTEXT.",
    )

    class Meta:
        model = Job
        fields = [
            "name",
            "pipeline",
            "source_kind",
            "source_stream",
            "source_path",
            "source_format",
            "source_security",
            "parameters",
            "state_backend",
            "trigger_interval_seconds",
            "state_partitions",
            "parallelism",
            "batches_retained",
            "max_records_per_batch",
            "max_future_seconds",
            "dead_letter_max_entries",
            "dead_letter_max_age_hours",
            "memory_budget_mb",
            "disk_budget_gb",
            "autoscale_mode",
            "autoscale_max_per_day",
            "autoscale_window_minutes",
            "standby",
            "driver",
            "real_time",
        ]
        labels = {
            "real_time": "Real-time mode",
            "standby": "Warm standby driver",
            "driver": "Driver",
            "trigger_interval_seconds": "Trigger interval (seconds)",
            "source_kind": "Source",
            "source_stream": "Redis stream, or Kafka topic",
            "source_path": "Directory (files), or bootstrap servers (Kafka)",
            "source_format": "File format",
        }

    # settings with a default that a form (or a script posting one) may leave out: the job's value, or the default
    OPTIONAL: tuple[str, ...] = ("max_future_seconds", "dead_letter_max_entries", "dead_letter_max_age_hours", "source_kind",
                "source_format", "driver")  # fmt: skip

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for name in self.OPTIONAL:
            self.fields[name].required = False
        self.fields["source_stream"].required = False
        self.initial["parameters"] = pipelines.format_parameters(self.instance.parameters or {}, self.instance.pipeline)
        self.initial["source_security"] = pipelines.format_parameters(self.instance.source_security or {})

    def clean_source_security(self) -> dict[str, str]:
        try:
            given = pipelines.parse_parameters(str(self.cleaned_data.get("source_security") or ""))
        except ValueError as exc:
            raise forms.ValidationError(str(exc).replace("Parameters", "Kafka security settings")) from None
        return {name: str(value).lower() if isinstance(value, bool) else str(value) for name, value in given.items()}

    def clean_parameters(self) -> dict[str, Any]:
        try:
            return pipelines.parse_parameters(str(self.cleaned_data.get("parameters") or ""))
        except ValueError as exc:
            raise forms.ValidationError(str(exc)) from None

    def _clean_parameters(self, data: dict[str, Any], pipeline: Any) -> None:
        """The values must fit the pipeline (checked and kept as it will read them), and its sinks be writable with
        them; on a job with state a change is an upgrade, which previews it on the state first."""
        if "parameters" in self.errors or pipeline is None:
            return
        given = data.get("parameters") or {}
        try:
            resolved = pipelines.parameter_values(pipeline.name, given)
        except ValueError as exc:
            self.add_error("parameters", forms.ValidationError([line for line in str(exc).splitlines()]))
            return
        data["parameters"] = {name: resolved[name] for name in given}
        if self.instance.pk and self.instance.has_state() and pipeline.name == self.instance.pipeline:
            before = pipelines.parameter_values(pipeline.name, self.instance.parameters or {})
            if resolved != before:
                self.add_error(
                    "parameters",
                    "This job has state: a parameter change is an upgrade (Deploys → Upgrade, with these values), "
                    "which previews it on the state, takes a savepoint and rolls back by itself if the new run fails.",
                )
        if "parameters" not in self.errors:  # its sinks' targets come from the values
            for problem in pipelines.sink_problems(pipeline.name, resolved) + value_problems(pipeline.name, resolved):
                self.add_error("parameters", problem)

    def _clean_source(self, data: dict[str, Any], pipeline: Any) -> None:
        """A Redis stream needs its key; a file source a directory under an allowed root, in a format the pipeline's
        payload can take. A file source's dead letters go to Redis under ``files:<job name>``."""
        if data.get("source_kind") == SourceKind.KAFKA:
            self._clean_kafka(data, pipeline)
            return
        if data.get("source_security") and "source_security" not in self.errors:
            self.add_error("source_security", "Only a Kafka source takes TLS and SASL settings.")
        if data.get("source_kind") != SourceKind.FILES:
            if not data.get("source_stream") and "source_stream" not in self.errors:
                self.add_error("source_stream", "Name the Redis stream the job reads.")
            return
        if not data.get("source_stream"):
            data["source_stream"] = f"files:{data.get('name') or self.instance.name}"
        raw = str(data.get("source_path") or "").strip()
        if not raw or not os.path.isabs(raw):
            self.add_error("source_path", "Give the absolute path of the directory Spark reads new files from.")
            return
        path = Path(raw).resolve()
        roots = settings.FILE_SOURCE_ROOTS
        if not pipelines.under_roots(path, roots):
            self.add_error(
                "source_path",
                f"File sources are read only under {', '.join(map(str, roots))} (STATEKEEPER_FILE_SOURCE_ROOTS).",
            )
        elif not path.is_dir():
            self.add_error(
                "source_path", f"{path} is not a directory (create it first; files are read as they arrive)."
            )
        data["source_path"] = str(path)
        if pipeline is not None and pipeline.payload.kind != "json":
            self.add_error(
                "source_kind",
                f"{pipeline.name} parses its events as {pipeline.payload.kind}; a file source gives rows of named "
                "fields: choose a Redis stream, or a pipeline with a JSON payload.",
            )

    def _clean_kafka(self, data: dict[str, Any], pipeline: Any) -> None:
        """A topic, bootstrap servers, and Spark's Kafka connector on the class path: without it Spark cannot read
        Kafka, and the job is refused here rather than failing at its first start."""
        if not pipelines.kafka_connector():
            self.add_error(
                "source_kind",
                "Spark's Kafka connector is not on the class path: the pyspark wheel does not ship it. The set-up "
                "(bin/dev) fetches it with Maven and names it in STATEKEEPER_SPARK_JARS; a console started otherwise "
                "lists the spark-sql-kafka-0-10, spark-token-provider-kafka, kafka-clients and commons-pool2 jars "
                "there (comma-separated paths).",
            )
        if not data.get("source_stream") and "source_stream" not in self.errors:
            self.add_error("source_stream", "Name the Kafka topic the job reads.")
        servers = str(data.get("source_path") or "").strip()
        if not KAFKA_SERVERS.match(servers):
            self.add_error("source_path", "Give the bootstrap servers as host:port[,host:port...].")
        if "source_security" not in self.errors:
            security = data.get("source_security") or {}
            for problem in security_problems(security) + value_problems("", security, secret_only={"sasl_password"}):
                self.add_error("source_security", problem)

    def _clean_real_time(self, data: dict[str, Any], pipeline: Any) -> None:
        """Spark runs real-time mode on a Kafka source, for a query whose operators are on its allowlist and whose sink
        is Kafka (the pipeline declares it so: ``real_time=True``); its tasks hold their cores for as long as it runs,
        so it has a driver of its own."""
        if pipeline is not None and not getattr(pipeline, "real_time", False):
            self.add_error(
                "real_time",
                f"{pipeline.name} is not declared for real-time mode (Pipeline(real_time=True), with one KafkaSink): "
                "its output is written per micro-batch.",
            )
        if data.get("source_kind") != SourceKind.KAFKA and "source_kind" not in self.errors:
            self.add_error("real_time", "Spark's real-time mode reads Kafka: choose a Kafka source.")
        if data.get("state_backend") == StateBackend.MEMORY:
            self.add_error(
                "state_backend",
                "Spark's real-time mode keeps its state in RocksDB (checkpoint format 2): choose a RocksDB backend.",
            )
        if data.get("driver") == DriverMode.SHARED:
            self.add_error(
                "driver",
                "A real-time job's tasks hold their cores for as long as it runs: it takes a driver of its own.",
            )
        if (interval := data.get("trigger_interval_seconds")) is not None and interval < MIN_INTERVAL_SECONDS:
            self.add_error(
                "trigger_interval_seconds",
                f"In real-time mode the trigger interval is how often a checkpoint is written, {MIN_INTERVAL_SECONDS:g} "
                "s at least (Spark's spark.sql.streaming.realTimeMode.minBatchDuration); records do not wait for it.",
            )
        if data.get("standby"):
            self.add_error("standby", "A real-time job has no warm standby yet: its restart replays from its last "
                                      "checkpoint (the trigger interval).")  # fmt: skip

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        for name in self.OPTIONAL:
            if data.get(name) in (None, "") and name not in self.errors:
                data[name] = getattr(self.instance, name)
        pipeline = pipelines.find(data.get("pipeline") or "")
        self._clean_source(data, pipeline)
        self._clean_parameters(data, pipeline)
        if data.get("real_time"):
            self._clean_real_time(data, pipeline)
        if data.get("standby") and connection.vendor != "postgresql":
            self.add_error("standby", "A standby waits on a PostgreSQL lock: it needs the console on PostgreSQL.")
        if (
            pipeline is not None
            and getattr(pipeline, "needs_rocksdb", False)
            and data.get("state_backend") == StateBackend.MEMORY
        ):
            self.add_error(
                "state_backend",
                f"{pipeline.name} keeps its state with transformWithState, which needs RocksDB: choose a RocksDB backend.",
            )
        if self.instance.pk and self.instance.has_state():
            for field, reason in FROZEN.items():
                left_out = field in self.OPTIONAL and field not in self.data  # it keeps the job's value
                if field in self.changed_data and not left_out:
                    self.add_error(
                        field,
                        f"Cannot change this on a job that has state: {reason}. Changing it needs a savepoint-based "
                        f"migration to a new checkpoint (not available yet).",
                    )
        return data

    def save(self, commit: bool = True) -> Job:
        """An edit writes only the fields on the form: the lease, the fork and the latest checkpoint belong to the
        driver and the actions, and a stale copy of them must never be written back over a running job."""
        job: Job = super().save(commit=False)
        if commit:
            if job.pk:
                job.save(update_fields=[*self._meta.fields, "updated_at"])  # type: ignore[misc]
            else:
                job.save()
        return job


class RescaleForm(forms.Form):
    parallelism = forms.IntegerField(min_value=1, max_value=64, help_text="cores: a restart, state untouched")
    state_partitions = forms.IntegerField(
        min_value=1, max_value=1024, help_text="Spark's offline repartition on a copy of the state"
    )
    how = forms.ChoiceField(
        choices=[("savepoint", "Stop, repartition, restart, savepoint"),
                 ("blue-green", "Blue/green: the repartitioned job runs beside this one and takes over; the output "
                                "never stops (state partitions only, a running job)")],
        initial="savepoint", widget=forms.RadioSelect, required=False,
    )  # fmt: skip

    def __init__(self, data: Any = None, *, job: Job) -> None:
        super().__init__(data)
        self.initial = {"parallelism": job.parallelism, "state_partitions": job.state_partitions}
        self.job = job

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if (data.get("parallelism"), data.get("state_partitions")) == (self.job.parallelism, self.job.state_partitions):
            raise forms.ValidationError("That is the current scale: change the parallelism or the state partitions.")
        changes_partitions = data.get("state_partitions") not in (None, self.job.state_partitions)
        if changes_partitions and self.job.state_backend == "memory" and self.job.has_state():
            self.add_error("state_partitions", MEMORY_REPARTITION)
        if data.get("how") == "blue-green":
            if data.get("parallelism") not in (None, self.job.parallelism):
                self.add_error("how", "Blue/green changes the state partitions; the cores change by a restart.")
            elif not changes_partitions:
                self.add_error("how", "Blue/green changes the state partitions: give a new number of them.")
            elif not self.job.runs.filter(status=RunStatus.RUNNING).exists():
                self.add_error("how", f"{self.job.name} is not running: blue/green runs the new scale beside it.")
            elif not self.job.reads_redis:
                self.add_error("how", "Blue/green follows the job's batches on a Redis stream; this job reads another "
                               "source.")  # fmt: skip
        return data


class ThrottledLoginForm(AuthenticationForm):
    """Django's login form, refusing a user name or address that failed too often lately."""

    def clean(self) -> dict[str, Any]:
        username = str(self.data.get("username", ""))[:150]
        wait = login_lockout(username, client_address(self.request))
        if wait:
            audit_record(
                self.request, verb="login", username=username, target=username, outcome="throttled", origin="anonymous"
            )
            raise forms.ValidationError(
                f"Too many failed logins for this user or from this address: try again in {(wait + 59) // 60} "
                "minute(s).",
                code="throttled",
            )
        return super().clean()


class ThrottledAdminLoginForm(ThrottledLoginForm, AdminAuthenticationForm):
    """The Django admin's login, throttled as the console's is: otherwise /admin/login/ would bypass the lockout."""


class InspectForm(forms.Form):
    """What to inspect: where (a retained batch or a verified savepoint), and what."""

    MODES = [
        ("variables", "Operators, state variables and partitions"),
        ("keys", "Page through keys"),
        ("lookup", "Keys whose JSON contains a text"),
        ("diff", "What changed between two batches"),
        ("timers", "Registered timers, next firing first"),
        ("raw", "Raw RocksDB statistics (rocksdict)"),
    ]
    mode = forms.ChoiceField(choices=MODES)
    savepoint = forms.TypedChoiceField(coerce=int, required=False, empty_value=None, label="Verified savepoint")
    batch = forms.IntegerField(required=False, min_value=0, help_text="a retained batch; empty: the newest")
    from_batch = forms.IntegerField(required=False, min_value=0, help_text="for a diff: the earlier batch")
    operator = forms.IntegerField(required=False, min_value=0, initial=0)
    variable = forms.CharField(required=False, max_length=100, help_text="a transformWithState variable name")
    text = forms.CharField(required=False, max_length=200, help_text="for a lookup, e.g. o1042")
    offset = forms.IntegerField(required=False, min_value=0, initial=0)
    limit = forms.IntegerField(required=False, min_value=1, max_value=500, initial=50)

    def __init__(self, data: Any = None, *, job: Job) -> None:
        super().__init__(data)
        self.job = job
        verified = job.savepoints.filter(status="verified").order_by("-id")
        live = [("", "— the live checkpoint (a scratch copy) —")]
        self.fields["savepoint"].choices = live + [  # type: ignore[attr-defined]  # a TypedChoiceField
            (sp.id, f"#{sp.id} at batch {sp.batch_id}, {sp.created_at:%Y-%m-%d %H:%M}") for sp in verified
        ]

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if data.get("mode") == "diff" and data.get("from_batch") is None:
            self.add_error("from_batch", "A diff needs the earlier batch.")
        if data.get("mode") == "lookup" and not data.get("text"):
            self.add_error("text", "Give the text to look for in the keys.")
        if data.get("batch") is not None and data.get("from_batch") is not None and data["from_batch"] >= data["batch"]:
            self.add_error("from_batch", "The earlier batch must be before the batch.")
        chosen = data.get("savepoint")
        if chosen is not None and data.get("batch") is not None:
            held = self.job.savepoints.filter(id=chosen).values_list("batch_id", flat=True).first()
            if held != data["batch"]:
                # a savepoint holds one batch: reading it would silently ignore the batch typed
                self.add_error(
                    "batch",
                    f"Savepoint #{chosen} holds batch {held} only: leave the batch empty to read it, or choose the "
                    f"live checkpoint to read batch {data['batch']}.",
                )
        return data

    def spec(self) -> dict[str, Any]:
        return {k: v for k, v in self.cleaned_data.items() if v not in (None, "")}
