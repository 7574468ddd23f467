"""Jobs as code: a job's spec (the settings a team keeps in its repository), its ETag, creating and changing a job from
one exactly as the form does, archiving, drift, and the plan that says what applying a set of specs would do.

A spec is flat: the job's settings by their field names, plus ``state`` (``running`` or ``suspended``), the
``upgrade_mode`` (``savepoint``: an upgrade keeps the state, and an incompatible change is refused; ``stateless``:
an incompatible change starts from empty state; ``migrate``: the new version's state is built by the migration it
declares from the job's pipeline; ``blue-green``) and, optionally, the ``package`` the pipeline must come from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from django import forms
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import transaction
from django.utils import timezone
from redis.exceptions import RedisError

from dashboard import pipelines
from dashboard.connections import redis_client
from dashboard.forms import JobForm
from dashboard.models import ACTIVE_RUN_STATUSES, Job
from dashboard.selectors.cluster import free_cores_warning
from dashboard.services.upgrade_parts import migration_refusal

# settings of the job form, and the policies set elsewhere in the console
POLICY_FIELDS = (
    "savepoint_interval_minutes", "savepoints_max_count", "savepoints_max_age_hours", "restart_strategy",
    "restart_delay_seconds", "restart_max_delay_seconds", "failure_rate_max", "failure_rate_window_minutes",
)  # fmt: skip
SETTINGS = (*JobForm.Meta.fields, *POLICY_FIELDS)
SCALE = ("parallelism", "state_partitions")
CODE = ("pipeline", "parameters")
MAPPINGS = ("parameters", "source_security")  # the settings a spec gives as a mapping of name to value
STATES = ("running", "suspended")
UPGRADE_MODES = ("savepoint", "last-state", "stateless", "migrate", "blue-green")
EXTRA = ("state", "upgrade_mode", "package")


class SpecError(ValueError):
    """A spec that cannot be applied: one problem per entry of ``problems`` (field: reason)."""

    def __init__(self, problems: dict[str, list[str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in problems.items()))


class SpecForm(JobForm):
    """The job form with the savepoint and restart policies: a spec is validated exactly as the form validates."""

    class Meta(JobForm.Meta):
        fields = list(SETTINGS)

    OPTIONAL = (*JobForm.OPTIONAL, *POLICY_FIELDS, "batches_retained", "max_records_per_batch", "memory_budget_mb",
                "disk_budget_gb", "autoscale_mode", "autoscale_max_per_day", "autoscale_window_minutes",
                "trigger_interval_seconds", "state_partitions", "parallelism", "state_backend")  # fmt: skip


EXTRA_REFERENCE = {
    "state": ("`running` or `suspended`", "`running`", "what `apply` makes of the job: started (it resumes from its "
              "checkpoint), or stopped with a savepoint"),
    "upgrade_mode": (f"one of {', '.join(f'`{m}`' for m in UPGRADE_MODES)}", "`savepoint`",
                     "how `apply` upgrades a job with state: keeping it (an incompatible change is refused), "
                     "`stateless`: an incompatible change starts from empty state, `migrate`: the new version's "
                     "state is built from the job's by the migration it declares (previewed, then applied from a "
                     "savepoint), or `blue-green`: a running job's new version runs beside it and takes over at a "
                     "committed batch, its output never stopped"),
    "package": ("text: `<distribution> <version>`, as the Deploys tab shows it", "—",
                "the installed package the pipeline must come from (`statekeeper-example-team-orders 1.0.0`); the "
                "spec is refused when the console has another"),
}  # fmt: skip


def _kind(name: str, field: Any, model: Any) -> str:
    """A form field's type and bounds in words (the bounds the model's validators and the form's field set)."""
    if name == "pipeline":
        return "a registered pipeline's name"
    if name == "parameters":
        return "a mapping: the pipeline's parameter names to values (`${secret:NAME}` for a secret)"
    if name == "source_security":
        return "a mapping: `security_protocol`, `sasl_mechanism`, `sasl_username`, `sasl_password` (`${secret:NAME}`), `ssl_ca_file`, `ssl_check_hostname`"
    if choices := getattr(field, "choices", None):
        return "one of " + ", ".join(f"`{value}`" for value, _ in choices if value != "")
    if isinstance(field, forms.BooleanField):
        return "`true` or `false`"
    if isinstance(field, forms.IntegerField):  # FloatField is one too
        lows = [v.limit_value for v in model.validators if isinstance(v, MinValueValidator)] + [field.min_value]
        highs = [v.limit_value for v in model.validators if isinstance(v, MaxValueValidator)] + [field.max_value]
        low = max((v for v in lows if v is not None), default=None)
        high = min((v for v in highs if v is not None), default=None)
        noun = "a number" if isinstance(field, forms.FloatField) else "a whole number"

        def number(value: float) -> str:
            return f"{value:,}" if float(value).is_integer() else f"{value:g}"

        if low is not None and high is not None:
            return f"{noun} from {number(low)} to {number(high)}"
        return f"{noun}, at least {number(low)}" if low is not None else noun
    if isinstance(field, forms.CharField) and field.max_length:
        return f"text of at most {field.max_length} characters"
    return "text"


def spec_reference() -> str:
    """The keys of a spec, from the form that validates it (``manage.py spec_reference`` writes docs/specs.md)."""
    form = SpecForm(instance=Job())
    rows = []
    for name in SETTINGS:
        field = form.fields[name]
        model: Any = Job._meta.get_field(name)
        default = model.default if model.has_default() and not callable(model.default) else None
        shown = "required" if field.required else "—" if default in (None, "") else f"`{json.dumps(default)}`"
        what = str(model.help_text or field.help_text or field.label or "").replace("|", "/")
        rows.append(f"| `{name}` | {_kind(name, field, model)} | {shown} | {what} |")
    rows += [f"| `{name}` | {kind} | {default} | {what} |" for name, (kind, default, what) in EXTRA_REFERENCE.items()]
    return "\n".join([
        "# Job spec reference",
        "",
        "Generated from the form that validates a spec (`./manage.py spec_reference > docs/specs.md`); a test fails when",
        "it differs from the form. A spec is one YAML or TOML file per job (README: Jobs as code). A key left out keeps",
        "the job's value, or the default for a new job; an unknown key is refused by name.",
        "",
        "| key | value | default | what it is |",
        "|---|---|---|---|",
        *rows,
        "",
    ])  # fmt: skip


def _settings(job: Job) -> dict[str, Any]:
    return {name: getattr(job, name) for name in SETTINGS} | {
        "parameters": dict(job.parameters or {}), "source_security": dict(job.source_security or {}),
    }  # fmt: skip


def spec_of(job: Job) -> dict[str, Any]:
    """The job's settings as a spec holds them, with the state it is in."""
    running = job.runs.filter(status__in=ACTIVE_RUN_STATUSES).exists()
    return _settings(job) | {"state": "running" if running else "suspended"}


def etag(job: Job) -> str:
    """A strong validator of the job's settings: it changes whenever one does (not with its runs)."""
    return '"' + hashlib.sha256(json.dumps(_settings(job), sort_keys=True, default=str).encode()).hexdigest()[:32] + '"'


BOOLEANS = ("standby", "real_time")  # a spec's true or false, as a checkbox posts it


def _form_data(spec: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for name, value in spec.items():
        if name in MAPPINGS:
            if not isinstance(value, dict):
                raise SpecError({name: ["must be a mapping of name to value"]})
            data[name] = pipelines.format_parameters(value) if name == "parameters" else json.dumps(value)
        elif name in BOOLEANS:
            if not isinstance(value, bool):
                raise SpecError({name: ["must be true or false"]})
            if value:
                data[name] = "on"
        elif isinstance(value, (dict, list)):
            raise SpecError({name: ["must be a single value"]})
        elif value is not None:
            data[name] = str(value)
    return data


def checked(spec: dict[str, Any], job: Job | None = None) -> SpecForm:
    """The spec validated as the form validates it (on ``job``: an edit, the fields it leaves out kept); SpecError
    with every problem otherwise."""
    if not isinstance(spec, dict):
        raise SpecError({"spec": ["must be a mapping"]})
    problems = shape_problems(spec, job)
    if any(p == ["is not a setting of a job"] for p in problems.values()):
        raise SpecError(problems)  # unknown keys: nothing else is read
    merged = (_settings(job) if job else {}) | {k: v for k, v in spec.items() if k not in EXTRA}
    form = SpecForm(_form_data(merged), instance=job or Job())
    if not form.is_valid():
        for name, errors in form.errors.items():
            problems.setdefault(name if name != "__all__" else "spec", []).extend(str(e) for e in errors)
    if problems:
        raise SpecError(problems)
    return form


def shape_problems(spec: dict[str, Any], job: Job | None = None) -> dict[str, list[str]]:
    """What a spec says that the console does not know, whether it creates ``job`` or changes it: unknown keys, a
    state or upgrade mode it does not have, a package the console does not run, a pipeline that is not registered,
    parameters that are not a mapping, a scale that is not a whole number. The form checks the settings' values."""
    if unknown := sorted(set(spec) - set(SETTINGS) - set(EXTRA)):
        return {name: ["is not a setting of a job"] for name in unknown[:20]}
    problems: dict[str, list[str]] = {}
    if spec.get("state", "running") not in STATES:
        problems["state"] = [f"is running or suspended, not {spec.get('state')!r}"]
    if spec.get("upgrade_mode", "savepoint") not in UPGRADE_MODES:
        problems["upgrade_mode"] = [f"is one of {', '.join(UPGRADE_MODES)}, not {spec.get('upgrade_mode')!r}"]
    if "pipeline" in spec and not (isinstance(spec["pipeline"], str) and pipelines.find(spec["pipeline"])):
        problems["pipeline"] = [f"names no registered pipeline: {spec['pipeline']!r}"]
    for name in MAPPINGS:
        if name in spec and not isinstance(spec[name], dict):
            problems[name] = ["must be a mapping of name to value"]
    for name in SCALE:
        if name in spec and not _whole(spec[name]):
            problems[name] = [f"a whole number, not {spec[name]!r}"]
    if (package := spec.get("package")) is not None:
        found = _package(str(spec.get("pipeline") or (job.pipeline if job else "")))
        if found != package:
            problems["package"] = [f"asks for {package!r}; the console has {found or 'no such pipeline'!r}"]
    return problems


def _package(pipeline: str) -> str:
    try:
        return pipelines.code_version(pipeline).package
    except Exception:
        return ""


def job_create(spec: dict[str, Any]) -> Job:
    with transaction.atomic():
        job = checked(spec).save()
        Job.objects.filter(id=job.id).update(applied_spec=spec)
    job.refresh_from_db()
    return job


def job_update(job: Job, spec: dict[str, Any]) -> Job:
    """Change the job's settings (the fields ``spec`` names); refused as the form refuses, e.g. a parameter change of
    a job with state, which is an upgrade."""
    with transaction.atomic():
        locked = Job.objects.select_for_update().get(id=job.id)
        form = checked(spec, locked)
        saved = form.save()
        Job.objects.filter(id=job.id).update(applied_spec={**(locked.applied_spec or {}), **spec})
    saved.refresh_from_db()
    return saved


def job_archive(job: Job) -> None:
    """The job is listed no more and never started; its state, savepoints and history stay."""
    Job.objects.filter(id=job.id).update(archived_at=timezone.now(), standby=False)


def job_free_name(job: Job) -> str:
    """Free an archived, stopped job's name: the job becomes ``<name>-archived-<id>``, its directory (checkpoints,
    savepoints, journal) and dead letters moving with it. Returns the new name."""
    if job.archived_at is None:
        raise SpecError({"name": [f"{job.name} is not archived: delete it first"]})
    if job.runs.filter(status__in=ACTIVE_RUN_STATUSES).exists():
        raise SpecError({"name": [f"{job.name} is still stopping: ask again once it has stopped"]})
    old_dir, old_dead = job.directory, job.dead_letter_stream
    new = f"{job.name[:40]}-archived-{job.id}"
    with transaction.atomic():
        Job.objects.filter(id=job.id).update(name=new)
        job.name = new
        new_dir = job.directory
        for savepoint in job.savepoints.filter(path__startswith=str(old_dir)):
            savepoint.path = str(new_dir) + savepoint.path[len(str(old_dir)) :]
            savepoint.save(update_fields=["path"])
        if old_dir.exists():
            old_dir.rename(new_dir)  # last: a failed move undoes the rename of the job
    with contextlib.suppress(RedisError):
        client = redis_client()
        if client.exists(old_dead):
            client.rename(old_dead, job.dead_letter_stream)
    return new


def drift(job: Job) -> list[str]:
    """What was changed in the console since the job's spec was last applied, one line per setting."""
    applied = job.applied_spec or {}
    lines = []
    for name in SETTINGS:
        if name not in applied:
            continue
        want, have = applied[name], getattr(job, name)
        if name == "parameters" and isinstance(want, dict):  # as the pipeline reads them (1000000 is 1000000.0)
            want = pipelines.values_or_stored(job.pipeline, want)
            have = pipelines.values_or_stored(job.pipeline, have or {})
            changed = {k for k in want.keys() | have.keys() if not _same(want.get(k), have.get(k))}
            lines += [
                f"parameters.{k}: the spec says {want.get(k)!r}, the job has {have.get(k)!r}" for k in sorted(changed)
            ]
        elif not _same(want, have):
            lines.append(f"{name}: the spec says {want!r}, the job has {have!r}")
    return lines


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, dict) or isinstance(a, dict):
        return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)
    try:
        return type(b)(a) == b if not isinstance(b, bool) else bool(a) == b
    except (TypeError, ValueError):
        return a == b


@dataclass
class Step:
    action: str  # create | update | start | stop-with-savepoint | rescale | upgrade | archive
    params: dict[str, Any] = field(default_factory=dict)
    why: str = ""


@dataclass
class JobPlan:
    name: str
    change: str  # create | change | none | archive | refused
    steps: list[Step] = field(default_factory=list)
    refusal: str = ""


def plan(specs: list[dict[str, Any]], prune: bool = False) -> list[JobPlan]:
    """What applying ``specs`` would do, job by job, in the order to do it; changes nothing. ``prune``: a job no spec
    names is archived (a directory of specs that no longer holds its file)."""
    plans = []
    named = set()
    for spec in specs:
        name = str(spec.get("name") or "")
        named.add(name)
        plans.append(_plan_one(spec, name))
    if prune:
        for job in Job.objects.filter(archived_at__isnull=True).exclude(name__in=named).order_by("name"):
            if job.applied_spec:  # only jobs that came from specs: a job made in the console is not theirs to remove
                steps = [Step("stop-with-savepoint", why="it runs")] if spec_of(job)["state"] == "running" else []
                plans.append(JobPlan(job.name, "archive", [*steps, Step("archive", why="no spec names it")]))
    return plans


def _plan_one(spec: dict[str, Any], name: str) -> JobPlan:
    job = Job.objects.filter(name=name, archived_at__isnull=True).first()
    want_running = spec.get("state", "running") == "running"
    steps: list[Step] = []
    if job is None:
        if Job.objects.filter(name=name).exists():
            return JobPlan(name, "refused", refusal=f"{name} is archived: its name is kept until it is freed")
        try:
            checked(spec)
        except SpecError as exc:
            return JobPlan(name, "refused", refusal=str(exc))
        steps.append(Step("create", {"spec": spec}))
        if want_running:
            steps.append(
                Step(
                    "start",
                    why=free_cores_warning(
                        Job(
                            name=name,
                            parallelism=_int_or(spec, "parallelism"),
                            driver=str(spec.get("driver") or Job().driver),
                        )
                    ),
                )
            )
        return JobPlan(name, "create", steps)
    if problems := shape_problems(spec, job):  # as a new job's spec is: a typo is refused, never read as something
        return JobPlan(name, "refused", refusal=str(SpecError(problems)))
    current = spec_of(job)
    running = current["state"] == "running"
    settings_change = {
        k: v for k, v in spec.items() if k in SETTINGS and k not in (*SCALE, *CODE) and not _same(v, current[k])
    }
    if settings_change:
        try:
            checked(settings_change, job)
        except SpecError as exc:
            return JobPlan(name, "refused", refusal=str(exc))
        steps.append(Step("update", {"spec": settings_change}, "takes effect at the next start"))
    target = str(spec.get("pipeline") or job.pipeline)
    values = spec.get("parameters")
    code_change = target != job.pipeline or (values is not None and not _same(
        pipelines.values_or_stored(target, values), pipelines.values_or_stored(job.pipeline, job.parameters or {})
    ))  # fmt: skip
    has_state = job.has_state()
    if code_change and not has_state:
        steps.append(Step("update", {"spec": {"pipeline": target, "parameters": values or {}}}, "no state yet"))
    elif code_change:
        params = {"pipeline": target, **({"parameters": values} if values is not None else {})}
        mode = spec.get("upgrade_mode", "savepoint")
        why = "keeps the state: previewed first, refused if the preview finds it incompatible"
        if mode == "stateless":
            params["upgrade_mode"] = mode
            why = "previewed first; if incompatible, the new version starts with empty state (stateless)"
        if mode == "migrate":
            if refused := migration_refusal(job, target):
                return JobPlan(name, "refused", refusal=refused)
            params["upgrade_mode"] = mode
            why = (
                "previewed first with its state migration on a scratch copy; then a savepoint, the migration on its "
                "state, and the new version started on the migrated state where the old one stopped"
            )
        if mode == "blue-green" and running:
            steps.append(
                Step(
                    "blue-green",
                    params | {"auto": 1},
                    "previewed first; the new version runs beside the "
                    "job and takes over at a committed batch once caught up, the output never stopped",
                )
            )
        else:
            if mode == "blue-green":
                why += "; blue-green needs the job running, so a savepoint upgrade"
            steps.append(Step("upgrade", params, why))
    if odd := [k for k in SCALE if k in spec and not _whole(spec[k])]:
        return JobPlan(name, "refused", refusal=f"{odd[0]}: a whole number, not {spec[odd[0]]!r}")
    scale = {k: int(spec[k]) for k in SCALE if k in spec and int(spec[k]) != current[k]}
    if set(scale) == {"state_partitions"} and spec.get("upgrade_mode") == "blue-green" and running and has_state:
        green = next((step for step in steps if step.action == "blue-green"), None)
        if green is not None:  # one blue/green does both: the new version starts on the repartitioned fork
            green.params["state_partitions"] = scale["state_partitions"]
        else:
            steps.append(
                Step("blue-green", {"state_partitions": scale["state_partitions"], "auto": 1},
                     "the state repartitioned on a fork beside the job, which runs the same batches and takes over "
                     "at a committed batch once caught up, the output never stopped"),
            )  # fmt: skip
    elif scale:
        steps.append(Step("rescale", scale, "from a savepoint, the state repartitioned" if has_state else ""))
    if want_running and not running:
        scaled = Job(name=job.name, parallelism=int(scale.get("parallelism", job.parallelism)))
        why = "; ".join(filter(None, ("resumes from its checkpoint" if has_state else "", free_cores_warning(scaled))))
        steps.append(Step("start", why=why))
    if not want_running and running:
        steps.append(Step("stop-with-savepoint", why="suspended"))
    return JobPlan(name, "change" if steps else "none", steps)


def _int_or(spec: dict[str, Any], name: str) -> int:
    """A whole-number setting of a spec, or the job form's default for it."""
    value: Any = spec.get(name) if _whole(spec.get(name)) else getattr(Job(), name)
    return int(value)


def _whole(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and value.strip().isdigit() and len(value) < 10
    )


def plan_json(plans: list[JobPlan]) -> list[dict[str, Any]]:
    return [asdict(p) for p in plans]
