"""Spark's own reading of a checkpoint or savepoint, in a short-lived process of its own.

    python -m workers.spark.state_tool verify PATH BATCH      -> JSON: operators, partitions, rows per state variable
    python -m workers.spark.state_tool repartition PATH N     -> JSON: the batch the repartitioned state was written as
    python -m workers.spark.state_tool partition-rows PATH BATCH -> JSON: state rows per operator and partition
    python -m workers.spark.state_tool inspect PATH BATCH SPEC  -> JSON: variables, a page of keys, a lookup, or a diff
    python -m workers.spark.state_tool plan PATH BATCH SPEC     -> JSON: the state schemas before and after another
                                                                   pipeline re-ran the batch on this (scratch) copy
    python -m workers.spark.state_tool migrate PATH BATCH SPEC  -> JSON: a state migration's output written as the seed
                                                                   of a new checkpoint, its counts and samples, and
                                                                   (a preview) the new version's first batch on it
    python -m workers.spark.state_tool shadow PATH BATCH SPEC   -> JSON: the results two pipelines produce from the
                                                                   same savepoint copies (PATH/old, PATH/new) over the
                                                                   same input range, and how they differ

Workers call it as a subprocess, so no Celery worker ever hosts a JVM. Exit 0 with JSON on the last line of stdout,
or exit 2 with {"error": ...}.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from statekeeper_sdk import OldState, resolve
from statekeeper_sdk._runtime.compatibility import describe, forget_batch, operator_schemas, replayed
from statekeeper_sdk._runtime.migration import (
    MIGRATION_SAMPLES,
    check_columns,
    check_keys,
    declared_variables,
    has_timers,
    migration_figures,
    read_state,
    state_frames,
)
from statekeeper_sdk._runtime.real_time import refusal as real_time_refusal

from dashboard.checkpoint_dir.files import schema_view, seed_dir, write_lineage
from dashboard.engine.code import newest_change
from workers.spark.query import JOB_SPEC_FIELDS, JobSpec, start_query
from workers.spark.session import FILE_SYSTEM_MANAGER, build_session

_readers = state_frames  # each operator's state variables at a batch, with Spark's reader on each


def state_counts(spark: Any, path: str, batch: int) -> list[dict[str, Any]]:
    operators: dict[int, dict[str, Any]] = {}
    for row, name, state in _readers(spark, path, batch):
        entry = operators.setdefault(
            row["operatorId"],
            {"id": row["operatorId"], "name": row["operatorName"], "partitions": row["numPartitions"], "rows": {}},
        )
        entry["rows"][name] = state.count()
    if not operators:
        raise ValueError("no stateful operator in the checkpoint's metadata")
    return list(operators.values())


def partition_rows(spark: Any, path: str, batch: int) -> list[dict[str, Any]]:
    """State rows per partition of each operator at a committed batch (all state variables of an operator summed)."""
    operators: dict[int, dict[str, Any]] = {}
    for row, _, state in _readers(spark, path, batch):
        entry = operators.setdefault(
            row["operatorId"],
            {
                "id": row["operatorId"],
                "name": row["operatorName"],
                "rows": dict.fromkeys(range(row["numPartitions"]), 0),
            },
        )
        for counted in state.groupBy("partition_id").count().collect():
            entry["rows"][counted["partition_id"]] = entry["rows"].get(counted["partition_id"], 0) + counted["count"]
    if not operators:
        raise ValueError("no stateful operator in the checkpoint's metadata")
    return list(operators.values())


def _reader(spark: Any, path: str, batch: int, operator: int, variable: str | None) -> Any:
    reader = spark.read.format("statestore").option("batchId", str(batch)).option("operatorId", str(operator))
    if variable:
        reader = reader.option("stateVarName", variable)
    frame = reader.load(path)
    if "user_map_key" in frame.columns:  # a MapState: a row per entry, keyed by the grouping key and the map's key
        key = F.to_json(F.struct(F.col("key.*"), F.col("user_map_key.*")))
        return frame.select(key.alias("key"), F.to_json("user_map_value").alias("value"), "partition_id")
    return frame.select(
        F.to_json("key").alias("key"),
        F.to_json(F.struct(*[c for c in frame.columns if c not in ("key", "partition_id")])).alias("value"),
        "partition_id",
    )


def inspect(spark: Any, path: str, batch: int, spec: dict[str, Any]) -> dict[str, Any]:
    """What the state inspector asks: the operators and state variables; a page of keys; the keys whose JSON contains
    a text; or the keys that were added, removed or changed between two batches."""
    mode = spec.get("mode", "variables")
    operators = []
    for row in spark.read.format("state-metadata").load(path).collect():
        props = json.loads(row["operatorProperties"]) if row["operatorProperties"] else {}
        variables = declared_variables(props)
        operators.append(
            {"id": row["operatorId"], "name": row["operatorName"], "partitions": row["numPartitions"],
             "variables": [var["stateName"] for var in variables], "min_batch": row["minBatchId"],
             "max_batch": row["maxBatchId"], "time_mode": props.get("timeMode", ""),
             "details": [{"name": var["stateName"], "type": var.get("stateVariableType", ""),
                          "ttl": bool(var.get("ttlEnabled"))} for var in variables]}
        )  # fmt: skip
        if mode == "variables" and has_timers(props):
            timers = _timers(spark, path, batch, row["operatorId"])
            first = timers.agg(F.count(F.lit(1)).alias("n"), F.min("expiration_timestamp_ms").alias("next")).first()
            operators[-1]["timers"] = {"count": first["n"], "next_ms": first["next"]}
    if mode == "variables":
        return {"operators": operators}
    operator = int(spec.get("operator", 0))
    variable = spec.get("variable") or None
    limit, offset = min(int(spec.get("limit", 50)), 500), max(0, int(spec.get("offset", 0)))
    if mode == "timers":
        if not any(op["id"] == operator and op.get("time_mode") not in ("", "None", "NoTime") for op in operators):
            raise ValueError(f"operator {operator} keeps no timers (only transformWithState with a time mode does)")
        timers = _timers(spark, path, batch, operator)
        total = timers.count()
        rows = timers.orderBy("expiration_timestamp_ms", F.to_json("key")).offset(offset).limit(limit).collect()
        return {
            "operators": operators, "total": total, "offset": offset,
            "rows": [{"key": json.dumps(r["key"].asDict(recursive=True), default=str),
                      "value": _moment(r["expiration_timestamp_ms"]), "fires_ms": r["expiration_timestamp_ms"],
                      "partition": r["partition_id"]} for r in rows],
        }  # fmt: skip
    frame = _reader(spark, path, batch, operator, variable)
    if mode in ("keys", "lookup"):
        if mode == "lookup":
            frame = frame.filter(F.col("key").contains(str(spec.get("text", ""))))
        total = frame.count()
        rows = frame.orderBy("key").offset(offset).limit(limit).collect()
        return {
            "operators": operators,
            "total": total,
            "offset": offset,
            "rows": [{"key": r["key"], "value": r["value"], "partition": r["partition_id"]} for r in rows],
        }
    if mode == "diff":
        before = _reader(spark, path, int(spec["from_batch"]), operator, variable)
        joined = before.alias("a").join(frame.alias("b"), on="key", how="full_outer")
        change = (
            F.when(F.col("a.value").isNull(), F.lit("added"))
            .when(F.col("b.value").isNull(), F.lit("removed"))
            .when(F.col("a.value") != F.col("b.value"), F.lit("changed"))
        )
        changes = joined.select(
            "key", change.alias("change"), F.col("a.value").alias("before"), F.col("b.value").alias("after")
        ).filter(F.col("change").isNotNull())
        counts = {r["change"]: r["count"] for r in changes.groupBy("change").count().collect()}
        rows = changes.orderBy("change", "key").offset(offset).limit(limit).collect()
        return {
            "operators": operators,
            "counts": counts,
            "total": sum(counts.values()),
            "offset": offset,
            "rows": [r.asDict() for r in rows],
        }
    raise ValueError(f"unknown inspection {mode!r}")


def _timers(spark: Any, path: str, batch: int, operator: int) -> Any:
    """The operator's registered timers at the batch: ``key``, ``expiration_timestamp_ms``, ``partition_id``."""
    return (
        spark.read.format("statestore").option("batchId", str(batch)).option("operatorId", str(operator))
        .option("readRegisteredTimers", "true").load(path)
    )  # fmt: skip


def _moment(ms: int | None) -> str:
    if ms is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}"


def _scratch_job(spec: dict[str, Any], name: str, checkpoint: str, pipeline: Any, **extra: Any) -> JobSpec:
    """A query on a scratch copy that reads the job's source as the job does (the dashboard's ``scratch_spec``), with
    its rejects kept apart; in micro-batches, into a sink of the tool's, also for a real-time job."""
    values = {name: spec[name] for name in JOB_SPEC_FIELDS if name in spec}
    return JobSpec(**(values | {
        "job_id": 0, "name": name, "pipeline": pipeline.name, "trigger_seconds": 1.0, "parallelism": 1,
        "checkpoint": checkpoint, "batches_retained": 1000, "starting_offset": "", "phase_seconds": None,
        "parameters": json.dumps(spec.get("parameters", {})), "real_time": False, **extra,
    }))  # fmt: skip


def plan(
    spark: Any, path: str, batch: int, spec: dict[str, Any], on_verdict: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Re-run committed batch ``batch`` of a scratch copy with the pipeline at ``spec["reference"]``, from the state
    the batch started with, into a sink that only counts: Spark checks the new code against the old state as a
    restart would, and writes the state schemas it would use from now on. Returns both sets of schemas, the batch's
    output rows and where the time went (``seconds``).

    Spark has checked the state and written its schemas once it has planned the batch, when the sink is called, before
    the batch runs: ``on_verdict`` is then given the schemas read at that moment (``schema_view``), which are all a
    verdict needs. The batch's run, which proves the code runs on the state, comes after; the schemas are read again
    once it has committed, and those stand."""
    root = Path(path)
    began = time.monotonic()
    before = operator_schemas(spark, path, batch)
    seconds = {"before": time.monotonic() - began}
    commit = (root / "commits" / str(batch)).read_bytes()
    pipeline = load_pipeline(spec["reference"])
    if spec.get("real_time"):  # a real-time job's new version must run so too: asked of Spark before the replay
        values = dict(resolve(pipeline.parameters, spec.get("parameters", {})))
        if (refused := real_time_refusal(spark, pipeline, values, int(spec.get("partitions", 1)))) is not None:
            return {"before": before, "output_rows": 0, "output_mode": pipeline.output_mode,
                    "real_time_refusal": refused, "seconds": {"refused": round(time.monotonic() - began, 3)}}  # fmt: skip
    forget_batch(root, batch)  # planned again by the new code, its schemas written again
    job = _scratch_job(spec, f"upgrade-plan-{int(time.time())}", path, pipeline)
    rows: list[int] = []

    def count(frame: DataFrame, batch_id: int) -> None:
        if "planned" not in seconds:
            seconds["planned"] = time.monotonic() - began
            if on_verdict is not None:
                _early_verdict(spark, root, batch, commit, before, pipeline.output_mode, seconds, on_verdict)
        rows.append(frame.count())

    error = replayed(start_query(spark, job, pipeline, count), root, batch, float(spec.get("timeout", 600)))
    seconds["ran"] = time.monotonic() - began
    result: dict[str, Any] = {"before": before, "output_rows": sum(rows), "output_mode": pipeline.output_mode}
    if error:
        result["replay_error"] = error
    else:
        result["after"] = operator_schemas(spark, path, batch)
    seconds["after"] = time.monotonic() - began
    return result | {"seconds": {k: round(v, 3) for k, v in seconds.items()}}


def _early_verdict(
    spark: Any, root: Path, batch: int, commit: bytes, before: list[dict[str, Any]], output_mode: str,
    seconds: dict[str, float], on_verdict: Callable[[dict[str, Any]], None],
) -> None:  # fmt: skip
    """The schemas Spark has just planned ``batch`` with, read from a view of the copy's schema files, to
    ``on_verdict``; nothing when they cannot be read so (the answer after the batch's run gives the verdict then)."""
    view = root.with_name(f"{root.name}.schemas")
    began = time.monotonic()
    try:
        after = operator_schemas(spark, schema_view(root, batch, commit, view), batch)
        on_verdict({"batch": batch, "before": before, "after": after, "output_mode": output_mode,
                    "seconds": {**{k: round(v, 3) for k, v in seconds.items()},
                                "read": round(time.monotonic() - began, 3)}})  # fmt: skip
    except Exception as exc:  # the verdict then waits for the batch's run
        print(f"no verdict at planning ({describe(exc)}): it comes after the batch's run", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(view, ignore_errors=True)


class StaleCode(Exception):
    """A pipeline's module changed on disk after this long-lived process imported it: its answer would be the old
    code's."""


_LOADED: dict[str, float] = {}  # module -> the newest mtime of its distribution's files when this process imported it


def load_pipeline(reference: str) -> Any:
    module_name, _, attribute = reference.partition(":")
    module = importlib.import_module(module_name)
    changed = newest_change(module)  # any file of its package: a helper module's edit counts too
    if _LOADED.setdefault(module_name, changed) != changed:
        raise StaleCode(f"the code of {module_name} changed on disk since this process imported it")
    return getattr(module, attribute)


def _results_over_range(spark: Any, path: Path, spec: dict[str, Any], reference: str) -> dict[str, Any]:
    """Run the pipeline on the checkpoint copy at ``path`` up to the spec's ending offset (Trigger.AvailableNow), and
    keep its results as the sink would: upserted on (kind, key)."""
    pipeline = load_pipeline(reference)
    job = _scratch_job(
        spec, f"shadow-{path.name}-{int(time.time())}", str(path), pipeline,
        ending_offset=json.dumps(spec["ending"]), available_now=True,
        starting_offset=json.dumps(spec["starting"]) if spec.get("starting") else "",
    )  # fmt: skip
    rows: dict[str, Any] = {}
    batches: list[int] = []

    def keep(frame: DataFrame, batch_id: int) -> None:
        for kind, key, value in pipeline.checked_results(frame.collect())[0]:
            rows[json.dumps([kind, key])] = value
        batches.append(batch_id)

    query = start_query(spark, job, pipeline, keep)
    if not query.awaitTermination(int(spec.get("timeout", 600))):
        query.stop()
        raise TimeoutError(f"{pipeline.name} did not read the range within {spec.get('timeout', 600)} s")
    if failure := query.exception():
        raise RuntimeError(f"{pipeline.name} failed on the range: {describe(failure)}")
    return {"rows": rows, "batches": batches}


def shadow(spark: Any, path: str, batch: int, spec: dict[str, Any]) -> dict[str, Any]:
    """The new pipeline and the current one, each from its own copy of the same savepoint, over the same input: the
    result rows the new one would add, remove or change. Beside the live job, so its timing is not a difference."""
    root = Path(path)
    old = _results_over_range(spark, root / "old", spec | {"parameters": spec.get("old_parameters", {})},
                              spec["old_reference"])  # fmt: skip
    new = _results_over_range(spark, root / "new", spec | {"parameters": spec.get("new_parameters", {})},
                              spec["new_reference"])  # fmt: skip
    before, after = old["rows"], new["rows"]
    limit = int(spec.get("limit", 50))
    changes: dict[str, list[dict[str, Any]]] = {"added": [], "removed": [], "changed": []}
    counts = dict.fromkeys(changes, 0)
    for name in sorted(before.keys() | after.keys()):
        kind, key = json.loads(name)
        if name not in before:
            change, row = "added", {"kind": kind, "key": key, "after": after[name]}
        elif name not in after:
            change, row = "removed", {"kind": kind, "key": key, "before": before[name]}
        elif before[name] != after[name]:
            change, row = "changed", {"kind": kind, "key": key, "before": before[name], "after": after[name]}
        else:
            continue
        counts[change] += 1
        if len(changes[change]) < limit:
            changes[change].append(row)
    return {
        "counts": counts,
        "rows": changes,
        "same": sum(1 for name in before.keys() & after.keys() if before[name] == after[name]),
        "batches": {"old": len(old["batches"]), "new": len(new["batches"])},
    }


def migrate(spark: Any, path: str, batch: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Run the target version's migration from ``spec["from_pipeline"]`` on the state of the checkpoint copy at
    ``path`` as of ``batch``, and write its output as the seed of the new checkpoint ``spec["checkpoint"]``
    (``seed_dir``). Returns rows read per variable and written, keys in and out, the old keys that map to nothing
    (compared on the key columns the old and new keys share), samples before and after; with ``first_batch``, the new
    version's first batch on the seeded state from the batch's end offsets (``spec["starting"]``), its output rows and
    the state it holds after (on a large state, a part of it: ``_sampled_first_batch``); and where the time went
    (``seconds``, from the start)."""
    began = time.monotonic()
    pipeline = load_pipeline(spec["reference"])
    migration = pipeline.migration_from(spec["from_pipeline"])
    if migration is None:
        raise ValueError(f"{pipeline.name} declares no migration from {spec['from_pipeline']}")
    read = read_state(spark, path, batch)
    old = OldState({name: frame.cache() for name, frame in read.items()}, read.batch)  # read once for every figure
    try:
        params = resolve(pipeline.parameters, spec.get("parameters") or {})
        built = migration.build(old, params)
        check_columns(migration, built)
        checkpoint, base = Path(spec["checkpoint"]), int(spec.get("base", batch + 1))
        seed = seed_dir(checkpoint)
        built.write.mode("overwrite").parquet(str(seed))  # _SUCCESS last: query.initial_state reads only a whole seed
        seeded = spark.read.parquet(str(seed))
        check_keys(migration, seeded)
        result = {"from": spec["from_pipeline"], "target": pipeline.name, **migration_figures(migration, old, seeded)}
    finally:
        for frame in old.values():
            frame.unpersist()
    write_lineage(checkpoint, base, seeded=True, **(spec.get("lineage") or {}))
    seconds = {"migrated": time.monotonic() - began}
    if spec.get("first_batch"):
        limit = int(spec.get("sample_keys") or 0)
        if limit and result["keys_out"] > limit:
            result["first_batch"] = _sampled_first_batch(
                spark, spec, pipeline, migration, checkpoint, seeded, limit, base, seconds, began
            )
        else:
            result["first_batch"] = _first_batch(spark, spec, pipeline, checkpoint)
        seconds["first_batch"] = time.monotonic() - began
    return result | {"seconds": {k: round(v, 3) for k, v in seconds.items()}}


def _sampled_first_batch(
    spark: Any, spec: dict[str, Any], pipeline: Any, migration: Any, checkpoint: Path, seeded: DataFrame,
    limit: int, base: int, seconds: dict[str, float], began: float,
) -> dict[str, Any]:  # fmt: skip
    """A preview's first batch on part of a large migrated state: ``limit`` of its keys and every key the batch reads.
    Seeding costs about a millisecond a key (PySpark's transformWithState takes its initial state one key at a time
    over the state server's socket), so a preview on the whole of 100,000 keys took minutes. The keys the batch reads
    are found by running it first on no state, in a checkpoint beside: the keys it then holds state for. The batch's
    output on the part is what it is on the whole, for every key the batch reads; only the state's row counts are of
    the part, and the answer says so (``seeded``). (Run beside the migration's figures, on a thread, the first run
    saved nothing on two busy cores: both are CPU.)"""
    probe, part = checkpoint.with_name(f"{checkpoint.name}-keys"), checkpoint.with_name(f"{checkpoint.name}-part")
    try:
        _seed(probe, seeded.limit(0), base, spec)
        probed = _first_batch(spark, spec, pipeline, probe)
        seconds["probed"] = time.monotonic() - began
        if not probed["ran"]:
            return probed
        read = _keys_held(spark, probe, migration)
        if read is None:  # the operator's keys are not the migration's: the whole state, as without a sample
            return _first_batch(spark, spec, pipeline, checkpoint)
        key = list(migration.key)
        chosen = seeded.limit(limit).unionByName(seeded.join(read, key, "left_semi")).dropDuplicates(key)
        _seed(part, chosen, base, spec)
        seconds["part_seeded"] = time.monotonic() - began
        ran = _first_batch(spark, spec, pipeline, part)
        figures = {"keys": spark.read.parquet(str(seed_dir(part))).count(), "sampled": limit, "read": read.count()}
        return ran | {"seeded": figures}
    finally:
        for path in (probe, seed_dir(probe), part, seed_dir(part)):
            shutil.rmtree(path, ignore_errors=True)


def _seed(checkpoint: Path, state: DataFrame, base: int, spec: dict[str, Any]) -> None:
    """A scratch checkpoint with no batch, seeded with ``state`` (the same new line as the preview's own)."""
    shutil.rmtree(checkpoint, ignore_errors=True)
    state.write.mode("overwrite").parquet(str(seed_dir(checkpoint)))
    write_lineage(checkpoint, base, seeded=True, **(spec.get("lineage") or {}))


def _keys_held(spark: Any, checkpoint: Path, migration: Any) -> DataFrame | None:
    """The keys a checkpoint's batch 0 left state for (in any variable), as the migration's key columns; None when
    the state's keys are not those columns."""
    key = list(migration.key)
    frames = [
        frame.select(*(F.col(f"key.{name}").alias(name) for name in key))
        for _, _, frame in _readers(spark, str(checkpoint), 0)
        if "key" in frame.columns and set(key) <= set(getattr(frame.schema["key"].dataType, "names", ()))
    ]
    if not frames:
        return None
    held = frames[0]
    for frame in frames[1:]:
        held = held.unionByName(frame)
    return held.distinct()


def _first_batch(spark: Any, spec: dict[str, Any], pipeline: Any, checkpoint: Path) -> dict[str, Any]:
    """The new version's first batch on the seeded checkpoint (a scratch one: a preview), from ``spec["starting"]`` up
    to ``spec["ending"]``, one batch of at most ``spec["records"]`` entries: its output rows, a few results, and the
    state it holds after. A new version with no transformWithState operator is refused: Spark seeds no other."""
    job = _scratch_job(
        spec, f"migrate-{checkpoint.name}-{int(time.time())}", str(checkpoint), pipeline,
        starting_offset=json.dumps(spec["starting"]), ending_offset=json.dumps(spec["ending"]), available_now=True,
        max_records=int(spec.get("records", 1000)),
    )  # fmt: skip
    outputs: list[dict[str, Any]] = []

    def keep(frame: DataFrame, batch_id: int) -> None:
        if batch_id == 0:
            rows = frame.collect()
            shown = [{"kind": k, "key": key, "value": v} for k, key, v in pipeline.checked_results(rows)[0]]
            outputs.append({"rows": len(rows), "results": shown[:MIGRATION_SAMPLES]})

    query = start_query(spark, job, pipeline, keep)
    deadline = time.monotonic() + float(spec.get("timeout", 600))
    try:
        while query.isActive and not (checkpoint / "commits" / "0").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        query.stop()
    if failure := query.exception():
        raise RuntimeError(f"{pipeline.name}'s first batch on the migrated state failed: {describe(failure)}")
    if not (checkpoint / "commits" / "0").exists():
        return {"ran": False, "why": "no input after the batch to run a first batch on"}
    operators = spark.read.format("state-metadata").load(str(checkpoint)).collect()
    names = sorted({row["operatorName"] for row in operators})
    if not any("transformWithState" in name for name in names):
        raise ValueError(
            f"{pipeline.name} has no transformWithState operator ({', '.join(names) or 'no stateful operator'}): "
            "Spark seeds only a transformWithState operator with an initial state, so this state cannot be migrated "
            "into it"
        )
    state = {name: frame.count() for name, frame in read_state(spark, checkpoint, 0).items()}
    return {"ran": True, **(outputs[0] if outputs else {"rows": 0, "results": []}), "state": state}


FORMAT_VERSION = "spark.sql.streaming.stateStore.checkpointFormatVersion"


def checkpoint_format(root: Path) -> int:
    """2 when the newest commit records state file ids (RocksDB, format version 2), else 1. A shadow run's PATH holds
    two copies (old/, new/) of the same savepoint: the format of either."""
    for candidate in (root, root / "old"):
        commits = candidate / "commits"
        names = [p.name for p in commits.iterdir()] if commits.is_dir() else []
        batches = sorted(int(name) for name in names if name.isdigit())
        if batches:
            with open(commits / str(batches[-1])) as reader:
                return 2 if reader.readline().strip() == "v2" else 1
    return 1


# What the long-lived state reader (workers/spark/state_reader.py) answers: the commands that only read, the upgrade
# plan, which re-runs one batch on a scratch copy the console made for it, the migration's seed, and the repartition
# of a copy the console made (a rescale's, or green's fork).
READER_COMMANDS = ("verify", "partition-rows", "inspect", "plan", "migrate", "repartition")


def answer(
    spark: Any, command: str, path: str, number: int, spec: dict[str, Any],
    on_verdict: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One command on one checkpoint, read (and re-run) in the format it was written in: the memory store refuses
    format 2. ``on_verdict``: a plan's verdict at planning, before the batch's run (see ``plan``)."""
    spark.conf.set(FORMAT_VERSION, str(checkpoint_format(Path(path))))
    if command == "verify":
        return {"operators": state_counts(spark, path, number)}
    if command == "partition-rows":
        return {"batch": number, "operators": partition_rows(spark, path, number)}
    if command == "inspect":
        return {"batch": number, **inspect(spark, path, number, spec)}
    if command == "plan":
        return {"batch": number, **plan(spark, path, number, spec, on_verdict)}
    if command == "shadow":
        return {"batch": number, **shadow(spark, path, number, spec)}
    if command == "migrate":
        return {"batch": number, **migrate(spark, path, number, spec)}
    if command == "repartition":
        spark._streamingCheckpointManager.repartition(path, number)  # experimental in Spark 4.2+
        return {"repartitioned": number}
    raise ValueError(f"unknown command {command!r}")


def session(extra: dict[str, str] | None = None) -> Any:
    """The state tool's (and the warm reader's) session. A repartition writes the copy's new batch and state through
    the session's checkpoint file manager: Spark's file-system one, as a job's queries use (``local_files_conf``), so
    that its renames fork no `readlink` each (about 300 forks fewer a repartition of `orders-rocksdb`:
    docs/benchmarks.md). A plan's query sets its own, the same."""
    return build_session(
        "statekeeper-state-tool", "local[1]", backend="rocksdb", extra={**FILE_SYSTEM_MANAGER, **(extra or {})}
    )


def main(argv: list[str]) -> int:
    command, path, number = argv[1], argv[2], int(argv[3])
    spec = json.loads(argv[4]) if len(argv) > 4 else {}
    spark = session()
    try:
        result = answer(spark, command, path, number, spec)
    except Exception as exc:
        print(json.dumps({"error": describe(exc)}))
        return 2
    finally:
        spark.stop()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
