"""/metrics in Prometheus' text format: per job lag, state, checkpoint size and duration, restarts, open alerts.
Read from the database the console already keeps (one query per metric family, whatever the number of jobs)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from django.db.models import Count
from django.http import HttpRequest, HttpResponse

from dashboard.api.tokens import token_user
from dashboard.models import Alert, Recovery, Run, RunStatus
from dashboard.records import MEASURES
from dashboard.selectors.jobs import dead_letter_counts, job_list
from dashboard.selectors.lag import latest_source_lag, sources_unreachable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float | int) -> str:
    """A sample's value in full: an integer as it is, a float as Python's shortest round-trip form (``%g`` kept six
    digits, so a commit timestamp or a heap in bytes lost its last ones)."""
    number = float(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "+Inf" if number > 0 else "-Inf"
    if isinstance(value, int) or number.is_integer():
        return str(int(value))
    return repr(number)


def _family(name: str, kind: str, help_text: str, samples: Iterable[tuple[dict[str, Any], float | int | None]]) -> str:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        if value is None:
            continue
        text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        lines.append(f"{name}{{{text}}} {_number(value)}" if text else f"{name} {_number(value)}")
    return "\n".join(lines)


def render_metrics() -> str:
    jobs = list(job_list())
    restarts = dict(Recovery.objects.values("job_id").annotate(n=Count("id")).values_list("job_id", "n"))
    alerts = list(Alert.objects.filter(resolved_at__isnull=True).values("job__name", "kind").annotate(n=Count("id")))
    dead = dead_letter_counts(jobs)

    def per_job(get: Any) -> list[tuple[dict[str, Any], Any]]:
        return [({"job": j.name}, get(j, j.latest_checkpoint)) for j in jobs]

    source = latest_source_lag(jobs)
    unreachable = sources_unreachable(jobs)
    heaps: dict[int, tuple[int | None, int | None]] = {
        job_id: (held, most)
        for job_id, held, most in Run.objects.filter(status=RunStatus.RUNNING).values_list(
            "job_id", "heap_after_gc_bytes", "heap_max_bytes"
        )
    }

    def exported(measure: Any, j: Any, c: Any) -> float | None:
        if measure.column == "lag_records" and j.id in source:  # the source's own count: true while the job is down
            return source[j.id].lag_records
        value = getattr(c, measure.column) if c else None
        return value / 1000 if value is not None and measure.unit == "ms" else value

    families = [
        ("statekeeper_job_running", "gauge", "1 while a driver runs the job",
         per_job(lambda j, c: 1 if j.run_status == RunStatus.RUNNING else 0)),
        ("statekeeper_job_lag_seconds", "gauge", "lag in records over the processing rate, at the last checkpoint",
         per_job(lambda j, c: c.lag_records / c.processed_rate if c and c.lag_records is not None and c.processed_rate else None)),
        *[(m.metric, "gauge", m.metric_help, per_job(lambda j, c, m=m: exported(m, j, c))) for m in MEASURES if m.metric],
        ("statekeeper_checkpoint_last_batch_id", "gauge", "id of the last committed batch",
         per_job(lambda j, c: c.batch_id if c else None)),
        ("statekeeper_checkpoint_last_commit_timestamp_seconds", "gauge", "when the last batch was triggered",
         per_job(lambda j, c: c.committed_at.timestamp() if c else None)),
        ("statekeeper_job_lag_oldest_seconds", "gauge", "age of the oldest source entry not yet read (from the source)",
         per_job(lambda j, c: source[j.id].lag_seconds if j.id in source else None)),
        ("statekeeper_source_up", "gauge", "a Kafka job's source: 1 while its broker answers the console's lag sample, 0 while it does not (the lag shown is then the last sample's)",
         per_job(lambda j, c: (0 if j.id in unreachable else 1) if j.reads_kafka else None)),
        ("statekeeper_job_restarts_total", "counter", "automatic restarts after a failure",
         per_job(lambda j, c: restarts.get(j.id, 0))),
        ("statekeeper_job_dead_letters", "gauge", "entries in the job's dead-letter stream",
         per_job(lambda j, c: dead.get(j.id))),
        ("statekeeper_driver_heap_after_gc_bytes", "gauge", "the running driver JVM's heap after its latest garbage collection (a shared driver's for each of its jobs)",
         per_job(lambda j, c: heaps.get(j.id, (None, None))[0])),
        ("statekeeper_driver_heap_max_bytes", "gauge", "the running driver JVM's maximum heap",
         per_job(lambda j, c: heaps.get(j.id, (None, None))[1])),
        ("statekeeper_alerts_open", "gauge", "open alerts",
         [({"job": a["job__name"], "alert": a["kind"]}, a["n"]) for a in alerts]),
    ]  # fmt: skip
    return "\n".join(_family(*f) for f in families) + "\n"


def metrics(request: HttpRequest) -> HttpResponse:
    """For Prometheus: a bearer token (`manage.py create_token USER NAME`) or a logged-in session."""
    if not request.user.is_authenticated and token_user(request) is None:
        response = HttpResponse("Authentication needed: Authorization: Bearer <token>.\n", status=401)
        response["WWW-Authenticate"] = 'Bearer realm="statekeeper"'
        return response
    return HttpResponse(render_metrics(), content_type=CONTENT_TYPE)
