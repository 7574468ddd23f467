"""The JSON API, v1. Reads accept a bearer token or a logged-in session; writes accept a bearer token only (so a
browser session can never be ridden without CSRF). Roles are the console's; every write is in the audit trail.
Errors are JSON, {"error": "..."}, with the status that says what went wrong; never a trace."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from functools import wraps
from typing import Any

import redis
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count
from django.http import Http404, HttpRequest, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from dashboard import pipelines
from dashboard.access import ADMIN, OPERATOR, VIEWER, refusal
from dashboard.api.tokens import token_user
from dashboard.models import (
    ACTIVE_RUN_STATUSES,
    Action,
    ActionKind,
    Checkpoint,
    IdempotentRequest,
    Job,
    ResultRow,
    Run,
    Savepoint,
)  # fmt: skip
from dashboard.records import MEASURES
from dashboard.request_guard import Refused, strict_json
from dashboard.selectors.checkpoints import checkpoint_history, checkpoint_summary
from dashboard.selectors.cluster import free_cores_warning
from dashboard.selectors.dead_letters import dead_letter_page
from dashboard.selectors.jobs import job_list
from dashboard.selectors.secrets import SecretRow, secret_list, secret_row
from dashboard.services.actions import action_request
from dashboard.services.adoption import checkpoint_adopt, checkpoint_set_aside
from dashboard.services.audit import audit_record
from dashboard.services.blue_green import green_request, green_view, latest_blue_green
from dashboard.services.errors import ActionRefused
from dashboard.services.forks import rollback_preview, savepoint_preview
from dashboard.services.runs import checkpoint_unknown, job_request_start, job_request_stop, run_holds_process
from dashboard.services.secrets import SecretError, masked, readable, secret_delete, secret_set
from dashboard.services.upgrade_parts import (
    CHANGED_PERCENT_MOST,
    SHADOW_RECORDS_MOST,
    UpgradeRequestError,
    upgrade_request,
    upgrade_role_refusal,
)
from dashboard.specs import (
    SpecError,
    drift,
    etag,
    job_archive,
    job_create,
    job_free_name,
    job_update,
    plan_json,
    spec_of,
)
from dashboard.specs import plan as plan_specs

log = logging.getLogger(__name__)
MAX_LIMIT = 500
STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")  # a Redis stream entry's id


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error(status: int, message: str) -> JsonResponse:
    return JsonResponse({"error": message}, status=status)


def endpoint(
    methods: tuple[str, ...], role: str, writes: str = ""
) -> Callable[[Callable[..., Any]], Callable[..., JsonResponse]]:
    """Method check, authentication, role (``writes``: the role a method other than GET needs, where it differs), and
    JSON errors for one API view."""

    def decorate(view: Callable[..., Any]) -> Callable[..., JsonResponse]:
        @csrf_exempt
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> JsonResponse:
            if request.method not in methods:
                response = _error(405, f"{request.method} is not allowed here; use {', '.join(methods)}.")
                response["Allow"] = ", ".join(methods)
                return response
            user = token_user(request)
            if user is None and request.method == "GET" and request.user.is_authenticated:
                user = request.user
            if user is None:
                response = _error(401, "Authentication needed: Authorization: Bearer <token>.")
                response["WWW-Authenticate"] = 'Bearer realm="statekeeper"'
                return response
            request.user = user
            needed = writes if writes and request.method != "GET" else role
            if reason := refusal(user, needed) if needed != VIEWER else "":
                audit_record(
                    request, verb="denied", target=request.path, outcome="denied", message=reason, origin="api"
                )
                return _error(403, reason)
            try:
                result = view(request, *args, **kwargs)
            except ApiError as exc:
                return _error(exc.status, str(exc))
            except Http404 as exc:  # never Django's HTML page from the API
                return _error(404, str(exc) or "Not found.")
            return result if isinstance(result, JsonResponse) else JsonResponse(result, safe=False)

        return wrapped

    return decorate


def _job(name: str) -> Job:
    job = job_list().filter(name=name).first()
    if job is None:
        raise ApiError(404, f"No job named {name!r}.")
    return job


def _int(request: HttpRequest, name: str, default: int | None, low: int = 0, high: int = 2**62) -> int | None:
    raw = request.GET.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"{name} must be an integer, not {raw[:40]!r}.") from None
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be between {low} and {high}.")
    return value


def _stamp(moment: Any) -> str | None:
    return moment.isoformat() if moment else None


def checkpoint_json(c: Checkpoint) -> dict[str, Any]:
    """A checkpoint's identity and every measure stored with it (dashboard/records.py)."""
    return {
        "id": c.id,
        "batch_id": c.batch_id,
        "location": c.location,
        "committed_at": _stamp(c.committed_at),
        "kind": c.kind,
        "end_offset": c.end_offset,
        **{m.column: getattr(c, m.column) for m in MEASURES if m.column},
    }


def job_json(job: Job) -> dict[str, Any]:
    c = job.latest_checkpoint
    return {
        "name": job.name,
        "pipeline": job.pipeline,
        "parameters": job.parameters,
        "source_stream": job.source_stream,
        "state_backend": job.state_backend,
        "trigger_interval_seconds": job.trigger_interval_seconds,
        "parallelism": job.parallelism,
        "state_partitions": job.state_partitions,
        "status": getattr(job, "run_status", None) or "never-run",
        "checkpoint_dir": job.checkpoint_dir,
        "latest_checkpoint": checkpoint_json(c) if c else None,
        "open_alerts": getattr(job, "open_alerts", 0),
        "driver": _driver(job),
    }


def _driver(job: Job) -> dict[str, Any] | None:
    """The latest run's driver: its pid and host, and whether its process is still alive (a stopped job whose driver
    is still exiting cannot be restored or rolled back until it has)."""
    last = job.own_runs.order_by("-id").first()
    if last is None:
        return None
    shown = run_json(last)
    return {"run": last.id, **{k: shown[k] for k in ("pid", "host", "shared_driver", "process_alive")}}


def run_json(r: Run) -> dict[str, Any]:
    return {
        "id": r.id,
        "status": r.status,
        "requested_at": _stamp(r.requested_at),
        "started_at": _stamp(r.started_at),
        "ended_at": _stamp(r.ended_at),
        "message": r.message,
        "heap_after_gc_bytes": r.heap_after_gc_bytes,
        "heap_max_bytes": r.heap_max_bytes,
        "pid": r.pid,
        "host": r.host,
        "shared_driver": r.driver_host_id,
        # a run that has ended may keep its process for some seconds (a driver of its own drains and closes its JVM):
        # until it exits, nothing may touch the checkpoint. None: the process is on another host
        "process_alive": run_holds_process(r) if r.host in ("", settings.HOST_ID) else None,
    }


def savepoint_json(s: Savepoint) -> dict[str, Any]:
    return {
        "id": s.id,
        "status": s.status,
        "origin": s.origin,
        "batch_id": s.batch_id,
        "size_bytes": s.size_bytes,
        "duration_ms": s.duration_ms,
        "created_at": _stamp(s.created_at),
        "verified_at": _stamp(s.verified_at),
        "error": s.error,
    }


def action_json(a: Action) -> dict[str, Any]:
    return {
        "id": a.id,
        "job": a.job.name,
        "kind": a.kind,
        "status": a.status,
        "origin": a.origin,
        "params": a.params,
        "requested_at": _stamp(a.requested_at),
        "finished_at": _stamp(a.finished_at),
        "progress": a.progress,
        "outcome": a.outcome,
        "step": a.step,
        "phases": a.phase_rows,
        "proof": a.proof,
    }


@endpoint(("GET", "POST"), VIEWER, writes=ADMIN)
def jobs(request: HttpRequest) -> Any:
    """GET: every job. POST: create one from a spec (the job's settings, validated as the form validates them, and
    ``state``: ``running`` starts it)."""
    if request.method == "GET":
        return {"jobs": [job_json(j) for j in job_list().order_by("name")]}
    spec = _spec_body(request)
    try:
        created = job_create(spec)
    except SpecError as exc:
        audit_record(request, verb="job-create", job=str(spec.get("name", ""))[:63], params=_audited(spec),
                     outcome="refused", message=str(exc)[:500], origin="api")  # fmt: skip
        return JsonResponse({"error": str(exc), "problems": exc.problems}, status=400)
    audit_record(request, verb="job-create", job=created.name, params=_audited(spec), outcome="succeeded", origin="api")
    body: dict[str, Any] = {"job": _job_with_spec(created)}
    if spec.get("state", "running") == "running":
        body["run"] = run_json(job_request_start(job=created, requested_by=request.user))
        audit_record(request, verb="start", job=created.name, target=f"run #{body['run']['id']}",
                     outcome="requested", origin="api")  # fmt: skip
    response = JsonResponse(body, status=201)
    response["ETag"], response["Location"] = etag(created), f"/api/v1/jobs/{created.name}"
    return response


@endpoint(("GET", "PATCH", "DELETE"), VIEWER, writes=ADMIN)
def job(request: HttpRequest, name: str) -> Any:
    """GET: the job, its spec and ETag, and any drift from the spec last applied. PATCH: change settings, with
    ``If-Match: <ETag>`` (412 when the job changed since). DELETE: archive it: stop with a savepoint if it runs, keep
    its state and history, list it no more; ``?free_name=true`` on an archived, stopped job frees its name (the job is
    renamed, its directory moving with it)."""
    if request.method == "DELETE" and request.GET.get("free_name") == "true":
        return _free_name(request, name)
    found = _job(name)
    if request.method == "PATCH":
        return _patch(request, found)
    if request.method == "DELETE":
        return _archive(request, found)
    response = JsonResponse(_job_with_spec(found) | {"summary": _summary(found)})
    response["ETag"] = etag(found)
    return response


def _job_with_spec(job: Job) -> dict[str, Any]:
    return job_json(job) | {
        "spec": _plain(spec_of(job)), "etag": etag(job), "drift": drift(job), "unknown_checkpoint": checkpoint_unknown(job),
    }  # fmt: skip


def _plain(values: Any) -> Any:
    return json.loads(json.dumps(values, default=str))


def _audited(spec: dict[str, Any], pipeline: str = "") -> Any:
    """A request's body as the audit trail keeps it: no password, no value of a parameter declared secret."""
    return masked(_plain(spec), str(spec.get("pipeline") or pipeline))


def _spec_body(request: HttpRequest) -> dict[str, Any]:
    return _json_object(request, "The body must be a JSON object: the job's spec.")


def _json_object(request: HttpRequest, what: str = "The body must be a JSON object.") -> dict[str, Any]:
    """The request's JSON body (none: an empty object); 400 with ``what`` when it is not an object."""
    try:
        data = strict_json(request.body or b"{}")
    except Refused as exc:
        raise ApiError(exc.status, str(exc)) from None
    if not isinstance(data, dict):
        raise ApiError(400, what)
    return data


def _patch(request: HttpRequest, job: Job) -> JsonResponse:
    given = request.headers.get("If-Match", "")
    if not given:
        return _error(428, f"Send If-Match with the job's ETag (GET /api/v1/jobs/{job.name} gives it).")
    spec = _spec_body(request)
    if "name" in spec and spec["name"] != job.name:
        return _error(400, "name cannot change: it locates the checkpoint directory.")
    extra = sorted(set(spec) & {"state", "upgrade_mode", "package"})
    if extra:
        return _error(400, f"{', '.join(extra)}: a plan applies these (statekeeper apply); PATCH changes settings.")
    try:
        with transaction.atomic():
            locked = Job.objects.select_for_update().get(id=job.id)
            if given.strip() not in (etag(locked), "*"):
                return _error(412, f"{job.name} changed since that ETag: GET it again (now {etag(locked)}).")
            updated = job_update(locked, spec)
    except SpecError as exc:
        audit_record(request, verb="job-edit", job=job.name, params=_audited(spec, job.pipeline), outcome="refused",
                     message=str(exc)[:500], origin="api")  # fmt: skip
        return JsonResponse({"error": str(exc), "problems": exc.problems}, status=400)
    audit_record(
        request, verb="job-edit", job=job.name, params=_audited(spec, job.pipeline), outcome="succeeded", origin="api"
    )
    response = JsonResponse({"job": _job_with_spec(updated)})
    response["ETag"] = etag(updated)
    return response


def _archive(request: HttpRequest, job: Job) -> JsonResponse:
    body: dict[str, Any] = {}
    if job.runs.filter(status__in=ACTIVE_RUN_STATUSES).exists():
        try:
            stopping = action_request(job=job, kind=ActionKind.STOP_WITH_SAVEPOINT, params={},
                                      requested_by=request.user, origin="api")  # fmt: skip
        except ActionRefused as exc:
            audit_record(request, verb="job-archive", job=job.name, outcome="refused", message=str(exc), origin="api")
            return _error(409, str(exc))
        stopping.job = job
        body["action"] = action_json(stopping)
    job_archive(job)
    audit_record(request, verb="job-archive", job=job.name, outcome="succeeded", origin="api")
    body["archived"] = job.name
    return JsonResponse(body, status=202 if "action" in body else 200)


def _free_name(request: HttpRequest, name: str) -> JsonResponse:
    archived = Job.objects.filter(name=name).first()
    if archived is None:
        raise ApiError(404, f"No job named {name!r}.")
    try:
        renamed = job_free_name(archived)
    except SpecError as exc:
        audit_record(request, verb="job-free-name", job=name, outcome="refused", message=str(exc), origin="api")
        return _error(409, str(exc))
    audit_record(request, verb="job-free-name", job=name, target=renamed, outcome="succeeded", origin="api")
    return JsonResponse({"freed": name, "archived_as": renamed})


@endpoint(("POST",), VIEWER)
def plan(request: HttpRequest) -> Any:
    """What applying these specs would do, job by job; changes nothing. Body: {"jobs": [spec, ...], "prune": bool}."""
    data = _spec_body(request)
    specs, prune = data.get("jobs"), data.get("prune", False)
    if not isinstance(specs, list) or not all(isinstance(s, dict) for s in specs) or len(specs) > 500:
        raise ApiError(400, "jobs must be a list of at most 500 specs (objects).")
    if not isinstance(prune, bool):
        raise ApiError(400, "prune must be true or false.")
    names = [str(s.get("name", "")) for s in specs]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ApiError(400, f"Two specs name the job {twice[0]!r}.")
    return {"jobs": _plain(plan_json(plan_specs(specs, prune)))}


def _summary(job: Job) -> dict[str, Any]:
    """Min, avg, p50, p90, p99 and max of each checkpoint measure over the last checkpoints."""
    count, rows = checkpoint_summary(job=job)
    return {"checkpoints": count, "rows": [{"measure": r.label, "unit": r.unit, **r.values} for r in rows]}


@endpoint(("GET",), VIEWER)
def runs(request: HttpRequest, name: str) -> Any:
    limit = _int(request, "limit", 20, 1, MAX_LIMIT)
    return {"runs": [run_json(r) for r in _job(name).runs.all()[:limit]]}


@endpoint(("GET",), VIEWER)
def checkpoints(request: HttpRequest, name: str) -> Any:
    found = _job(name)
    limit = _int(request, "limit", 50, 1, MAX_LIMIT) or 50
    before = _int(request, "before", None, 1)
    page = checkpoint_history(job=found, before=before, per_page=limit)
    if before is not None and page.newest:
        raise ApiError(404, f"No checkpoint {before} in {name}.")
    body: dict[str, Any] = {"checkpoints": [checkpoint_json(c) for c in page.rows], "next_before": page.older}
    if before is None:  # the first page carries the summary of the last checkpoints, as the console's page does
        body["summary"] = _summary(found)
    return body


@endpoint(("GET",), VIEWER)
def results(request: HttpRequest, name: str) -> Any:
    """The job's results table, one view at a time, in key order: ``?view=<kind>`` (without it: the views and how many
    rows each holds), ``limit``, and ``after=<key>`` for the next page (``next_after`` of the last)."""
    found = _job(name)
    view, after = request.GET.get("view", ""), request.GET.get("after", "")
    if "\x00" in view + after:
        raise ApiError(400, "view and after are text without NUL characters.")
    if not view:
        counts = ResultRow.objects.filter(job=found).values("kind").annotate(rows=Count("id")).order_by("kind")
        pipeline = pipelines.find(found.pipeline)
        return {
            "views": [
                {"view": c["kind"], "rows": c["rows"], "kept": asdict(pipelines.result_bound(pipeline, c["kind"]))}
                for c in counts
            ]
        }
    limit = _int(request, "limit", 100, 1, MAX_LIMIT) or 100
    rows = ResultRow.objects.filter(job=found, kind=view[:40]).order_by("key")
    if after:
        rows = rows.filter(key__gt=after[:500])
    page = list(rows[: limit + 1])
    shown = [
        {"key": r.key, "value": r.value, "batch_id": r.batch_id, "updated_at": _stamp(r.updated_at)}
        for r in page[:limit]
    ]
    return {"view": view, "results": shown, "next_after": page[limit - 1].key if len(page) > limit else None}


@endpoint(("GET",), VIEWER)
def dead_letters(request: HttpRequest, name: str) -> Any:
    """The job's dead letters, newest first: each with the entry it came from, the stage and the reason (the path in
    the event that is wrong), and its payload as sent; ``before=<id>`` (``next_before`` of the last page) for older."""
    found = _job(name)
    before = request.GET.get("before") or None
    if before is not None and not STREAM_ID.fullmatch(before):
        raise ApiError(400, "before is a dead letter's id (such as 1700000000000-0).")
    limit = _int(request, "limit", 50, 1, MAX_LIMIT) or 50
    try:
        page = dead_letter_page(found, before=before, per_page=limit)
    except redis.RedisError as exc:
        raise ApiError(503, f"Redis cannot be read now ({exc}); try again.") from None
    return {
        "dead_letters": [letter.as_json() for letter in page.letters],
        "total": page.total,
        "next_before": page.older,
        "redrive": f"POST /api/v1/jobs/{found.name}/redrive-dead-letters with ids (or all: 1) once the cause is fixed",
    }


@endpoint(("GET",), VIEWER)
def savepoints(request: HttpRequest, name: str) -> Any:
    return {"savepoints": [savepoint_json(s) for s in _job(name).savepoints.all()[:MAX_LIMIT]]}


@endpoint(("GET",), VIEWER)
def actions(request: HttpRequest, name: str) -> Any:
    limit = _int(request, "limit", 20, 1, MAX_LIMIT)
    return {"actions": [action_json(a) for a in _job(name).actions.select_related("job")[:limit]]}


@csrf_exempt
def not_found(request: HttpRequest) -> JsonResponse:
    return _error(404, f"No API endpoint at {request.path}; see /api/openapi.json.")


@endpoint(("GET",), VIEWER)
def action(request: HttpRequest, action_id: int) -> Any:
    found = Action.objects.select_related("job").filter(id=action_id).first()
    if found is None:
        raise ApiError(404, f"No action {action_id}.")
    return action_json(found)


IDEMPOTENCY_HOURS = 24

# what each write takes in its JSON body: name -> (type, minimum, maximum, required)
BODIES: dict[str, dict[str, tuple[type, int, int, bool]]] = {
    "start": {},
    "stop": {},
    ActionKind.SAVEPOINT: {},
    ActionKind.STOP_WITH_SAVEPOINT: {},
    ActionKind.RESTORE: {"savepoint": (int, 1, 2**62, True)},
    ActionKind.ROLLBACK: {"batch": (int, 0, 2**62, True)},
    # from_spec: 1 when `statekeeper apply` asks, so that the settings it makes become the job's applied spec
    ActionKind.RESCALE: {
        "parallelism": (int, 1, 64, False),
        "state_partitions": (int, 1, 1024, False),
        "from_spec": (int, 0, 1, False),
    },  # fmt: skip
    # a string's bounds are its length
    # an object's bounds are its number of keys: the pipeline's parameter values, checked against what it declares
    ActionKind.UPGRADE_PREVIEW: {
        "pipeline": (str, 1, 40, True),
        "parameters": (dict, 0, 100, False),
        "migrate": (int, 0, 1, False),  # also run the target's state migration and its first batch on it
    },  # fmt: skip
    ActionKind.UPGRADE_SHADOW: {
        "pipeline": (str, 1, 40, True),
        "records": (int, 1, SHADOW_RECORDS_MOST, False),
        "parameters": (dict, 0, 100, False),
    },  # fmt: skip
    ActionKind.UPGRADE: {
        "pipeline": (str, 1, 40, True),
        "empty_state": (int, 0, 1, False),
        "migrate": (int, 0, 1, False),  # build the new version's state with its declared migration
        "parameters": (dict, 0, 100, False),
        "from_spec": (int, 0, 1, False),
    },  # fmt: skip
    ActionKind.BLUE_GREEN: {
        "pipeline": (str, 1, 40, False),  # the job's own when not given: new parameter values or state partitions
        "parameters": (dict, 0, 100, False),
        "state_partitions": (int, 1, 1024, False),  # a rescale: green starts on a repartitioned fork
        "migrate": (int, 0, 1, False),  # green starts on the state the target's migration builds
        "auto": (int, 0, 1, False),  # hand over by itself once green is caught up and passes the rules
        "no_removed": (int, 0, 1, False),  # a rule: no row of the job's missing from green's output
        "max_changed_percent": (int, 0, CHANGED_PERCENT_MOST, False),  # a rule: at most this share of rows changed
        "from_spec": (int, 0, 1, False),
    },  # fmt: skip
    ActionKind.UPGRADE_ROLLBACK: {"upgrade": (int, 1, 2**62, True)},
    # a list's bounds are its number of items: dead-letter ids (each a Redis stream id), or all: 1 for every one
    ActionKind.REDRIVE_DEAD_LETTERS: {"ids": (list, 1, 10_000, False), "all": (int, 0, 1, False)},
}


def _body(request: HttpRequest, verb: str) -> dict[str, Any]:
    data = _json_object(request)
    spec = BODIES[verb]
    unknown = sorted(set(data) - set(spec))
    if unknown:
        raise ApiError(400, f"Unknown field(s): {', '.join(map(str, unknown))[:200]}.")
    clean = {}
    for field, (kind, low, high, required) in spec.items():
        if field not in data:
            if required:
                raise ApiError(400, f"{field} is required.")
            continue
        value = data[field]
        if kind is str:
            if not isinstance(value, str) or not low <= len(value) <= high:
                raise ApiError(400, f"{field} must be a string of {low} to {high} characters.")
        elif kind is dict:
            if not isinstance(value, dict) or not low <= len(value) <= high:
                raise ApiError(400, f"{field} must be an object of at most {high} names.")
        elif kind is list:
            if (
                not isinstance(value, list) or not low <= len(value) <= high
                or not all(isinstance(v, str) and STREAM_ID.fullmatch(v) for v in value)
            ):  # fmt: skip
                raise ApiError(400, f"{field} must be a list of {low} to {high} entry ids (such as 1700000000000-0).")
        elif not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ApiError(400, f"{field} must be an integer from {low} to {high}.")
        clean[field] = value
    if verb == ActionKind.RESCALE and not set(clean) - {"from_spec"}:
        raise ApiError(400, "Give parallelism, state_partitions or both.")
    if verb == ActionKind.BLUE_GREEN and not {"pipeline", "parameters", "state_partitions"} & set(clean):
        raise ApiError(400, "Give what changes: pipeline, parameters, state_partitions, or more than one.")
    if verb == ActionKind.REDRIVE_DEAD_LETTERS:
        if bool(clean.get("ids")) == bool(clean.get("all")):
            raise ApiError(400, "Give the dead letters' ids, or all: 1 for every one.")
        clean = {"all": True} if clean.get("all") else {"ids": clean["ids"]}
    return clean


def _act(request: HttpRequest, name: str, verb: str) -> JsonResponse:
    key = request.headers.get("Idempotency-Key", "")
    if len(key) > 200:
        raise ApiError(400, "Idempotency-Key is at most 200 characters.")
    found = _job(name)
    params = _body(request, verb)
    if verb == ActionKind.BLUE_GREEN:
        params.setdefault("pipeline", found.pipeline)
    if verb in (ActionKind.UPGRADE, ActionKind.BLUE_GREEN) and (
        denied := upgrade_role_refusal(request.user, found, params["pipeline"], params.get("parameters"))
    ):
        audit_record(request, verb="denied", job=found.name, target=request.path, params=_audited(params, found.pipeline), outcome="denied",
                     message=denied, origin="api")  # fmt: skip
        return _error(403, denied)
    fingerprint = hashlib.sha256(request.body or b"").hexdigest()
    user_id = int(request.user.pk or 0)
    if key:
        # a key is kept IDEMPOTENCY_HOURS: after that the same key is a new request
        IdempotentRequest.objects.filter(
            user_id=user_id, key=key, created_at__lt=timezone.now() - timedelta(hours=IDEMPOTENCY_HOURS)
        ).delete()
        try:
            with transaction.atomic():
                IdempotentRequest.objects.create(
                    key=key, user_id=user_id, method="POST", path=request.path, body_hash=fingerprint,
                    status=0, response={},
                )  # fmt: skip
        except IntegrityError:
            first = IdempotentRequest.objects.get(user_id=user_id, key=key)
            if (first.path, first.body_hash) != (request.path, fingerprint):
                raise ApiError(422, "This Idempotency-Key was used for a different request.") from None
            if first.status == 0:
                raise ApiError(409, "A request with this Idempotency-Key is still being handled.") from None
            replay = JsonResponse(first.response, status=first.status)
            replay["Idempotent-Replayed"] = "true"
            return replay
    try:
        status, body = _perform(request, found, verb, params)
    except BaseException:
        # it did not act: a retry with the same key must be tried again, not answered 409 for good
        if key:
            IdempotentRequest.objects.filter(user_id=user_id, key=key, status=0).delete()
        raise
    if key:
        IdempotentRequest.objects.filter(user_id=user_id, key=key).update(status=status, response=body)
    return JsonResponse(body, status=status)


def _perform(request: HttpRequest, job: Job, verb: str, params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    try:
        if verb == "start":
            run = job_request_start(job=job, requested_by=request.user, refuse_during_action=True)
            body: dict[str, Any] = {"run": run_json(run)}
            target = f"run #{run.id}"
            if warning := free_cores_warning(job):  # on a cluster short of cores it would sit starting
                body["warning"] = warning
        elif verb == "stop":
            run = job_request_stop(job=job)
            body, target = {"run": run_json(run)}, f"run #{run.id}"
        else:
            _check_preview(job, verb, params)
            done = action_request(job=job, kind=verb, params=params, requested_by=request.user, origin="api")
            done.job = job
            body, target = {"action": action_json(done)}, f"action #{done.id}"
    except ActionRefused as exc:
        audit_record(request, verb=verb, job=job.name, params=_audited(params, job.pipeline), outcome="refused",
                     message=str(exc), origin="api")  # fmt: skip
        return 409, {"error": str(exc)}
    audit_record(request, verb=verb, job=job.name, target=target, params=_audited(params, job.pipeline),
                 outcome="requested", origin="api")  # fmt: skip
    return 202, body


def _check_preview(job: Job, verb: str, params: dict[str, Any]) -> None:
    """Restore, rollback and upgrade are refused up front, with the preview's reason, as in the console."""
    if verb == ActionKind.RESTORE:
        chosen = job.savepoints.filter(id=params["savepoint"]).first()
        if chosen is None:
            raise ApiError(404, f"No savepoint {params['savepoint']} of {job.name}.")
        if refused := savepoint_preview(job, chosen).refusal:
            raise ActionRefused(refused)
    elif verb == ActionKind.ROLLBACK and (refused := rollback_preview(job, params["batch"]).refusal):
        raise ActionRefused(refused)
    elif verb in UPGRADE_KINDS:
        try:
            params.update(upgrade_request(job, verb, params))
        except UpgradeRequestError as exc:
            if exc.malformed:
                raise ApiError(400, str(exc)) from None
            raise ActionRefused(str(exc)) from None


UPGRADE_KINDS = (ActionKind.UPGRADE, ActionKind.UPGRADE_PREVIEW, ActionKind.UPGRADE_SHADOW, ActionKind.BLUE_GREEN)


def _writer(verb: str) -> Callable[..., JsonResponse]:
    @endpoint(("POST",), OPERATOR)
    def view(request: HttpRequest, name: str) -> JsonResponse:
        return _act(request, name, verb)

    view.__name__ = f"api_{verb.replace('-', '_')}"
    return view


start = _writer("start")
stop = _writer("stop")
savepoint = _writer(ActionKind.SAVEPOINT)
stop_with_savepoint = _writer(ActionKind.STOP_WITH_SAVEPOINT)
restore = _writer(ActionKind.RESTORE)
rollback = _writer(ActionKind.ROLLBACK)
rescale = _writer(ActionKind.RESCALE)
upgrade_preview = _writer(ActionKind.UPGRADE_PREVIEW)
upgrade = _writer(ActionKind.UPGRADE)
upgrade_shadow = _writer(ActionKind.UPGRADE_SHADOW)
upgrade_rollback = _writer(ActionKind.UPGRADE_ROLLBACK)
blue_green = _writer(ActionKind.BLUE_GREEN)


def _blue_green_of(name: str) -> tuple[Job, Action]:
    """The job and its latest blue/green upgrade; 404 when it has none."""
    found = _job(name)
    action = latest_blue_green(found)
    if action is None:
        raise ApiError(404, f"{found.name} has no blue/green upgrade.")
    return found, action


@endpoint(("GET",), VIEWER)
def blue_green_state(request: HttpRequest, name: str) -> Any:
    """The job's latest blue/green upgrade: where green is beside the job, and its per-batch diff."""
    return green_view(_blue_green_of(name)[1])


def _green_writer(what: str) -> Callable[..., JsonResponse]:
    @endpoint(("POST",), OPERATOR)
    def view(request: HttpRequest, name: str) -> Any:
        found, action = _blue_green_of(name)
        try:
            up = green_request(action, what)
        except ActionRefused as exc:
            raise ApiError(409, str(exc)) from None
        audit_record(request, verb=f"blue-green-{what}", job=found.name, target=f"action #{action.id}",
                     outcome="requested", origin="api")  # fmt: skip
        # asked before the new version is up, it is kept and done once green follows the job (green_up: false)
        return {"action": action.id, "requested": what, "green_up": up}

    view.__name__ = f"api_blue_green_{what}"
    return view


blue_green_promote = _green_writer("promote")
blue_green_abort = _green_writer("abort")
redrive_dead_letters = _writer(ActionKind.REDRIVE_DEAD_LETTERS)


def secret_json(row: Any) -> dict[str, Any]:
    """A secret as the API shows it: never its value."""
    s = row.secret
    return {
        "name": s.name,
        "version": s.version,
        "created_at": _stamp(s.created_at),
        "created_by": s.created_by,
        "rotated_at": _stamp(s.rotated_at),
        "rotated_by": s.rotated_by,
        "jobs": row.jobs,
        "pending_restart": row.stale,
        # false: no current key of STATEKEEPER_SECRETS_KEY decrypts it; a driver naming it would fail to start
        "readable": readable(s),
    }


@endpoint(("GET",), VIEWER)
def secrets(request: HttpRequest) -> Any:
    """Every secret's name, version and the jobs that name it; never a value."""
    return {"secrets": [secret_json(row) for row in secret_list()]}


@endpoint(("GET", "PUT", "DELETE"), VIEWER, writes=ADMIN)
def secret(request: HttpRequest, name: str) -> Any:
    """GET: the secret's name and version. PUT {"value": "..."}: set it (201) or rotate it (200), admin only; a
    rotation reaches a running job at its next start or upgrade. DELETE: remove one no job names."""
    if request.method == "DELETE":
        try:
            secret_delete(name=name)
        except SecretError as exc:
            audit_record(request, verb="secret-delete", target=name, outcome="refused", message=str(exc), origin="api")
            return _error(409 if "still name" in str(exc) else 404, str(exc))
        audit_record(request, verb="secret-delete", target=name, outcome="succeeded", origin="api")
        return {"deleted": name}
    if request.method == "PUT":
        data = _json_object(request)
        if set(data) != {"value"}:
            raise ApiError(400, 'The body is {"value": "..."}: the secret\'s value, and nothing else.')
        try:
            saved, created = secret_set(name=name, value=data["value"], username=request.user.get_username())
        except SecretError as exc:
            audit_record(request, verb="secret-set", target=name[:100], outcome="refused", message=str(exc),
                         origin="api")  # fmt: skip
            raise ApiError(400, str(exc)) from None
        audit_record(request, verb="secret-set" if created else "secret-rotate", target=name, outcome="succeeded",
                     origin="api")  # fmt: skip
        row = secret_row(name) or SecretRow(saved)  # deleted in between: no job to name
        body: dict[str, Any] = {"secret": secret_json(row)}
        if not created and row.stale:
            body["note"] = f"Rotated: {', '.join(row.stale)} take the new value at their next start or upgrade."
        return JsonResponse(body, status=201 if created else 200)
    found = secret_row(name)
    if found is None:
        raise ApiError(404, f"No secret named {name!r}.")
    return {"secret": secret_json(found)}


@endpoint(("POST",), OPERATOR)
def checkpoint_decision(request: HttpRequest, name: str) -> Any:
    """POST {"decision": "adopt" | "set-aside"}: for a job whose directory holds a checkpoint this console never
    recorded (its start is refused with that reason, and the job's ``unknown_checkpoint`` says it): adopt it, its
    history imported run by run from its journals, or set it aside and start from nothing."""
    found = _job(name)
    data = _json_object(request)
    decision = data.get("decision")
    if set(data) != {"decision"} or decision not in ("adopt", "set-aside"):
        raise ApiError(400, 'The body is {"decision": "adopt"} or {"decision": "set-aside"}.')
    try:
        done = checkpoint_adopt(found) if decision == "adopt" else checkpoint_set_aside(found)
    except ActionRefused as exc:
        audit_record(request, verb=f"checkpoint-{decision}", job=found.name, outcome="refused", message=str(exc),
                     origin="api")  # fmt: skip
        return _error(409, str(exc))
    audit_record(
        request, verb=f"checkpoint-{decision}", job=found.name, outcome="succeeded", message=done, origin="api"
    )
    return {"outcome": done}
