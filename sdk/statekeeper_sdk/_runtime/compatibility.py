"""Whether a new version of a pipeline runs on an old version's state: the verdict a console's upgrade preview gives,
and the test kit's ``check_upgrade`` gives offline from the same definition, so that a pull request sees what a
deploy would see.

A preview re-runs the old version's last committed batch with the new version on a copy of the checkpoint (Spark
checks the new code against the old state as a restart would, and writes the state schemas it would use), then
compares the state schemas before and after, operator by operator and state variable by state variable::

    result = {"before": operator_schemas(spark, copy, n), "after": ..., "output_rows": 12}
    verdicts = compare(result, old_pipeline, new_pipeline)
    summary(verdicts, "customer-spend-v2", n, 12)   # "Compatible with customer-spend-v2 at batch 7; ..."

A verdict is ``compatible`` (the same key and value), ``evolves`` (Spark's schema evolution reads the old values) or
``incompatible``, with the reason. Spark accepts a key whose columns were renamed but kept their types (it would read
every user's state as a region's); the comparison refuses it.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statekeeper_sdk._runtime.migration import declared_variables, has_timers, state_frames

COMPATIBLE, EVOLVES, INCOMPATIBLE = "compatible", "evolves", "incompatible"
TTL_FIELDS = ("value", "ttlExpirationMs")  # how Spark stores a value with a time to live: the value, its expiry


@dataclass
class Verdict:
    operator: str  # "<id> <name>", or "query" for the query as a whole
    variable: str  # the state variable, "timers", or "" for the operator as a whole
    verdict: str  # COMPATIBLE, EVOLVES or INCOMPATIBLE
    reason: str


def operator_schemas(spark: Any, path: str | Path, batch: int) -> list[dict[str, Any]]:
    """Each stateful operator of the checkpoint at ``path`` with its output mode and, per state variable, the key and
    value schemas (Spark's JSON form) Spark reads its state with at ``batch``."""
    operators: dict[int, dict[str, Any]] = {}
    for row, name, state in state_frames(spark, path, batch):
        props = json.loads(row["operatorProperties"]) if row["operatorProperties"] else {}
        entry = operators.setdefault(
            row["operatorId"],
            {"id": row["operatorId"], "name": row["operatorName"], "output_mode": props.get("outputMode", ""),
             "partitions": row["numPartitions"], "variables": {}, "time_mode": props.get("timeMode", ""),
             "timers": has_timers(props)},
        )  # fmt: skip
        fields: dict[str, Any] = {f.name: f.dataType for f in state.schema.fields}
        value = fields.get("value")
        declared = next((var for var in declared_variables(props) if var["stateName"] == name), {})
        ttl = bool(declared.get("ttlEnabled"))
        if ttl and value is not None and tuple(f.name for f in value.fields) == TTL_FIELDS:
            value = value["value"].dataType  # the value itself, without the expiry Spark keeps beside it
        entry["variables"][name] = {
            "key": fields["key"].jsonValue() if "key" in fields else None,
            "value": value.jsonValue() if value is not None else None,
            "type": declared.get("stateVariableType", ""),
            "ttl": ttl,
        }
    return list(operators.values())


def forget_batch(checkpoint: str | Path, batch: int) -> None:
    """Make a checkpoint copy plan ``batch`` again on its next start: its commit, and the operator metadata that names
    the state schema files, are removed, so the new code writes both again."""
    root = Path(checkpoint)
    for folder in [root / "commits", *root.glob("state/*/_metadata/v2")]:
        for name in (str(batch), f".{batch}.crc"):
            (folder / name).unlink(missing_ok=True)


def replayed(query: Any, checkpoint: str | Path, batch: int, timeout: float) -> str:
    """Wait for a query started on a copy that ``forget_batch`` prepared to commit ``batch`` again, then stop it;
    why it did not (Spark's refusal of the new code, the query's end, the time), or empty when it did."""
    deadline = time.monotonic() + timeout
    try:
        while not (Path(checkpoint) / "commits" / str(batch)).exists():
            if not query.isActive:
                failure = query.exception()
                return describe(failure) if failure is not None else "the query stopped"
            if time.monotonic() > deadline:
                return f"the batch did not commit within {timeout:g} s"
            time.sleep(0.2)
        return ""
    finally:
        query.stop()


def _leaves(data_type: Any, path: str, found: dict[str, str]) -> dict[str, str]:
    """Every leaf of a Spark type (its JSON form) by path: ``customer.id``, ``items[].price``, ``tags{}`` (a map's
    values; its keys at ``tags{key}``), with the leaf's type."""
    if isinstance(data_type, dict) and data_type.get("type") == "struct":
        for field in data_type.get("fields", []):
            _leaves(field["type"], f"{path}.{field['name']}" if path else field["name"], found)
    elif isinstance(data_type, dict) and data_type.get("type") == "array":
        _leaves(data_type.get("elementType"), f"{path}[]", found)
    elif isinstance(data_type, dict) and data_type.get("type") == "map":
        _leaves(data_type.get("keyType"), f"{path}{{key}}", found)
        _leaves(data_type.get("valueType"), f"{path}{{}}", found)
    else:
        found[path] = data_type if isinstance(data_type, str) else json.dumps(data_type, sort_keys=True)
    return found


def _columns(schema: dict[str, Any] | None) -> dict[str, str]:
    """A struct schema's leaves as path -> type, nested fields by their path (``window.start``, ``items[].qty``)."""
    return _leaves(schema, "", {}) if schema else {}


def _differences(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """What changed between two schemas' leaves, each named by its path."""
    changes = [f"added {path} {new[path]}" for path in new if path not in old]
    changes += [f"removed {path}" for path in old if path not in new]
    changes += [f"{path} {old[path]} → {new[path]}" for path in old if path in new and old[path] != new[path]]
    return changes or (["fields reordered"] if list(old) != list(new) else [])


def _variable_verdict(operator: str, name: str, before: dict[str, Any], after: dict[str, Any]) -> Verdict:
    if bool(before.get("ttl")) != bool(after.get("ttl")):
        change = "a TTL added" if after.get("ttl") else "its TTL removed"
        return Verdict(
            operator, name, INCOMPATIBLE,
            f"{change}: Spark stores a value with a TTL beside its expiry, so the stored values' layout changes",
        )  # fmt: skip
    old_key, new_key = _columns(before["key"]), _columns(after["key"])
    if list(old_key.items()) != list(new_key.items()):
        return Verdict(
            operator, name, INCOMPATIBLE,
            f"key schema changed ({'; '.join(_differences(old_key, new_key))}): the old state would be read under "
            "new keys",
        )  # fmt: skip
    old_value, new_value = _columns(before["value"]), _columns(after["value"])
    if list(old_value.items()) == list(new_value.items()):
        ttl = " (values expire: TTL)" if after.get("ttl") else ""
        return Verdict(operator, name, COMPATIBLE, f"same key and value schema{ttl}")
    return Verdict(
        operator, name, EVOLVES,
        "Spark's schema evolution reads the old values: " + ", ".join(_differences(old_value, new_value)),
    )  # fmt: skip


def compare(result: dict[str, Any], old: Any, new: Any) -> list[Verdict]:
    """Verdicts per operator and state variable, from a replay's result (``before`` and ``after``: the
    ``operator_schemas`` of the copy before and after the new version re-ran its batch, or ``replay_error``: why
    Spark refused it) and the two pipelines (``old`` may be None: a pipeline no longer installed)."""
    verdicts = []
    if old is not None and old.output_mode != new.output_mode:
        verdicts.append(
            Verdict("query", "", INCOMPATIBLE, f"output mode changed: {old.output_mode} → {new.output_mode}")
        )
    if refused := result.get("real_time_refusal"):  # a real-time job's new version that Spark cannot run so
        verdicts.append(
            Verdict("query", "", INCOMPATIBLE, f"Spark's real-time mode refuses the new version: {refused}")
        )
        return verdicts
    if error := result.get("replay_error"):
        verdicts.append(Verdict("query", "", INCOMPATIBLE, f"Spark refused the new version on this state: {error}"))
        return verdicts
    before = {op["id"]: op for op in result["before"]}
    after = {op["id"]: op for op in result["after"]}
    for op_id in sorted(before.keys() | after.keys()):
        label = f"{op_id} {(before.get(op_id) or after[op_id])['name']}"
        if op_id not in after:
            verdicts.append(Verdict(label, "", INCOMPATIBLE, "operator removed: its state would be left behind"))
            continue
        if op_id not in before:
            verdicts.append(Verdict(label, "", INCOMPATIBLE, "operator added: it has no state to start from"))
            continue
        if before[op_id]["name"] != after[op_id]["name"]:
            verdicts.append(
                Verdict(label, "", INCOMPATIBLE, f"operator replaced by {after[op_id]['name']} at the same place")
            )
            continue
        old_mode, new_mode = before[op_id].get("time_mode", ""), after[op_id].get("time_mode", "")
        if old_mode != new_mode:
            verdicts.append(
                Verdict(label, "timers", INCOMPATIBLE, f"time mode changed: {old_mode or 'none'} → {new_mode or 'none'}; "
                        "the registered timers are kept in the old mode's index and would never fire")
            )  # fmt: skip
        elif before[op_id].get("timers") or after[op_id].get("timers"):
            kept = before[op_id].get("timers") and after[op_id].get("timers")
            verdicts.append(
                Verdict(label, "timers", COMPATIBLE,
                        f"{new_mode} timers: the registered ones are kept and fire in the new version"
                        if kept else f"{new_mode} timers: the new version registers its first ones")
            )  # fmt: skip
        old_vars, new_vars = before[op_id]["variables"], after[op_id]["variables"]
        for name in sorted(old_vars.keys() | new_vars.keys()):
            if name not in new_vars:
                verdicts.append(Verdict(label, name, INCOMPATIBLE, "state variable removed: its state would be lost"))
            elif name not in old_vars:
                verdicts.append(Verdict(label, name, COMPATIBLE, "new state variable: it starts empty"))
            else:
                verdicts.append(_variable_verdict(label, name, old_vars[name], new_vars[name]))
    return verdicts


def parameter_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Each parameter whose value differs, as ``name: old → new`` (``—`` where one side has none).

    >>> parameter_changes({"window_minutes": 60}, {"window_minutes": 30, "threshold": 80.0})
    ['threshold: — → 80.0', 'window_minutes: 60 → 30']
    """
    return [
        f"{name}: {before.get(name, '—')} → {after.get(name, '—')}"
        for name in sorted(set(before) | set(after))
        if before.get(name) != after.get(name)
    ]


def described(pipeline: str, before: dict[str, Any], after: dict[str, Any]) -> str:
    """An upgrade's target as an operator reads it: the pipeline, and the parameters that change.

    >>> described("customer-spend-v2", {"window_minutes": 60}, {"window_minutes": 30})
    'customer-spend-v2 (window_minutes: 60 → 30)'
    """
    changes = parameter_changes(before, after)
    return f"{pipeline} ({', '.join(changes)})" if changes else pipeline


def summary(verdicts: list[Verdict], shown: str, batch: int, output_rows: int | None) -> str:
    """The preview's verdict in a sentence: what is incompatible and why, or that it is compatible at ``batch``.
    ``output_rows`` None: the verdict comes from Spark's planning of the replayed batch, which has not finished its
    run yet (the console shows it so, then the sentence with the batch's rows).

    >>> summary([Verdict("0 agg", "default", COMPATIBLE, "same key and value schema")], "v2", 7, None)
    'Compatible with v2 at batch 7, as Spark planned the replayed batch; its run on the copy is not over yet.'
    """
    if bad := [v for v in verdicts if v.verdict == INCOMPATIBLE]:
        return f"Incompatible with {shown}: " + "; ".join(
            f"{' '.join(filter(None, (v.operator, v.variable)))}: {v.reason}" for v in bad
        )
    evolving = sum(v.verdict == EVOLVES for v in verdicts)
    return (
        f"Compatible with {shown} at batch {batch}"
        + (f" ({evolving} state variable(s) through Spark's schema evolution)" if evolving else "")
        + (
            f"; the replayed batch produced {output_rows} result rows."
            if output_rows is not None
            else ", as Spark planned the replayed batch; its run on the copy is not over yet."
        )
    )


def describe(exc: BaseException) -> str:
    """A query's failure as an operator can act on it: for a JVM error the root Java exception (it names the file or
    setting at fault), not Py4J's wrapper; for an error raised in Python code the JVM called (a ``foreachBatch``
    function, a count in it), the Python error the traceback ends with, not the proxy's "An exception was raised by
    the Python Proxy".

    >>> describe(RuntimeError("An exception was raised by the Python Proxy. Return Message: Traceback (most recent "
    ...     "call last):\\n  File \\"job.py\\", line 3, in fb\\n    raise ValueError(\\"no key\\")\\nValueError: no key\\n"))
    'ValueError: no key'
    """
    java = getattr(exc, "java_exception", None)
    if java is not None:
        cause = java
        while cause.getCause() is not None:
            cause = cause.getCause()
        text = str(cause.toString())
        return (_python_error(text) or text)[:2000]
    text = str(exc)
    return (_python_error(text) or (text.splitlines() or [repr(exc)])[0])[:2000]


# The line a Python traceback ends with: the error's class (dotted or not), then its message. The console reads
# failures with it too (dashboard.failures).
PYTHON_ERROR = re.compile(r"^(?P<cls>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))(?::\s*(?P<msg>.*))?$")


def python_error(line: str) -> tuple[str, str] | None:
    """A Python error line's class (its module dropped) and message; None when the line is not one."""
    if (m := PYTHON_ERROR.match(line.strip())) is None:
        return None
    return m["cls"].rsplit(".", 1)[-1], (m["msg"] or "").strip()


def _python_error(text: str) -> str:
    """The error line the (last) Python traceback in a py4j proxy's message ends with, its class without its module;
    empty when the text holds no traceback. What follows that line (Spark's description of the query) is not read."""
    if "Traceback (most recent call last):" not in text:
        return ""
    lines = text.split("Traceback (most recent call last):")[-1].splitlines()
    found = [f"{cls}: {msg}" if msg else cls for line in lines if (error := python_error(line)) for cls, msg in [error]]
    return found[0] if found else ""
