from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from dashboard import selectors
from dashboard.forms import JobForm
from dashboard.models import Job
from dashboard.services.runs import ActionRefused, job_request_start, job_request_stop
from workers.pipelines import CATALOG


@login_required
def job_list(request: HttpRequest) -> HttpResponse:
    jobs = list(selectors.job_list())
    return render(
        request, "dashboard/job_list.html", {"jobs": jobs, "dead_letters": selectors.dead_letter_counts(jobs)}
    )


@login_required
def job_detail(request: HttpRequest, name: str) -> HttpResponse:
    job = get_object_or_404(selectors.job_list(), name=name)
    count, summary = selectors.checkpoint_summary(job=job)
    context = {
        "job": job,
        "pipeline": CATALOG.get(job.pipeline),
        "runs": job.runs.select_related("requested_by")[:10],
        "history": selectors.checkpoint_history(job=job, page=request.GET.get("page")),
        "summary": summary,
        "summary_count": count,
        "results": selectors.job_results(job=job),
        "dead_letters": selectors.dead_letter_counts([job])[job.id],
    }
    return render(request, "dashboard/job_detail.html", context)


@login_required
def job_create(request: HttpRequest) -> HttpResponse:
    form = JobForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        job = form.save()
        messages.success(request, f"Created {job.name}. Its checkpoint will live in {job.checkpoint_location}.")
        return redirect("dashboard:job_detail", name=job.name)
    return render(
        request,
        "dashboard/job_form.html",
        {"form": form, "catalog": CATALOG.values()},
        status=400 if form.errors else 200,
    )


@login_required
def job_edit(request: HttpRequest, name: str) -> HttpResponse:
    job = get_object_or_404(Job, name=name)
    form = JobForm(request.POST or None, instance=job)
    if request.method == "POST" and form.is_valid():
        job = form.save()
        messages.success(request, f"Saved {job.name}. Changes take effect at its next start.")
        return redirect("dashboard:job_detail", name=job.name)
    context = {"form": form, "job": job, "catalog": CATALOG.values()}
    return render(request, "dashboard/job_form.html", context, status=400 if form.errors else 200)


@require_POST
@login_required
def job_start(request: HttpRequest, name: str) -> HttpResponse:
    job = get_object_or_404(Job, name=name)
    try:
        run = job_request_start(job=job, requested_by=request.user)
        messages.success(request, f"Start of {job.name} requested (run #{run.id}).")
    except ActionRefused as exc:
        messages.error(request, str(exc))
    return redirect("dashboard:job_detail", name=job.name)


@require_POST
@login_required
def job_stop(request: HttpRequest, name: str) -> HttpResponse:
    job = get_object_or_404(Job, name=name)
    try:
        run = job_request_stop(job=job)
        messages.success(
            request, f"Stop of {job.name} requested: run #{run.id} stops once its batch in flight commits."
        )
    except ActionRefused as exc:
        messages.error(request, str(exc))
    return redirect("dashboard:job_detail", name=job.name)
