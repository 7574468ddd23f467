"""The parts every kind of upgrade shares (the savepoint upgrade and its preview, the shadow run, blue/green, the
state migration): what may be asked for and by whom, the parameter values a target runs with, the scratch copies a
preview or a shadow run works on, and where a new line of batches starts reading.

The rules of an upgrade request are here once, for the Deploys page and the API alike (``upgrade_request``); the
steps each kind runs are in its own module (``upgrades``, ``shadow``, ``blue_green``, ``state_migration``)."""

from __future__ import annotations

from contextlib import suppress
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError
from statekeeper_sdk._runtime.compatibility import described

from dashboard import pipelines
from dashboard.access import ADMIN, OPERATOR, refusal
from dashboard.checkpoint_dir.files import lineage_base, remove_tree
from dashboard.connections import redis_client
from dashboard.models import Action, ActionKind, Job, Savepoint, StateBackend
from dashboard.records import kafka_offsets
from dashboard.services.action_keys import Keys, remember
from dashboard.services.errors import ActionFailed
from dashboard.services.secrets import value_problems

SHADOW_RECORDS = 5000  # the input a shadow run reads when the request names none
SHADOW_RECORDS_MOST = 100_000  # the most a shadow run may read
CHANGED_PERCENT_MOST = 100  # blue/green's rule "at most this share of rows changed" is a percentage


class UpgradeRequestError(ValueError):
    """An upgrade request that cannot be tried: ``malformed`` when the request itself is wrong (a 400), otherwise
    refused for the job as it is (a 409)."""

    def __init__(self, message: str, *, malformed: bool) -> None:
        super().__init__(message)
        self.malformed = malformed


TARGET_KEYS = Keys(
    params={"from_parameters": dict, "parameters": dict}
)  # ``checked_target``: the values before and after


def upgrade_request(job: Job, kind: str, params: dict[str, Any]) -> dict[str, Any]:
    """The rules of an upgrade request of ``kind`` (preview, shadow run, upgrade or blue/green), as the Deploys page and
    the API both ask for one: ``params`` as given (``pipeline``, ``parameters``, ``migrate``, ``empty_state``,
    ``records``, ``max_changed_percent``, ``state_partitions``), returned with the values the target would run with
    (``parameters``) and a shadow run's records. UpgradeRequestError says why it cannot be tried."""
    if params.get("migrate") and params.get("empty_state"):
        raise UpgradeRequestError("Choose one: migrate the state, or start with empty state.", malformed=True)
    if (percent := params.get("max_changed_percent")) is not None and not _whole(percent, 0, CHANGED_PERCENT_MOST):
        raise UpgradeRequestError(
            f"Changed rows at most: a whole percentage from 0 to {CHANGED_PERCENT_MOST}.", malformed=True
        )
    clean = dict(params)
    if kind == ActionKind.UPGRADE_SHADOW:
        clean["records"] = params.get("records") or SHADOW_RECORDS
        if not _whole(clean["records"], 1, SHADOW_RECORDS_MOST):
            raise UpgradeRequestError(f"A shadow run reads 1 to {SHADOW_RECORDS_MOST:,} records.", malformed=True)
    target, given = str(params.get("pipeline") or job.pipeline), params.get("parameters")
    rescale = params.get("state_partitions") not in (None, job.state_partitions)
    if refused := upgrade_refusal(job, target, given, bool(params.get("migrate")), rescale):
        raise UpgradeRequestError(refused, malformed=False)
    return clean | {"pipeline": target, "parameters": target_parameters(job, target, given)}


def _whole(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def current_parameters(job: Job) -> dict[str, Any]:
    """The values the job's pipeline runs with now (its defaults filling what the job does not set)."""
    return pipelines.values_or_stored(job.pipeline, job.parameters)


def target_parameters(job: Job, target: str, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """The values ``target`` would run with: the given ones over the job's values for the parameters it declares,
    checked, and defaults for the rest. ValueError with one problem per line."""
    declared = {p.name for p in getattr(pipelines.get(target), "parameters", ()) or ()}
    kept = {name: value for name, value in job.parameters.items() if name in declared}
    return pipelines.parameter_values(target, kept | (given or {}))


def upgrade_role(job: Job, target: str, given: dict[str, Any] | None = None) -> tuple[str, str]:
    """The role an upgrade of the job to ``target`` with the ``given`` values needs, and why when it is the admin's.
    An operator may upgrade to a version of the job's own pipeline (``Pipeline.version_of``) and change the parameters
    it marks operational; changing where the output goes (another pipeline, a sink's target, a secret, a version
    whose sinks write elsewhere) takes an admin."""
    if pipelines.find(target) is None:
        return OPERATOR, ""  # upgrade_refusal says there is no such pipeline
    if pipelines.family(target) != pipelines.family(job.pipeline):
        return (
            ADMIN,
            f"moving {job.name} from {job.pipeline} to {target}, another pipeline, changes where its output goes",
        )
    try:
        before, after = current_parameters(job), target_parameters(job, target, given)
    except (pipelines.UnknownPipeline, ValueError):
        return OPERATOR, ""  # upgrade_refusal says what is wrong
    declared = {p.name: p for p in getattr(pipelines.get(target), "parameters", ()) or ()}
    changed = [name for name in after if name not in before or before[name] != after[name]]
    if fixed := [name for name in changed if not getattr(declared.get(name), "operational", False)]:
        operational = [name for name, p in declared.items() if getattr(p, "operational", False)]
        return ADMIN, (
            f"{', '.join(fixed)} {'is' if len(fixed) == 1 else 'are'} not among {target}'s operational parameters "
            f"({', '.join(operational) or 'it has none'}): changing {'it' if len(fixed) == 1 else 'them'} may change "
            "where the output goes"
        )
    was, will = pipelines.sink_targets(job.pipeline, before), pipelines.sink_targets(target, after)
    if was != will:
        moved = sorted(name for name in was.keys() | will.keys() if was.get(name) != will.get(name))
        return ADMIN, f"{target} writes its output elsewhere than {job.pipeline} (sinks {', '.join(moved)})"
    return OPERATOR, ""


def upgrade_role_refusal(user: Any, job: Job, target: str, given: dict[str, Any] | None = None) -> str:
    """Why this user may not make this upgrade, naming the role and what needs it; empty when they may."""
    needed, why = upgrade_role(job, target, given)
    if not (refused := refusal(user, needed)):
        return ""
    return f"{why}: {refused[0].lower()}{refused[1:]}" if why else refused  # why may start with a parameter's name


def upgrade_refusal(
    job: Job, target: str, given: dict[str, Any] | None = None, migrate: bool = False, rescale: bool = False
) -> str:
    """Why ``target`` (with the ``given`` parameter values) cannot even be previewed for the job; empty when it
    can. The same pipeline with other parameter values is an upgrade like any other. ``migrate``: a state migration
    is asked for, which the target must declare from the job's pipeline, and which starts a new checkpoint (so a
    memory job may move to a version that needs RocksDB: the migrated line runs on RocksDB). ``rescale``: new state
    partitions come with it (a blue/green rescale), so the job's own version and values are a change too."""
    new = pipelines.find(target)
    if new is None:
        return f"There is no registered pipeline {target!r}; the registry has {', '.join(pipelines.names())}."
    try:
        values = target_parameters(job, target, given)
    except ValueError as exc:
        return f"{target}'s parameters: " + "; ".join(str(exc).splitlines()) + "."
    if target == job.pipeline and values == current_parameters(job) and not rescale:
        shown = f" with {', '.join(f'{k}={v}' for k, v in values.items())}" if values else ""
        return f"{job.name} already runs {target}{shown}."
    if migrate and (refused := migration_refusal(job, target)):
        return refused
    if job.real_time and not getattr(new, "real_time", False):
        return (
            f"{job.name} runs in Spark's real-time mode and {target} is not declared for it (Pipeline(real_time=True), "
            "with one KafkaSink)."
        )
    if job.real_time and (migrate or rescale):
        return (
            f"{job.name} runs in Spark's real-time mode: a state migration and a blue/green rescale run the new line "
            "beside it in micro-batches, which real-time mode has no handover from yet. Upgrade it with a savepoint."
        )
    if new.needs_rocksdb and job.state_backend == StateBackend.MEMORY and not migrate:  # either RocksDB kind will do
        way = (
            f" {target} declares a state migration from {job.pipeline}: migrate the state, and the migrated job runs "
            "on RocksDB."
            if not migration_refusal(job, target)
            else ""
        )
        return (
            f"{target} keeps transformWithState state, which needs the RocksDB backend; {job.name} uses "
            f"{job.state_backend}.{way}"
        )
    if problems := pipelines.sink_problems(target, values) + value_problems(target, values):
        return f"{target}'s output cannot be written: " + "; ".join(problems) + "."
    return ""


def migration_refusal(job: Job, target: str) -> str:
    """Why the job cannot be migrated to ``target``: it declares no migration from the job's pipeline, or the job's
    source cannot start a new checkpoint where the old one stopped. Empty when it can."""
    if pipelines.migration(target, job.pipeline) is None:
        declared = ", ".join(m.from_pipeline for m in getattr(pipelines.find(target), "migrations", ()) or ()) or "none"
        return (
            f"{target} declares no state migration from {job.pipeline} (it declares {declared}): its state cannot be "
            "built from this job's."
        )
    if not (job.reads_redis or job.reads_kafka):
        return (
            "A state migration starts a new checkpoint where the old one stopped, which needs a Redis stream or Kafka "
            "source."
        )
    return ""


def checked_target(action: Action) -> str:
    """The pipeline the action moves the job to, refused as ``upgrade_refusal`` refuses it; the parameter values it
    would run with, and the job's now, are kept in the action (``parameters``, ``from_parameters``)."""
    job = action.job
    target = str(action.params.get("pipeline", ""))
    given = action.params.get("parameters")
    if refusal := upgrade_refusal(job, target, given, migrate=bool(action.params.get("migrate"))):
        raise ActionFailed(refusal)
    if "from_parameters" not in action.params:
        remember(action, from_parameters=current_parameters(job), parameters=target_parameters(job, target, given))
    return target


def target_shown(action: Action) -> str:
    """The upgrade's target as the operator reads it, with the parameters it changes."""
    return described(action.params["plan"]["target"], action.params.get("from_parameters", {}),
                     action.params.get("parameters", {}))  # fmt: skip


def scratch_dir(action: Action, use: str) -> Path:
    """Where a preview's or a shadow run's (``use``) scratch copy of the job's state is made."""
    return action.job.directory / f"upgrade-{use}-{action.id}"


def scratch_dead_letters(action: Action, use: str) -> str:
    """Where the entries a scratch run rejects go, apart from the job's own dead letters."""
    return f"{action.job.dead_letter_stream}:{use}-{action.id}"


def scratch_cleanup(action: Action, use: str) -> None:
    remove_tree(scratch_dir(action, use))
    with suppress(RedisError):  # a Redis hiccup must not fail the action; the key holds only replayed rejects
        redis_client().delete(scratch_dead_letters(action, use))


def scratch_spec(job: Job, dead_letters: str) -> dict[str, Any]:
    """What the state tool needs to read the job's source beside it (the job's run values), with rejects going to a
    scratch key and the parameters as a mapping, which a preview replaces with the new version's."""
    return job.run_values() | {"dead_letter": dead_letters, "parameters": job.parameters}


def savepoint_offset(action: Action, savepoint: Savepoint) -> dict[str, Any]:
    """Where the savepoint's batch ended in the job's stream: where a new checkpoint after it starts reading."""
    offset = (savepoint.manifest.get("source_offsets") or [None])[0]
    return start_of(action.job, offset, f"Savepoint #{savepoint.id}")


def start_of(job: Job, offset: Any, what: str) -> dict[str, Any]:
    """Where a batch ended in the job's source (``offset``, as its checkpoint's offsets file says it), as the offset a
    new checkpoint starts reading from: a Redis stream's {"id", "n"}, a Kafka topic's {topic: {partition: offset}}.
    ``what`` names the batch's holder for the error when it says neither."""
    if job.reads_kafka and (kafka := kafka_offsets(offset)) is not None and job.source_stream in kafka:
        return {job.source_stream: {str(p): o for p, o in kafka[job.source_stream].items()}}
    if not isinstance(offset, dict) or "id" not in offset:
        raise ActionFailed(f"{what} does not say where {job.source_stream} was read to.")
    return {"id": offset["id"], "n": int(offset["n"])}


def next_line_base(savepoint: Savepoint) -> int:
    """The sinks' number of the batch after the savepoint's: where a new line of batches after it starts."""
    return lineage_base(Path(savepoint.path) / "checkpoint") + int(savepoint.batch_id or 0) + 1
