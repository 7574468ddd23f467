from __future__ import annotations

import asyncio
import csv
import io
import itertools
import json
import re
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import redis
import redis.asyncio as aredis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth.decorators import login_required
from django.core.handlers.asgi import ASGIRequest
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime
from django.views.decorators.http import require_POST

from dashboard import pipelines
from dashboard.access import ADMIN, OPERATOR, may
from dashboard.checkpoint_dir.files import CheckpointError, committed_batches, lineage
from dashboard.connections import redis_client
from dashboard.forms import InspectForm, JobForm, RescaleForm
from dashboard.models import (
    ACTIVE_RUN_STATUSES,
    IN_FLIGHT_ACTIONS,
    ActionKind,
    Alert,
    AutoscaleMode,
    Job,
    SavepointStatus,
)
from dashboard.page_access import forbidden, requires
from dashboard.selectors import charts, checkpoints, incidents, jobs, lag
from dashboard.selectors.capacity import csv_rows, week_review
from dashboard.selectors.cluster import free_cores_warning
from dashboard.selectors.database import console_database
from dashboard.selectors.dead_letters import dead_letter_page, dead_letters_export
from dashboard.selectors.deploys import deploy_history, upgrade_view
from dashboard.selectors.exceptions import exception_history, failing_batch
from dashboard.selectors.partitions import partition_view
from dashboard.selectors.secrets import SecretRow, secret_list, secret_row
from dashboard.selectors.sinks import fork_consequences, job_sinks
from dashboard.services.actions import action_request
from dashboard.services.adoption import checkpoint_adopt, checkpoint_set_aside
from dashboard.services.audit import audit_csv, audit_filter, audit_record
from dashboard.services.autoscale import window_advice
from dashboard.services.blue_green import green_request, green_view, latest_blue_green
from dashboard.services.enqueue import WARM_STATE_READER, enqueue
from dashboard.services.errors import ActionRefused
from dashboard.services.forks import old_checkpoints, rollback_preview, savepoint_preview
from dashboard.services.rescale import BACKEND_SWITCH
from dashboard.services.runs import checkpoint_unknown, job_request_start, job_request_stop, shares_driver
from dashboard.services.secrets import SecretError, readable, secret_delete, secret_set
from dashboard.services.storage import job_storage as storage_of
from dashboard.services.storage import orphan_jobs
from dashboard.services.upgrade_parts import UpgradeRequestError, upgrade_request, upgrade_role_refusal
from dashboard.specs import drift


@login_required
def job_list(request: HttpRequest) -> HttpResponse:
    listed = list(jobs.job_list())
    context = {
        "jobs": listed,
        "dead_letters": jobs.dead_letter_counts(listed),
        "trends": jobs.job_trends(listed),
        "source_lag": lag.latest_source_lag(listed),
        "follow": _follow_position(),
    }
    return render(request, "dashboard/job_list.html", context)


# The job page's tabs, in Flink's order: (key, label, url name). The header (status, lag, actions) is on every one.
JOB_TABS = (
    ("overview", "Overview", "dashboard:job_detail"),
    ("exceptions", "Exceptions", "dashboard:job_exceptions"),
    ("checkpoints", "Checkpoints", "dashboard:job_checkpoints"),
    ("state", "State", "dashboard:job_state"),
    ("savepoints", "Savepoints", "dashboard:job_savepoints"),
    ("deploys", "Deploys", "dashboard:job_deploys"),
    ("runs", "Runs and recoveries", "dashboard:job_runs"),
    ("alerts", "Alerts", "dashboard:job_alerts"),
    ("dead-letters", "Dead letters", "dashboard:job_dead_letters"),
    ("results", "Results", "dashboard:job_results"),
)


def _job_tab(request: HttpRequest, job: Job, tab: str, context: dict[str, Any]) -> HttpResponse:
    """Render one tab of the job page under the header every tab shares."""
    header = {
        "run": job.own_runs.order_by("-id").first(),
        "lag": jobs.job_lag_status(job),
        "open_alerts": list(job.alerts.filter(resolved_at__isnull=True).order_by("-opened_at")),
        "action_in_flight": job.actions.filter(status__in=IN_FLIGHT_ACTIONS).first(),
        "autoscale": window_advice(job) if job.autoscale_mode != AutoscaleMode.OFF else None,
        "tabs": [(key, label, reverse(url, args=[job.name])) for key, label, url in JOB_TABS],
        "drift": drift(job),
        "unknown_checkpoint": checkpoint_unknown(job),
    }
    if not settings.READ_ONLY and may(request.user, OPERATOR):
        # previews, verifications and inspections read in Spark's state reader, whose start and warm-up take a
        # minute on a busy host: an operator who opens a job may well click one of them next
        enqueue(WARM_STATE_READER)
    title = next(label for key, label, _ in JOB_TABS if key == tab)
    base = {"job": job, "tab": tab, "tab_title": title, "header": header, "pipeline": pipelines.find(job.pipeline)}
    return render(request, f"dashboard/job/{tab}.html", base | context)


def _listed_job(name: str) -> Job:
    return get_object_or_404(jobs.job_list(), name=name)


@login_required
def job_detail(request: HttpRequest, name: str) -> HttpResponse:
    """Overview: key figures and the live charts."""
    job = _listed_job(name)
    run = job.runs.filter(status__in=ACTIVE_RUN_STATUSES).first()
    context = {
        "dead_letters": jobs.dead_letter_counts([job])[job.id],
        "source_lag": lag.latest_source_lag([job]).get(job.id),
        "source_down": lag.source_unreachable(job) if job.reads_kafka else None,
        "standby": job.standbys.first() if job.standby else None,
        "spare": jobs.spare_driver() if job.standby and shares_driver(job) else None,
        "shared": shares_driver(job),
        "active_run": run,  # the tabs' ``run`` is the header's: the latest run, active or not
        "shared_with": jobs.shared_with(run),
        "master_ui": settings.SPARK_MASTER_UI,
        "heap_alert_share": settings.ALERT_DRIVER_HEAP_PERCENT / 100,
    }
    return _job_tab(request, job, "overview", context)


@login_required
def job_exceptions(request: HttpRequest, name: str) -> HttpResponse:
    """Root causes with their repeats, and the batch a down job keeps failing on, with the way past it."""
    job = _listed_job(name)
    context = {"groups": exception_history(job), "failing": failing_batch(job)}
    return _job_tab(request, job, "exceptions", context)


@require_POST
@requires(OPERATOR)
def job_skip_entries(request: HttpRequest, name: str) -> HttpResponse:
    job = get_object_or_404(Job, name=name)
    try:
        batch = int(request.POST.get("batch", ""))
    except ValueError:
        messages.error(request, "Name the failing batch to skip.")
        return redirect("dashboard:job_exceptions", name=job.name)
    return _request_to(request, job, ActionKind.SKIP_ENTRIES, {"batch": batch}, "dashboard:job_exceptions")


@login_required
def job_checkpoints(request: HttpRequest, name: str) -> HttpResponse:
    """Checkpoints: summary, configuration (with the Spark settings frozen in the checkpoint) and history pages."""
    job = _listed_job(name)
    count, summary = checkpoints.checkpoint_summary(job=job)
    pipeline = pipelines.find(job.pipeline)
    context = {
        "summary": summary,
        "summary_count": count,
        "history": checkpoints.checkpoint_history(job=job, before=request.GET.get("before")),
        "retention_hours": settings.CHECKPOINT_RAW_RETENTION_HOURS,
        "frozen": checkpoints.frozen_configuration(job),
        "pipeline_conf": getattr(pipeline, "conf", {}) or {},
        "line": _line(job),
    }
    return _job_tab(request, job, "checkpoints", context)


def _line(job: Job) -> dict[str, Any]:
    """What began the job's checkpoint when a migration or an empty-state upgrade did (``write_lineage``)."""
    try:
        return lineage(job.checkpoint_location)
    except CheckpointError as exc:
        return {"base": "unknown", "reason": str(exc)}


@login_required
def job_state(request: HttpRequest, name: str) -> HttpResponse:
    job = _listed_job(name)
    return _job_tab(request, job, "state", {"partitions": partition_view(job)})


@login_required
def job_savepoints(request: HttpRequest, name: str) -> HttpResponse:
    job = _listed_job(name)
    context = {
        "savepoints": job.savepoints.exclude(status=SavepointStatus.DISPOSED)[:50],
        "old_checkpoints": old_checkpoints(job),
    }
    return _job_tab(request, job, "savepoints", context)


@login_required
def job_deploys(request: HttpRequest, name: str) -> HttpResponse:
    """What each run ran, and the stateful upgrade to another pipeline: preview, upgrade, roll back."""
    job = _listed_job(name)
    action = latest_blue_green(job)
    context = {"deploys": deploy_history(job), "upgrade": upgrade_view(job),
               "green": green_view(action) if action else None}  # fmt: skip
    return _job_tab(request, job, "deploys", context)


@require_POST
@requires(OPERATOR)
def job_upgrade(request: HttpRequest, name: str) -> HttpResponse:
    """Preview (``step=preview``), shadow-run (``step=shadow``) or upgrade to the chosen pipeline; refused at once
    when it cannot even be tried."""
    job = get_object_or_404(Job, name=name)
    target = request.POST.get("pipeline", "")[:100]
    steps = {"upgrade": ActionKind.UPGRADE, "shadow": ActionKind.UPGRADE_SHADOW, "blue-green": ActionKind.BLUE_GREEN}
    kind = steps.get(request.POST.get("step", ""), ActionKind.UPGRADE_PREVIEW)
    params: dict[str, Any] = {"pipeline": target}
    try:
        given = pipelines.parse_parameters(request.POST.get("parameters", ""))
    except ValueError as exc:
        messages.error(request, f"Parameters: {exc}")
        return redirect("dashboard:job_deploys", name=job.name)
    params["parameters"] = given
    if kind == ActionKind.UPGRADE and request.POST.get("empty_state"):
        params["empty_state"] = 1
    if kind in (ActionKind.UPGRADE, ActionKind.UPGRADE_PREVIEW, ActionKind.BLUE_GREEN) and request.POST.get("migrate"):
        params["migrate"] = 1
    if kind == ActionKind.BLUE_GREEN:
        params |= {"auto": int(bool(request.POST.get("auto"))), "no_removed": int(bool(request.POST.get("no_removed")))}
        if (percent := request.POST.get("max_changed_percent", "").strip()) != "":
            params["max_changed_percent"] = _whole_number(percent)
    if kind == ActionKind.UPGRADE_SHADOW and (records := request.POST.get("records", "").strip()):
        params["records"] = _whole_number(records)
    try:
        params = upgrade_request(job, kind, params)
    except UpgradeRequestError as exc:
        messages.error(request, str(exc))
        return redirect("dashboard:job_deploys", name=job.name)
    if kind in (ActionKind.UPGRADE, ActionKind.BLUE_GREEN) and (
        denied := upgrade_role_refusal(request.user, job, target, given)
    ):
        return forbidden(request, denied)
    return _request_to(request, job, kind, params, "dashboard:job_deploys")


def _whole_number(text: str) -> int | str:
    """A form's whole number as an int, or the text as given for the rules to refuse."""
    return int(text) if text.isdigit() and len(text) < 10 else text


@login_required
def job_blue_green(request: HttpRequest, name: str) -> HttpResponse:
    """The blue/green panel alone, for the Deploys tab to refresh while green runs beside the job."""
    job = _listed_job(name)
    action = latest_blue_green(job)
    context = {"job": job, "green": green_view(action) if action else None,
               "can_operate": may(request.user, OPERATOR)}  # fmt: skip
    return render(request, "dashboard/job/_blue_green.html", context)


@require_POST
@requires(OPERATOR)
def job_blue_green_request(request: HttpRequest, name: str, what: str) -> HttpResponse:
    """Promote (hand over now) or abort the job's blue/green upgrade in flight."""
    job = get_object_or_404(Job, name=name)
    action = latest_blue_green(job)
    if what not in ("promote", "abort") or action is None:
        messages.error(request, f"{job.name} has no blue/green upgrade to {what}.")
        return redirect("dashboard:job_deploys", name=job.name)
    try:
        up = green_request(action, what)
    except ActionRefused as exc:
        messages.error(request, str(exc))
        return redirect("dashboard:job_deploys", name=job.name)
    audit_record(request, verb=f"blue-green-{what}", job=job.name, target=f"action #{action.id}", outcome="requested")
    when = "" if up else "The new version is not up yet: kept, and done once it follows the job. "
    messages.success(request, when + ("Handing over once green has committed what the job has." if what == "promote"
                     else "Aborting: green stops, its fork and its diff are removed; the job is untouched."))  # fmt: skip
    return redirect("dashboard:job_deploys", name=job.name)


@require_POST
@requires(OPERATOR)
def job_upgrade_rollback(request: HttpRequest, name: str) -> HttpResponse:
    job = get_object_or_404(Job, name=name)
    try:
        upgrade = int(request.POST.get("upgrade", ""))
    except ValueError:
        messages.error(request, "Name the upgrade to roll back.")
        return redirect("dashboard:job_deploys", name=job.name)
    return _request_to(request, job, ActionKind.UPGRADE_ROLLBACK, {"upgrade": upgrade}, "dashboard:job_deploys")


@login_required
def job_runs(request: HttpRequest, name: str) -> HttpResponse:
    """Runs with their exceptions, automatic recoveries and operator actions."""
    job = _listed_job(name)
    context = {
        "runs": job.runs.select_related("requested_by")[:20],
        "recoveries": job.recoveries.select_related("failed_run", "restart_run")[:20],
        "actions": job.actions.select_related("requested_by")[:20],
    }
    return _job_tab(request, job, "runs", context)


@login_required
def job_alerts(request: HttpRequest, name: str) -> HttpResponse:
    job = _listed_job(name)
    return _job_tab(request, job, "alerts", {"alerts": job.alerts.all()[:50]})


@requires(OPERATOR, methods=("POST",))
def job_dead_letters(request: HttpRequest, name: str) -> HttpResponse | StreamingHttpResponse:
    """The dead letters, newest first (?before= pages); ?format=jsonl exports them all; a POST re-drives the ticked
    ones (or all) into the source, as an audited action."""
    job = _listed_job(name)
    if request.method == "POST":
        chosen = request.POST.getlist("id")
        if request.POST.get("all") == "1":
            return _request_to(
                request, job, ActionKind.REDRIVE_DEAD_LETTERS, {"all": True}, "dashboard:job_dead_letters"
            )
        if not chosen:
            messages.error(request, "Tick the dead letters to re-drive; nothing was sent.")
            return redirect("dashboard:job_dead_letters", name=job.name)
        return _request_to(
            request, job, ActionKind.REDRIVE_DEAD_LETTERS, {"ids": chosen[:10_000]}, "dashboard:job_dead_letters"
        )
    if request.GET.get("format") == "jsonl":
        response = StreamingHttpResponse(dead_letters_export(job), content_type="application/x-ndjson")
        response["Content-Disposition"] = f'attachment; filename="{job.name}-dead-letters.jsonl"'
        return response
    try:
        try:
            page = dead_letter_page(job, before=request.GET.get("before") or None)
        except redis.ResponseError:  # not a stream id: a bad cursor shows the newest page, as the history does
            page = dead_letter_page(job)
    except redis.RedisError as exc:
        messages.error(request, f"Redis cannot be read now ({exc}): the dead letters are not shown.")
        page = None
    return _job_tab(request, job, "dead-letters", {"page": page})


@login_required
def job_results(request: HttpRequest, name: str) -> HttpResponse:
    job = _listed_job(name)
    return _job_tab(request, job, "results", {"results": jobs.job_results(job=job), "sinks": job_sinks(job)})


def _plain(values: dict) -> dict:
    """JSON-safe copies of form values (decimals, dates) for the audit trail."""
    return json.loads(json.dumps(values, default=str))


def _warn_cores(request: HttpRequest, job: Job) -> None:
    """On a cluster without enough free cores for the job, say so where the operator acts: it would sit starting."""
    if warning := free_cores_warning(job):
        messages.warning(request, f"{job.name}: {warning}.")


@requires(ADMIN)
def job_create(request: HttpRequest) -> HttpResponse:
    form = JobForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        job = form.save()
        messages.success(request, f"Created {job.name}. Its checkpoint will live in {job.checkpoint_location}.")
        _warn_cores(request, job)
        settings_given = {name: form.cleaned_data[name] for name in form.fields}
        audit_record(request, verb="job-create", job=job.name, params=_plain(settings_given), outcome="succeeded")
        return redirect("dashboard:job_detail", name=job.name)
    return render(
        request,
        "dashboard/job_form.html",
        {"form": form, "catalog": pipelines.registry().pipelines.values()},
        status=400 if form.errors else 200,
    )


@requires(ADMIN)
def job_edit(request: HttpRequest, name: str) -> HttpResponse:
    job = get_object_or_404(Job, name=name)
    before = {field: getattr(job, field) for field in JobForm.Meta.fields}
    form = JobForm(request.POST or None, instance=job)
    if request.method == "POST" and form.is_valid():
        job = form.save()
        changes = {f: [before[f], form.cleaned_data[f]] for f in form.changed_data if before[f] != form.cleaned_data[f]}
        audit_record(request, verb="job-edit", job=job.name, params=_plain(changes), outcome="succeeded")
        messages.success(request, f"Saved {job.name}. Changes take effect at its next start.")
        _warn_cores(request, job)
        return redirect("dashboard:job_detail", name=job.name)
    context = {"form": form, "job": job, "catalog": pipelines.registry().pipelines.values()}
    return render(request, "dashboard/job_form.html", context, status=400 if form.errors else 200)


@require_POST
@requires(OPERATOR)
def job_checkpoint_decide(request: HttpRequest, name: str, decision: str) -> HttpResponse:
    """Adopt a checkpoint this console never recorded, or set it aside (see services/adoption.py)."""
    job = get_object_or_404(Job, name=name)
    if decision not in ("adopt", "set-aside"):
        raise Http404("adopt or set-aside")
    verb = f"checkpoint-{decision}"
    try:
        done = checkpoint_adopt(job) if decision == "adopt" else checkpoint_set_aside(job)
    except ActionRefused as exc:
        messages.error(request, str(exc))
        audit_record(request, verb=verb, job=job.name, outcome="refused", message=str(exc))
    else:
        messages.success(request, done)
        audit_record(request, verb=verb, job=job.name, outcome="succeeded", message=done)
    return redirect("dashboard:job_detail", name=job.name)


@require_POST
@requires(OPERATOR)
def job_start(request: HttpRequest, name: str) -> HttpResponse:
    job = get_object_or_404(Job, name=name)
    try:
        run = job_request_start(job=job, requested_by=request.user, refuse_during_action=True)
        messages.success(request, f"Start of {job.name} requested (run #{run.id}).")
        _warn_cores(request, job)
        audit_record(request, verb="start", job=job.name, target=f"run #{run.id}", outcome="requested")
    except ActionRefused as exc:
        messages.error(request, str(exc))
        audit_record(request, verb="start", job=job.name, outcome="refused", message=str(exc))
    return redirect("dashboard:job_detail", name=job.name)


@require_POST
@requires(OPERATOR)
def job_stop(request: HttpRequest, name: str) -> HttpResponse:
    job = get_object_or_404(Job, name=name)
    try:
        run = job_request_stop(job=job)
        messages.success(
            request, f"Stop of {job.name} requested: run #{run.id} stops once its batch in flight commits."
        )
        audit_record(request, verb="stop", job=job.name, target=f"run #{run.id}", outcome="requested")
    except ActionRefused as exc:
        messages.error(request, str(exc))
        audit_record(request, verb="stop", job=job.name, outcome="refused", message=str(exc))
    return redirect("dashboard:job_detail", name=job.name)


def _request(request: HttpRequest, job: Job, kind: str, params: dict | None = None) -> HttpResponse:
    return _request_to(request, job, kind, params, "dashboard:job_detail")


def _request_to(request: HttpRequest, job: Job, kind: str, params: dict | None, back: str) -> HttpResponse:
    try:
        action = action_request(job=job, kind=kind, params=params, requested_by=request.user)
        messages.success(request, f"{action.get_kind_display()} #{action.id} requested.")
        audit_record(
            request, verb=kind, job=job.name, target=f"action #{action.id}", params=params, outcome="requested"
        )
    except ActionRefused as exc:
        messages.error(request, str(exc))
        audit_record(request, verb=kind, job=job.name, params=params, outcome="refused", message=str(exc))
    return redirect(back, name=job.name)


@require_POST
@requires(OPERATOR)
def job_savepoint(request: HttpRequest, name: str) -> HttpResponse:
    return _request(request, get_object_or_404(Job, name=name), ActionKind.SAVEPOINT)


@require_POST
@requires(OPERATOR)
def job_stop_with_savepoint(request: HttpRequest, name: str) -> HttpResponse:
    return _request(request, get_object_or_404(Job, name=name), ActionKind.STOP_WITH_SAVEPOINT)


@require_POST
@requires(OPERATOR)
def job_count_rows(request: HttpRequest, name: str) -> HttpResponse:
    return _request(request, get_object_or_404(Job, name=name), ActionKind.COUNT_PARTITION_ROWS)


@requires(OPERATOR)
def job_restore(request: HttpRequest, name: str, savepoint_id: int) -> HttpResponse:
    job = get_object_or_404(Job, name=name)
    savepoint = get_object_or_404(job.savepoints, id=savepoint_id)
    preview = savepoint_preview(job, savepoint)
    if request.method == "POST" and not preview.refusal:
        return _request(request, job, ActionKind.RESTORE, {"savepoint": savepoint.id})
    context = {"job": job, "title": f"Restore savepoint #{savepoint.id}", "preview": preview, "savepoint": savepoint,
               "sinks": fork_consequences(job, preview.batch_id, Path(savepoint.path or "-") / "checkpoint")}  # fmt: skip
    return render(request, "dashboard/action_preview.html", context, status=409 if request.method == "POST" else 200)


@requires(OPERATOR)
def job_rollback(request: HttpRequest, name: str) -> HttpResponse:
    job = get_object_or_404(Job, name=name)
    try:
        batch = int(request.GET.get("batch") or request.POST.get("batch") or "")
    except ValueError:
        messages.error(request, "Choose a committed batch to roll back to.")
        return redirect("dashboard:job_detail", name=job.name)
    preview = rollback_preview(job, batch)
    if request.method == "POST" and not preview.refusal:
        return _request(request, job, ActionKind.ROLLBACK, {"batch": batch})
    context = {"job": job, "title": f"Roll back to batch {batch}", "preview": preview, "batch": batch,
               "sinks": fork_consequences(job, batch, job.checkpoint_location)}  # fmt: skip
    return render(request, "dashboard/action_preview.html", context, status=409 if request.method == "POST" else 200)


@requires(OPERATOR)
def job_rescale(request: HttpRequest, name: str) -> HttpResponse:
    job = get_object_or_404(Job, name=name)
    form = RescaleForm(request.POST or None, job=job)
    if request.method == "POST" and form.is_valid():
        scale = {k: v for k, v in form.cleaned_data.items() if k != "how"}
        if form.cleaned_data.get("how") == "blue-green":
            params = {"pipeline": job.pipeline, "state_partitions": scale["state_partitions"], "auto": 1}
            return _request_to(request, job, ActionKind.BLUE_GREEN, params, "dashboard:job_deploys")
        return _request(request, job, ActionKind.RESCALE, scale)
    context = {"job": job, "form": form, "backend_switch": BACKEND_SWITCH}
    return render(request, "dashboard/rescale.html", context, status=400 if form.errors else 200)


@requires(OPERATOR)
def savepoint_dispose(request: HttpRequest, name: str, savepoint_id: int) -> HttpResponse:
    job = get_object_or_404(Job, name=name)
    savepoint = get_object_or_404(job.savepoints, id=savepoint_id)
    if request.method == "POST":
        return _request(request, job, ActionKind.DISPOSE_SAVEPOINT, {"savepoint": savepoint.id})
    context = {"job": job, "title": f"Dispose savepoint #{savepoint.id}", "savepoint": savepoint, "dispose": True}
    return render(request, "dashboard/action_preview.html", context)


@requires(OPERATOR)
def checkpoint_discard(request: HttpRequest, name: str, directory: str) -> HttpResponse:
    job = get_object_or_404(Job, name=name)
    old = next((o for o in old_checkpoints(job) if o.name == directory), None)
    if old is None:
        messages.error(request, f"{directory} is not an old checkpoint directory of {job.name}.")
        return redirect("dashboard:job_detail", name=job.name)
    if request.method == "POST":
        return _request(request, job, ActionKind.DISCARD_CHECKPOINT, {"directory": old.name})
    context = {"job": job, "title": f"Discard {old.name}", "old": old, "dispose": True}
    return render(request, "dashboard/action_preview.html", context)


def _follow_position() -> str:
    """The live stream's newest entry id: where a page loaded now starts following."""
    try:
        newest = redis_client(timeout=2).xrevrange(settings.LIVE_STREAM, count=1)
        return newest[0][0].decode() if newest else "0-0"
    except redis.RedisError:
        return "$"


@login_required
def job_series(request: HttpRequest, name: str) -> JsonResponse:
    """Chart points for a time range (raw, per minute or per hour), the incidents on the same axis, the lag status
    on the latest raw checkpoints, and the live stream position to follow from."""
    job = get_object_or_404(Job, name=name)
    span = charts.RANGES.get(request.GET.get("range", "15m"), charts.RANGES["15m"])
    now = timezone.now()
    series = charts.chart_series(job, span, now)
    return JsonResponse(
        {
            "points": series.points,
            "resolution": series.resolution,
            "labels": charts.LABELS,
            "source": lag.source_series(job, now - span),
            "incidents": incidents.incidents(job, now - span),
            "status": jobs.job_lag_status(job, now, recent=series.recent),
            "follow": _follow_position(),
            "trigger": job.trigger_interval_seconds,
        }
    )


LIVE_STREAM_SECONDS = 300  # a stream ends after this; the browser reconnects with Last-Event-ID and misses nothing


async def _status_event(job: Job, window: lag.LagWindow | None) -> str:
    """The job's status judged afresh, as an event: on the stream's own window of its checkpoints (seeded from the
    database and extended by every point pushed), not a re-read of them."""
    recent = window.points if window is not None else None
    return sse("status", await sync_to_async(jobs.job_lag_status)(job, recent=recent))


def sse(event: str, body: Any, entry_id: str = "") -> str:
    """One server-sent event: its live-stream id (the browser resumes after it), its name, its JSON."""
    return (f"id: {entry_id}\n" if entry_id else "") + f"event: {event}\ndata: {json.dumps(body)}\n\n"


async def _live_events(job: Job | None, cursor: str) -> AsyncIterator[str]:
    """Checkpoints and incidents from the live stream, for one job or (None) for all. A job's checkpoints carry the
    lag status judged on the server; its source samples and a keep-alive re-judge it (STOP is the absence of
    commits)."""
    client = aredis.Redis.from_url(settings.REDIS_URL)
    window = None
    if job is not None:
        window = lag.LagWindow(await sync_to_async(charts.recent_points)(job), job.trigger_interval_seconds)
    yield "retry: 2000\n\n"
    ends = time.monotonic() + LIVE_STREAM_SECONDS
    try:
        while time.monotonic() < ends:
            try:
                reply = await client.xread({settings.LIVE_STREAM: cursor}, block=15_000, count=500)
            except aredis.RedisError:
                yield ": redis unavailable\n\n"  # the browser keeps the connection; the stream returns with Redis
                await asyncio.sleep(2)
                continue
            if not reply:
                if job is not None:  # judged afresh: a job that went down says so from its source
                    yield await _status_event(job, window)
                else:
                    yield ": keep-alive\n\n"
                continue
            for entry_id, fields in reply[0][1]:
                cursor = entry_id.decode()
                try:
                    data = json.loads(fields[b"data"])
                except (KeyError, ValueError):
                    continue
                if job is not None and data.get("job") != job.id:
                    continue
                if "record" in data:
                    body = charts.point(data["record"]) | {"job": data["job"]}
                    if window is not None:
                        window.add(body)
                        body["status"] = window.status()
                    yield sse("checkpoint", body, cursor)
                elif "incident" in data:
                    body = data["incident"] | {"job": data["job"]}
                    yield sse("incident", body, cursor)
                    if job is not None:  # a run started or ended, an action or an alert: the header's run with it
                        yield await _status_event(job, window)
                elif "source" in data:
                    body = data["source"] | {"job": data["job"]}
                    yield sse("source", body, cursor)
                    if job is not None:  # a job that is down is judged from its source: with each sample, not only
                        # when the stream falls quiet (other jobs' samples keep it busy)
                        yield await _status_event(job, window)
    finally:
        await client.aclose()  # type: ignore[attr-defined]  # redis 5+ has aclose; the stubs predate it


STREAM_CURSOR = re.compile(r"^(\$|\d{1,20}(-\d{1,20})?)$")
# Open live streams in this server process: (user id, a token) -> when it opened. A stream ends by itself after
# LIVE_STREAM_SECONDS, so an entry older than that (a stream whose cleanup never ran) no longer counts.
_open_streams: dict[tuple[int, int], float] = {}
_stream_numbers = itertools.count()


def _stream_slot(user_id: int) -> tuple[int, int] | str:
    """A place for one more live stream of this user, or why there is none (per user, and in all)."""
    now = time.monotonic()
    for slot, opened in list(_open_streams.items()):
        if now - opened > LIVE_STREAM_SECONDS + 30:
            _open_streams.pop(slot, None)
    mine = sum(1 for uid, _ in _open_streams if uid == user_id)
    if mine >= settings.LIVE_STREAMS_PER_USER:
        return f"{mine} live streams are open for you already (the limit is {settings.LIVE_STREAMS_PER_USER}): close a tab."
    if len(_open_streams) >= settings.LIVE_STREAMS_TOTAL:
        return f"The console serves {len(_open_streams)} live streams already (the limit): try again in a minute."
    slot = (user_id, next(_stream_numbers))
    _open_streams[slot] = now
    return slot


async def _counted(events: AsyncIterator[str], slot: tuple[int, int]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    finally:
        _open_streams.pop(slot, None)


def _event_stream(request: HttpRequest, job: Job | None, user_id: int) -> HttpResponse | StreamingHttpResponse:
    if not isinstance(request, ASGIRequest):  # a WSGI server would hold a thread for as long as the browser watches
        return HttpResponse("Live updates need the ASGI server (uvicorn).", status=503, content_type="text/plain")
    cursor = request.headers.get("Last-Event-ID") or request.GET.get("after") or "$"
    if not STREAM_CURSOR.match(cursor):  # answered once: a browser does not reconnect after an error status
        return HttpResponse("after must be a stream entry id (such as 1700000000000-0) or $.", status=400,
                            content_type="text/plain")  # fmt: skip
    slot = _stream_slot(user_id)
    if isinstance(slot, str):
        return HttpResponse(slot, status=429, content_type="text/plain")
    response = StreamingHttpResponse(_counted(_live_events(job, cursor), slot), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


@login_required
async def job_live(request: HttpRequest, name: str) -> HttpResponse | StreamingHttpResponse:
    """Server-sent events, one per committed batch; a reconnecting browser sends Last-Event-ID and misses nothing."""
    job = await sync_to_async(Job.objects.filter(name=name).first)()
    if job is None:
        raise Http404(name)
    user = await request.auser()
    return _event_stream(request, job, int(user.pk or 0))


@login_required
async def jobs_live(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    """Server-sent events for the job list: every job's checkpoints."""
    user = await request.auser()
    return _event_stream(request, None, int(user.pk or 0))


@login_required
def alert_list(request: HttpRequest) -> HttpResponse:
    alerts = Alert.objects.select_related("job")
    job_name, state = request.GET.get("job", ""), request.GET.get("state", "")
    if job_name:
        alerts = alerts.filter(job__name=job_name)
    if state == "open":
        alerts = alerts.filter(resolved_at__isnull=True)
    elif state == "resolved":
        alerts = alerts.filter(resolved_at__isnull=False)
    page = Paginator(alerts.order_by("-opened_at", "-id"), 50).get_page(request.GET.get("page"))
    context = {
        "alerts": page,
        "jobs": Job.objects.order_by("name").values_list("name", flat=True),
        "job_name": job_name,
        "state": state,
        "open_count": Alert.objects.filter(resolved_at__isnull=True).count(),
    }
    return render(request, "dashboard/alert_list.html", context)


def _moment(text: str) -> datetime | None:
    """A datetime-local field's value, in the server's time zone; None when empty or not a time."""
    try:
        moment = parse_datetime(text) if text else None
    except ValueError:
        return None
    if moment is not None and timezone.is_naive(moment):
        moment = timezone.make_aware(moment)
    return moment


@login_required
def audit_list(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    """The audit trail, filterable by job, user and time; ?format=csv exports what the filter selects."""
    job_name, username = request.GET.get("job", ""), request.GET.get("user", "")
    since, until = _moment(request.GET.get("since", "")), _moment(request.GET.get("until", ""))
    bad = [name for name in ("since", "until") if request.GET.get(name) and _moment(request.GET[name]) is None]
    entries = audit_filter(job=job_name, user=username, since=since, until=until)
    if request.GET.get("format") == "csv" and not bad:
        cap, total = settings.AUDIT_CSV_MAX_ROWS, entries.count()
        response = StreamingHttpResponse(audit_csv(entries, cap), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="statekeeper-audit-{timezone.now():%Y%m%d-%H%M%S}.csv"'
        response["X-Statekeeper-Rows"] = str(min(cap, total))
        if total > cap:  # the newest `cap` entries; the page says how to get the rest
            response["X-Statekeeper-Truncated"] = f"{cap} of {total} entries: narrow the time range for the rest"
        return response
    context = {
        "entries": Paginator(entries, 100).get_page(request.GET.get("page")),
        "jobs": Job.objects.order_by("name").values_list("name", flat=True),
        # real users only: a failed login's entry carries whatever name was tried
        "users": get_user_model().objects.order_by("username").values_list("username", flat=True),
        "filters": {
            "job": job_name,
            "user": username,
            "since": request.GET.get("since", ""),
            "until": request.GET.get("until", ""),
        },
        "bad": bad,
        "csv_cap": settings.AUDIT_CSV_MAX_ROWS,
        "query": urlencode({k: v for k, v in request.GET.items() if k in ("job", "user", "since", "until") and v}),
    }
    return render(request, "dashboard/audit_list.html", context, status=400 if bad else 200)


@login_required
def capacity(request: HttpRequest) -> HttpResponse:
    """The weekly capacity review: ?end=YYYY-MM-DD (the week before that day; default the last 7 days),
    ?format=csv for the table, ?print=1 for the printable view."""
    end_text = request.GET.get("end", "")
    end = None
    if end_text:
        day = parse_date(end_text) if len(end_text) == 10 else None
        if day is None:
            messages.error(request, f"Not a date: {end_text[:40]!r}. Use YYYY-MM-DD; showing the last 7 days.")
        else:
            end = timezone.make_aware(datetime(day.year, day.month, day.day))
    review = week_review(end)
    if request.GET.get("format") == "csv":
        out = io.StringIO()
        csv.writer(out).writerows(csv_rows(review))
        response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="capacity-{review.end:%Y-%m-%d}.csv"'
        return response
    # each chart spans the whole week: a week with one hourly bucket would otherwise zoom to milliseconds
    week = [review.start.isoformat(), review.end.isoformat()]
    charts = {
        r.job.name: r.series | {"trigger_ms": r.job.trigger_interval_seconds * 1000, "range": week} for r in review.jobs
    }
    context = {
        "review": review,
        "database": console_database(),
        "charts": charts,
        "printable": request.GET.get("print") == "1",
        "end": end_text,
        "orphan_jobs": orphan_jobs(),
    }
    return render(request, "dashboard/capacity.html", context)


@requires(OPERATOR, methods=("POST",))
def job_storage(request: HttpRequest, name: str) -> HttpResponse:
    """Bytes on disk by category (adding up to du), what retention settings would reclaim, and orphans to clean up:
    the clean-up is a POST of the orphans the operator ticked, run as an action."""
    job = get_object_or_404(Job, name=name)
    storage = storage_of(job)
    if request.method == "POST":
        chosen = [n for n in request.POST.getlist("orphan") if n in {e.name for e in storage.orphans}]
        if not chosen:
            messages.error(request, "Tick the orphans to remove; nothing was deleted.")
            return redirect("dashboard:job_storage", name=job.name)
        return _request(request, job, ActionKind.CLEAN_ORPHANS, {"orphans": chosen})
    retention = [
        (n, storage.retention_reclaims(n)) for n in sorted({job.batches_retained, 50, 20, 10, 5}, reverse=True)
    ]
    savepoint_keep = [
        (n, storage.savepoint_reclaims(n)) for n in sorted({job.savepoints_max_count, 5, 3, 1}, reverse=True)
    ]
    context = {"job": job, "storage": storage, "retention": retention, "savepoint_keep": savepoint_keep}
    return render(request, "dashboard/storage.html", context)


@requires(OPERATOR, methods=("POST",))
def job_inspect(request: HttpRequest, name: str) -> HttpResponse:
    """The state inspector: a form that requests an inspection (an action, operator role), and the answers of the
    recent ones; ?action=<id> shows one."""
    job = get_object_or_404(Job, name=name)
    form = InspectForm(request.POST or None, job=job)
    if request.method == "POST" and form.is_valid():
        return _request_to(request, job, ActionKind.INSPECT_STATE, form.spec(), "dashboard:job_inspect")
    inspections = job.actions.filter(kind=ActionKind.INSPECT_STATE).order_by("-id")
    chosen = (
        inspections.filter(id=request.GET.get("action") or 0).first()
        if request.GET.get("action", "").isdigit()
        else None
    )
    shown = chosen or inspections.filter(status="succeeded").first()
    answer = (shown.params.get("result") or {}) if shown else {}
    if request.method == "GET" and not settings.READ_ONLY and may(request.user, OPERATOR):
        enqueue(WARM_STATE_READER)  # so that the inspection this page is opened for finds Spark's reader warm
    context = {
        "job": job,
        "form": form,
        "recent": inspections[:10],
        "shown": shown,
        "page_end": answer.get("offset", 0) + len(answer.get("rows", [])),  # the next page starts here
        "batches": committed_batches(job.checkpoint_location),
    }
    return render(request, "dashboard/inspect.html", context, status=400 if form.errors else 200)


@requires(ADMIN, methods=("POST",))
def secret_list_view(request: HttpRequest) -> HttpResponse:
    """Secrets for the jobs' sinks: names, versions and the jobs that name them, never a value. An admin sets a new
    one, rotates one (the same name again) or deletes one no job names."""
    if request.method == "POST":
        name = request.POST.get("name", "").strip()[:100]
        if request.POST.get("delete"):
            try:
                secret_delete(name=name)
            except SecretError as exc:
                audit_record(request, verb="secret-delete", target=name, outcome="refused", message=str(exc))
                messages.error(request, f"Not deleted: {exc}.")
            else:
                audit_record(request, verb="secret-delete", target=name, outcome="succeeded")
                messages.success(request, f"Deleted the secret {name}.")
            return redirect("dashboard:secret_list")
        try:
            saved, created = secret_set(
                name=name, value=request.POST.get("value", ""), username=request.user.get_username()
            )
        except SecretError as exc:
            audit_record(request, verb="secret-set", target=name, outcome="refused", message=str(exc))
            messages.error(request, f"Not saved: {exc}.")
            return redirect("dashboard:secret_list")
        audit_record(request, verb="secret-set" if created else "secret-rotate", target=name, outcome="succeeded")
        row = secret_row(name) or SecretRow(saved)  # deleted in between: no job to name
        if created:
            messages.success(request, f"Saved the secret {name}: a parameter names it as ${{secret:{name}}}.")
        elif row.stale:
            messages.success(request, f"Rotated {name} (version {row.secret.version}): {', '.join(row.stale)} take "
                             "the new value at their next start or upgrade.")  # fmt: skip
        else:
            messages.success(request, f"Rotated {name} (version {row.secret.version}).")
        return redirect("dashboard:secret_list")
    rows = secret_list()
    unreadable = {row.secret.name for row in rows if not readable(row.secret)}
    return render(request, "dashboard/secret_list.html", {"rows": rows, "unreadable": unreadable})
