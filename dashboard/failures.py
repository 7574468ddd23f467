"""What a failure was, under its wrappers: Spark wraps a Python error in py4j's proxy text, the JVM wraps it again
in its own exceptions. The operator wants the innermost error class and message first."""

from __future__ import annotations

import re

from statekeeper_sdk._runtime.compatibility import python_error

from dashboard.checkpoint_dir.files import PlannedBatch
from dashboard.records import offset_text

JVM_CAUSE = re.compile(r"^\s*Caused by:\s*(?P<cls>[\w.$]+)(?::\s*(?P<msg>.*))?$")
# Wrappers that say that something failed, not what.
WRAPPERS = (
    "Py4JJavaError",
    "Py4JError",
    "StreamingQueryException",
    "PythonException",
    "SparkException",
    "ExecutionException",
    "InvocationTargetException",
    "UndeclaredThrowableException",
)
BOILERPLATE = ("An exception was raised by the Python Proxy", "Return Message:", "Traceback (most recent call last)")


def _wrapper(cls: str) -> bool:
    return cls.rsplit(".", 1)[-1] in WRAPPERS


def root_cause(text: str) -> str:
    """The innermost error as "Class: message", from a trace in any of Python's, py4j's or the JVM's shapes; the first
    meaningful line when no error line is found."""
    python, jvm = [], []
    for line in text.splitlines():
        if error := python_error(line):
            python.append(error)
        elif m := JVM_CAUSE.match(line):
            jvm.append((m["cls"], (m["msg"] or "").strip()))
    # an error line outside a Python traceback is the JVM's own exception, the first line of its trace
    for found in (python, jvm) if "Traceback (most recent call last)" in text else (jvm, python):
        inner = [c for c in found if not _wrapper(c[0])]
        if inner:
            cls, msg = inner[-1]
            return f"{cls.rsplit('.', 1)[-1]}: {msg}" if msg else cls.rsplit(".", 1)[-1]
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(BOILERPLATE)]
    return lines[0] if lines else ""


def signature(cause: str) -> str:
    """A root cause with its numbers and quoted values blanked: the same failure on another entry counts as a
    repeat."""
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", cause))


def describe(text: str, planned: PlannedBatch | None) -> str:
    """The operator's line for a failed run: the batch and the entries it was reading, when known, then the cause."""
    cause = root_cause(text) or "no error was reported"
    if planned is None:
        return cause
    entries = f", {planned.entries:,} entries" if planned.entries is not None else ""
    if "id" in planned.after or "id" in planned.upto:  # a Redis stream's entry ids
        where = f"entries after {planned.after.get('id', '?')} up to {planned.upto.get('id', '?')}{entries}"
    else:  # each Kafka partition's offsets
        where = f"records after {offset_text(planned.after)} up to {offset_text(planned.upto)}"
    return f"Batch {planned.batch} failed ({where}): {cause}"
