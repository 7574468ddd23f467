from django.contrib import admin

from dashboard.forms import JobForm, ThrottledAdminLoginForm
from dashboard.models import Checkpoint, Job, Run

admin.site.login_form = ThrottledAdminLoginForm  # every login path counts failures and locks out the same way


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    form = JobForm
    list_display = ("name", "pipeline", "state_backend", "parallelism", "state_partitions", "source_stream")
    readonly_fields = ("lease_token", "lease_expires_at", "latest_checkpoint")


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ("id", "job", "status", "requested_at", "started_at", "ended_at", "pid")
    list_filter = ("status",)


@admin.register(Checkpoint)
class CheckpointAdmin(admin.ModelAdmin):
    list_display = ("job", "batch_id", "committed_at", "duration_ms", "input_rows", "checkpointed_bytes", "lag_records")
    list_filter = ("job",)
