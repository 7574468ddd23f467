"""Autoscaling from the capacity signals: per job off, recommend (shown on the job page and in the review), or apply
(a rescale action, audited like a manual one, with origin "autoscaler").

A running job's window is judged; a stopped one has no recommendation. A recommendation is applied only when it
holds over the job's whole window (the median batch time of the window's checkpoints, the window full of them), no
rescale happened in the window, and fewer than the job's daily cap of automatic rescales happened in the last 24
hours."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.utils import timezone

from dashboard.models import ACTIVE_RUN_STATUSES, Action, ActionKind, AutoscaleMode, Checkpoint, Job
from dashboard.selectors.capacity import Recommendation, parallelism_advice
from dashboard.services.actions import action_request
from dashboard.services.errors import ActionRefused
from dashboard.stats import quantile


def window_advice(job: Job, now: datetime | None = None) -> tuple[Recommendation | None, str]:
    """The parallelism recommendation over the job's window, and why there is none when there is none."""
    now = now or timezone.now()
    if not job.runs.filter(status__in=ACTIVE_RUN_STATUSES).exists():
        # its window's batches are its last run's: a rescale is judged on the run it would change
        return None, "the job is not running"
    start = now - timedelta(minutes=job.autoscale_window_minutes)
    durations = list(
        Checkpoint.objects.filter(job=job, location=job.checkpoint_dir, committed_at__gte=start).values_list(
            "committed_at", "duration_ms"
        )
    )
    if not durations or min(t for t, _ in durations) > start + timedelta(minutes=job.autoscale_window_minutes) / 4:
        return None, f"not enough checkpoints in the last {job.autoscale_window_minutes} minutes"
    if Action.objects.filter(job=job, kind=ActionKind.RESCALE, requested_at__gte=start).exists():
        return None, "a rescale happened within the window"
    utilisation = quantile([float(d) for _, d in durations], 0.5) / (job.trigger_interval_seconds * 1000)
    advice = parallelism_advice(job, utilisation, now)
    return advice, "" if advice else "within the target band"


def autoscale_run(now: datetime | None = None) -> list[str]:
    """The periodic pass: apply what APPLY-mode jobs' windows recommend, within their daily caps."""
    now = now or timezone.now()
    notes = []
    for job in Job.objects.filter(autoscale_mode=AutoscaleMode.APPLY):
        advice, why = window_advice(job, now)
        if advice is None:
            continue
        today = Action.objects.filter(
            job=job, kind=ActionKind.RESCALE, origin="autoscaler", requested_at__gte=now - timedelta(hours=24)
        ).count()
        if today >= job.autoscale_max_per_day:
            notes.append(f"{job.name}: {advice.text} held back, {today} automatic rescales in 24 h (cap)")
            continue
        try:
            action = action_request(
                job=job, kind=ActionKind.RESCALE, params={**advice.params, "reason": advice.reason}, origin="autoscaler"
            )
        except ActionRefused as exc:
            notes.append(f"{job.name}: {advice.text} not requested: {exc}")
            continue
        notes.append(f"{job.name}: {advice.text} requested as action #{action.id}")
    return notes
