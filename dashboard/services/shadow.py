"""Shadow run of an upgrade: the new version and the current one, each from its own copy of the same state, over the
same records after it, beside the live job; the result rows the new one would add, remove or change.

The state it starts from is the newest one with enough records after it: a verified savepoint, else a batch the
live checkpoint still retains (saved as a savepoint first), else the beginning of the stream with empty state. A job
that caught up right after its newest savepoint is so compared on the records before that savepoint; only a stream
with no record at all after any of them makes the shadow run wait for input, showing how many it has."""

from __future__ import annotations

import shutil
from contextlib import suppress
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError
from statekeeper_sdk._runtime.compatibility import described

from dashboard import kafka, pipelines
from dashboard.checkpoint_dir.files import CheckpointError, batch_offsets, remove_tree
from dashboard.connections import redis_client
from dashboard.models import Action, Job, Savepoint, SavepointStatus
from dashboard.records import kafka_offsets
from dashboard.selectors.lag import stream_head
from dashboard.services.action_keys import SAVEPOINT_TAKEN, SPARK_READS, Keys, action_progress, remember
from dashboard.services.action_steps import Done, Next, Outcome, Steps, Wait, step_seconds
from dashboard.services.errors import ActionFailed
from dashboard.services.forks import restorable_batches
from dashboard.services.savepoints import savepoint_steps
from dashboard.services.secrets import kafka_cluster
from dashboard.services.state_reader_client import tool_process
from dashboard.services.upgrade_parts import (
    SHADOW_RECORDS,
    SHADOW_RECORDS_MOST,
    TARGET_KEYS,
    checked_target,
    scratch_cleanup,
    scratch_dead_letters,
    scratch_dir,
    scratch_spec,
)

INPUT_WAIT_SECONDS = 1800  # how long a shadow run waits for a first record when the stream has none to compare on
SHADOW_LIMIT = 3600  # seconds the two versions may take over the range


def _place(job: Job, offset: Any) -> dict[str, Any] | None:
    """Where a batch ended in the job's source, as a start point says it: a Redis stream's entry id and ``n``; a Kafka
    topic's offsets per partition, ``n`` their sum. None when the offset says neither."""
    if job.reads_kafka:
        offsets = (kafka_offsets(offset) or {}).get(job.source_stream)
        if offsets is None:
            return None
        return {"n": sum(offsets.values()), "offsets": {str(p): o for p, o in offsets.items()}}
    if isinstance(offset, dict) and "n" in offset and "id" in offset:
        return {"n": int(offset["n"]), "id": offset["id"]}
    return None


def start_points(job: Job) -> list[dict[str, Any]]:
    """Where a shadow run can start, newest first: verified savepoints of the pipeline the job runs now, batches the
    live checkpoint retains, and (for a job that read its source from the start) the beginning with empty state."""
    points = []
    for savepoint in job.savepoints.filter(status=SavepointStatus.VERIFIED).order_by("-id"):
        offset = (savepoint.manifest.get("source_offsets") or [None])[0]
        if savepoint.manifest.get("pipeline", job.pipeline) == job.pipeline and (place := _place(job, offset)):
            points.append({"kind": "savepoint", "savepoint": savepoint.id, **place})
    for batch in reversed(restorable_batches(job)):
        with suppress(CheckpointError):
            if place := _place(job, batch_offsets(job.checkpoint_location, batch)["sources"][0]):
                points.append({"kind": "batch", "batch": batch, **place})
    if not job.start_offset:
        points.append({"kind": "beginning", "n": 0, **({"offsets": {}} if job.reads_kafka else {"id": None})})
    return sorted(points, key=lambda p: (-p["n"], ["savepoint", "batch", "beginning"].index(p["kind"])))


def _range(action: Action) -> Outcome:
    job = action.job
    checked_target(action)
    if pipelines.find(job.pipeline) is None:
        raise ActionFailed(f"{job.pipeline}, which {job.name} runs now, is not registered: nothing to compare with.")
    if not (job.reads_redis or job.reads_kafka):
        raise ActionFailed(
            "A shadow run reads a fixed range of a Redis stream or a Kafka topic beside the live job; this job's "
            "source has no such range. Preview the upgrade instead."
        )
    records = min(int(action.params.get("records") or SHADOW_RECORDS), SHADOW_RECORDS_MOST)
    fixed = _kafka_range(job, records) if job.reads_kafka else _stream_range(job, records)
    if fixed is None:
        if step_seconds(action) > float(action.params.get("input_wait_seconds") or INPUT_WAIT_SECONDS):
            raise ActionFailed(
                f"No record arrived in {job.source_stream} to compare on; nothing was run. Request it again once the "
                "source has input."
            )
        return Wait(f"waiting for input: {job.source_stream} has no record after the job's state to compare on", 2.0)
    start, ending, count = fixed
    remember(action, start=start, ending=ending, records=count)
    if start["kind"] == "batch":
        return Next("savepoint")
    if start["kind"] == "savepoint":
        remember(action, savepoint=start["savepoint"])
    return Next("run")


def _stream_range(job: Job, records: int) -> tuple[dict[str, Any], dict[str, Any], int] | None:
    """The start point, the end offset and the entries between, on the job's Redis stream; None without input."""
    head = stream_head(job.source_stream)
    if head is None:
        raise ActionFailed("Redis cannot be reached, so the shadow run's input cannot be fixed.")
    added, trimmed = head
    usable = [p for p in start_points(job) if p["n"] >= trimmed and added > p["n"]]
    if not usable:
        return None
    start = next((p for p in usable if added - p["n"] >= records), usable[-1])
    ending = range_end(job, start, records, "so the shadow run's input cannot be fixed")
    if ending is None:
        raise ActionFailed(f"{job.source_stream} was trimmed while the shadow run fixed its input; request it again.")
    return start, ending, ending["n"] - start["n"]


def _kafka_range(job: Job, records: int) -> tuple[dict[str, Any], dict[str, Any], int] | None:
    """The start point, the end offsets ({topic: {partition: offset}}) and the records between, on the job's Kafka
    topic: from the newest point with ``records`` after it that the broker still holds whole. None without input."""
    try:
        ends = kafka.end_offsets(kafka_cluster(job), job.source_stream)
    except kafka.KafkaUnavailable as exc:
        raise ActionFailed(f"Kafka cannot be reached, so the shadow run's input cannot be fixed: {exc}") from None
    lows = {str(p): low for p, (low, _) in ends.items()}
    highs = {str(p): high for p, (_, high) in ends.items()}
    usable = []
    for point in start_points(job):
        at = point["offsets"] or lows  # the beginning: the first record the broker holds
        if all(at.get(p, 0) >= low for p, low in lows.items()):
            waiting = sum(max(0, high - at.get(p, 0)) for p, high in highs.items())
            if waiting:
                usable.append((point | {"offsets": at}, waiting))
    if not usable:
        return None
    start, _ = next(((p, w) for p, w in usable if w >= records), usable[-1])
    ending = kafka.spread({p: start["offsets"].get(p, 0) for p in highs}, highs, records)
    count = sum(ending.values()) - sum(start["offsets"].get(p, 0) for p in highs)
    return start, {job.source_stream: ending}, count


def range_end(job: Job, start: dict[str, Any], records: int, why: str) -> dict[str, Any] | None:
    """The source offset ``records`` entries after the start (or the stream's head, if nearer); None when no entry
    comes after it. ``why``: what an unreachable Redis keeps from being done, for its error."""
    try:
        entries = redis_client().xrange(job.source_stream, min=f"({start['id']}" if start["id"] else "-", count=records)
    except RedisError as exc:
        raise ActionFailed(f"Redis cannot be reached, {why}: {exc}") from None
    if not entries:
        return None
    last = entries[-1][0]
    return {"id": last.decode() if isinstance(last, bytes) else str(last), "n": int(start["n"]) + len(entries)}


def _run(action: Action) -> Outcome:
    """Both versions over the range, on scratch copies, in a Spark process of its own while the action waits."""
    job = action.job
    target = described(str(action.params["pipeline"]), action.params["from_parameters"], action.params["parameters"])
    ending = action.params["ending"]
    scratch = scratch_dir(action, "shadow")
    savepoint = Savepoint.objects.filter(id=action.params.get("savepoint")).first()
    if "shadow" not in action.memo:
        remove_tree(scratch)
        for side in ("old", "new"):
            if savepoint is not None:
                action_progress(action, f"copying savepoint #{savepoint.id} for the {side} version")
                shutil.copytree(Path(savepoint.path) / "checkpoint", scratch / side)
            else:
                (scratch / side).mkdir(parents=True)
    start = action.params["start"]
    spec = scratch_spec(job, scratch_dead_letters(action, "shadow")) | {
        # a Kafka topic read from its beginning starts where the range was fixed, whatever the broker trims since
        "starting": {job.source_stream: start["offsets"]} if "offsets" in start and savepoint is None else None,
        "old_reference": pipelines.reference(job.pipeline),
        "new_reference": pipelines.reference(action.params["pipeline"]),
        "old_parameters": action.params["from_parameters"], "new_parameters": action.params["parameters"],
        "ending": ending, "limit": 50,
    }  # fmt: skip
    try:
        result = tool_process(
            action, "shadow", "shadow", scratch, int(savepoint.batch_id or 0) if savepoint else -1, spec
        )
    except ActionFailed:
        scratch_cleanup(action, "shadow")
        raise
    if result is None:
        if step_seconds(action) > SHADOW_LIMIT:
            scratch_cleanup(action, "shadow")
            raise ActionFailed(f"The shadow run did not finish within {SHADOW_LIMIT} s")
        return Wait(f"running {job.pipeline} and {target} over {action.params['records']} records", 1.0)
    scratch_cleanup(action, "shadow")
    where = f"savepoint #{savepoint.id} (batch {savepoint.batch_id})" if savepoint else "the beginning of the stream"
    shadow = {"target": target, "current": job.pipeline, "savepoint": savepoint.id if savepoint else None,
              "from": where, "records": action.params["records"], **result}  # fmt: skip
    remember(action, shadow=shadow)
    counts = result["counts"]
    return Done(
        f"Shadow run of {target} beside {job.pipeline}, from {where} over the next {action.params['records']} "
        f"records: {counts['added']} result rows added, {counts['removed']} removed, {counts['changed']} changed, "
        f"{result['same']} the same."
    )


# the range both versions read (its start, end and records, from a savepoint or not) and the comparison shown
SHADOW_KEYS = (
    SPARK_READS + TARGET_KEYS + SAVEPOINT_TAKEN + Keys(
        params={"start": dict, "ending": dict, "records": int, "shadow": dict}
    )
)  # fmt: skip
SHADOW_STEPS: Steps = {
    "range": ("fix the input", _range),
    **savepoint_steps("shadow", then="run", batch=lambda action: action.params["start"]["batch"]),
    "run": ("run both versions", _run),
}
