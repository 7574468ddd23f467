"""The Django admin: for looking, and for editing a job's settings the way the console's form does. It obeys
read-only mode, writes every change to the audit trail, and never edits what the supervisor trusts (a run's process,
its lease token, its status; checkpoints are Spark's record)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib import admin
from django.db.models import Model
from django.http import HttpRequest

from dashboard.forms import JobForm, ThrottledAdminLoginForm
from dashboard.models import Checkpoint, Job, Run
from dashboard.services.audit import audit_record

admin.site.login_form = ThrottledAdminLoginForm  # every login path counts failures and locks out the same way


class AuditedAdmin(admin.ModelAdmin):
    """Refuses every write in read-only mode, and records each one it makes in the audit trail."""

    def has_add_permission(self, request: HttpRequest, *args: Any) -> bool:
        return not settings.READ_ONLY and super().has_add_permission(request, *args)

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return not settings.READ_ONLY and super().has_change_permission(request, obj)

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return not settings.READ_ONLY and super().has_delete_permission(request, obj)

    def _audit(self, request: HttpRequest, verb: str, obj: Model, message: Any = "") -> None:
        name = obj._meta.model_name
        audit_record(
            request, verb=f"admin-{verb}", job=getattr(obj, "name", "") if isinstance(obj, Job) else "",
            target=f"{name} #{obj.pk}", message=str(message)[:2000], outcome="succeeded", origin="admin",
        )  # fmt: skip

    def log_addition(self, request: HttpRequest, obj: Model, message: Any) -> Any:
        self._audit(request, "add", obj, message)
        return super().log_addition(request, obj, message)

    def log_change(self, request: HttpRequest, obj: Model, message: Any) -> Any:
        self._audit(request, "change", obj, message)
        return super().log_change(request, obj, message)

    def log_deletions(self, request: HttpRequest, queryset: Any) -> Any:
        for obj in queryset:
            self._audit(request, "delete", obj)
        return super().log_deletions(request, queryset)


@admin.register(Job)
class JobAdmin(AuditedAdmin):
    form = JobForm
    list_display = ("name", "pipeline", "state_backend", "parallelism", "state_partitions", "source_stream")
    readonly_fields = ("lease_token", "lease_expires_at", "latest_checkpoint")


@admin.register(Run)
class RunAdmin(AuditedAdmin):
    list_display = ("id", "job", "status", "requested_at", "started_at", "ended_at", "pid")
    list_filter = ("status",)

    def has_add_permission(self, request: HttpRequest, *args: Any) -> bool:
        return False  # runs are started through the console, which takes the lease

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        # what the supervisor trusts: the process, the lease token, the status and its times
        return [f.name for f in Run._meta.fields if f.name not in ("message",)]


@admin.register(Checkpoint)
class CheckpointAdmin(AuditedAdmin):
    list_display = ("job", "batch_id", "committed_at", "duration_ms", "input_rows", "checkpointed_bytes", "lag_records")
    list_filter = ("job",)

    def has_add_permission(self, request: HttpRequest, *args: Any) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # Spark's record of a committed batch
