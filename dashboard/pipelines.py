"""The pipeline registry: every pipeline the console can run, found by reference, never by importing worker code.

A pipeline is any object with the fields the console reads (below) and the ones a driver runs (``payload``,
``transform``, ``output_mode``, ``results``, ``conf``, ``parameters``); packages build them with the SDK's
``statekeeper_sdk.Pipeline`` (``sdk/``). References come from ``settings.PIPELINES`` ("module:attribute") and the
entry-point group ``statekeeper.pipelines``. One that fails to import, lacks a field, or comes from a package built for
an SDK major this console does not support is refused with the module and the reason, and kept out of the registry;
the rest still load.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points, requires, version
from pathlib import Path
from typing import Any

import pyspark
import statekeeper_sdk
from django.conf import settings
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from statekeeper_sdk import FileSink, KafkaSink, resolve

from dashboard.engine.code import CodeVersion, installed_owners
from dashboard.engine.code import code_version as module_code_version
from dashboard.kafka import security_problems

ENTRY_POINT_GROUP = "statekeeper.pipelines"
# What the console and its driver read from a pipeline; a missing one is refused at registration, not at run time.
REQUIRED = ("name", "title", "description", "payload", "transform", "output_mode", "results", "views")
CALLABLE = ("transform", "results")
SDK_DISTRIBUTION = "statekeeper-sdk"


class UnknownPipeline(KeyError):
    pass


@dataclass(frozen=True)
class Refused:
    reference: str
    reason: str


@dataclass(frozen=True)
class Registry:
    pipelines: dict[str, Any]
    refused: tuple[Refused, ...]
    references: dict[str, str]  # name -> module:attribute


def _load(reference: str) -> Any:
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ValueError("expected module:attribute")
    return getattr(importlib.import_module(module_name), attribute)


def check(pipeline: Any) -> str:
    """Why this object cannot be a pipeline; empty when it can."""
    missing = [name for name in REQUIRED if not hasattr(pipeline, name)]
    if missing:
        return f"not a pipeline: no {', '.join(missing)}"
    not_callable = [name for name in CALLABLE if not callable(getattr(pipeline, name))]
    if not_callable:
        return f"{', '.join(not_callable)} must be callable"
    if not isinstance(pipeline.name, str) or not pipeline.name:
        return "its name must be a non-empty string"
    if pipeline.output_mode not in ("append", "update", "complete"):
        return f"output_mode must be append, update or complete, not {pipeline.output_mode!r}"
    if getattr(pipeline, "generator", None) is not None and not callable(pipeline.generator):
        return "generator must be callable"
    return ""


def sdk_refusal(module_name: str) -> str:
    """Why the package holding this module cannot run here: it declares an SDK range that excludes the SDK this
    console ships (its major, the only thing that may break a package). Empty when it can, or declares none."""
    dists = installed_owners().get(module_name.partition(".")[0], [])
    if not dists:
        return ""
    for text in requires(dists[0]) or []:
        wanted = Requirement(text)
        if canonicalize_name(wanted.name) != SDK_DISTRIBUTION or (wanted.marker and not wanted.marker.evaluate()):
            continue
        if not wanted.specifier.contains(statekeeper_sdk.__version__, prereleases=True):
            return (
                f"{dists[0]} {version(dists[0])} is built for {SDK_DISTRIBUTION}{wanted.specifier}; this console "
                f"supports {SDK_DISTRIBUTION} {statekeeper_sdk.MAJOR}.x (it has {statekeeper_sdk.__version__}): "
                f"rebuild the package against {SDK_DISTRIBUTION}>={statekeeper_sdk.MAJOR},<{statekeeper_sdk.MAJOR + 1}"
            )
    return ""


def _references() -> list[str]:
    found = list(settings.PIPELINES)
    found += [f"{ep.module}:{ep.attr}" for ep in entry_points(group=ENTRY_POINT_GROUP)]
    return list(dict.fromkeys(found))


@cache
def registry() -> Registry:
    pipelines: dict[str, Any] = {}
    references: dict[str, str] = {}
    refused: list[Refused] = []
    for reference in _references():
        try:
            pipeline = _load(reference)
        except Exception as exc:  # a user's module: whatever it raises is reported, not raised into the console
            refused.append(Refused(reference, f"{type(exc).__name__}: {exc}"))
            continue
        if reason := check(pipeline) or sdk_refusal(reference.partition(":")[0]):
            refused.append(Refused(reference, reason))
        elif pipeline.name in pipelines:
            refused.append(Refused(reference, f"the name {pipeline.name!r} is taken by another pipeline"))
        else:
            pipelines[pipeline.name] = pipeline
            references[pipeline.name] = reference
    return Registry(pipelines, tuple(refused), references)


def names() -> list[str]:
    return list(registry().pipelines)


def find(name: str) -> Any | None:
    """The pipeline, or None when it is not registered (a job whose pipeline was uninstalled is still shown)."""
    return registry().pipelines.get(name)


def get(name: str) -> Any:
    pipeline = find(name)
    if pipeline is None:
        raise UnknownPipeline(f"unknown pipeline {name!r}; the registry has {', '.join(sorted(names())) or 'none'}")
    return pipeline


def migration(target: str, source: str) -> Any | None:
    """The state migration ``target`` declares from ``source``'s state (``statekeeper_sdk.Migration``), or None."""
    found = getattr(find(target), "migration_from", None)
    return found(source) if found is not None else None


def reference(name: str) -> str:
    get(name)
    return registry().references[name]


def code_version(name: str) -> CodeVersion:
    """The code the registered pipeline ``name`` runs: the files of its distribution as they are on disk now."""
    ref = reference(name)
    return module_code_version(sys.modules[ref.partition(":")[0]], ref)


CONSOLE_DISTRIBUTION = "statekeeper"  # the console's own: the built-in pipelines are in it


def whose_code(name: str, version: CodeVersion) -> str:
    """Whose code changes when the pipeline's does: a built-in pipeline's hash covers the console's whole distribution
    (dashboard/, workers/, statekeeper/), so any change to the console changes it, and a message should say so."""
    if version.package.partition(" ")[0] == CONSOLE_DISTRIBUTION:
        return f"the console's code (which holds the built-in pipeline {name!r})"
    return f"the code of {name!r}"


def family(name: str) -> str:
    """The first version of the pipeline ``name``: following ``version_of`` (``customer-spend-v2`` is a version of
    ``customer-spend``) as far as the registry has it."""
    seen = [name]
    while (
        (found := find(seen[-1])) is not None and (earlier := getattr(found, "version_of", "")) and earlier not in seen
    ):
        seen.append(earlier)
    return seen[-1]


@dataclass(frozen=True)
class ResultBound:
    """How many rows of one kind the results table keeps: the rows its latest batches wrote, ``rows`` at most, and
    none that no batch has written for ``hours``. Set by the pipeline's view, else the console's default count."""

    rows: int | None
    hours: float | None

    def __str__(self) -> str:
        parts = [f"the newest {self.rows:,} rows" if self.rows else "", f"rows written in the last {self.hours:g} h"
                 if self.hours else ""]  # fmt: skip
        return " and ".join(p for p in parts if p)


def result_bound(pipeline: Any, kind: str) -> ResultBound:
    """What the results table keeps of ``kind`` for a job of ``pipeline`` (None: a pipeline no longer registered)."""
    view = next((v for v in getattr(pipeline, "views", ()) if v.kind == kind), None)
    rows, hours = getattr(view, "keep_rows", None), getattr(view, "keep_hours", None)
    if rows is None and hours is None:
        rows = settings.RESULTS_KEEP_ROWS
    return ResultBound(rows, hours)


def sink_targets(name: str, values: dict[str, Any]) -> dict[str, str]:
    """Where each sink of a job of pipeline ``name`` writes with these values (its name: where), the ones that are off
    left out; empty when the pipeline or its targets cannot be bound."""
    try:
        return {s.name: f"{s.kind}: {s.where()}" for s in bound_sinks(name, values) if not s.off()}
    except (UnknownPipeline, ValueError):
        return {}


def parameter_values(name: str, given: dict[str, Any]) -> dict[str, Any]:
    """Every parameter's value for a job of pipeline ``name``: the given ones, checked, and defaults for the rest.
    ValueError with one problem per line."""
    return dict(resolve(getattr(get(name), "parameters", ()) or (), given))


def values_or_stored(name: str, given: dict[str, Any]) -> dict[str, Any]:
    """``parameter_values``, or the given values as stored when the pipeline is no longer registered or they no longer
    fit it (a page still shows them)."""
    try:
        return parameter_values(name, given)
    except (UnknownPipeline, ValueError):
        return dict(given)


def kafka_connector() -> bool:
    """Whether Spark's Kafka connector is on the class path: in pyspark's own jars, or in STATEKEEPER_SPARK_JARS."""
    listed = [Path(p.strip()).name for p in os.environ.get("STATEKEEPER_SPARK_JARS", "").split(",") if p.strip()]
    shipped = [p.name for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar")]
    return any(name.startswith("spark-sql-kafka") for name in listed + shipped)


def bound_sinks(name: str, values: dict[str, Any]) -> list[Any]:
    """The sinks a job of pipeline ``name`` writes to, with its parameter values in their targets."""
    return list(get(name).outputs(values))


def sink_problems(name: str, values: dict[str, Any]) -> list[str]:
    """Why a job of pipeline ``name`` with these parameter values could not write its output, one line each: a target
    naming an undeclared parameter, a file sink's relative directory, a Kafka sink without Spark's Kafka connector."""
    problems = []
    try:
        sinks = bound_sinks(name, values)
    except ValueError as exc:
        return [str(exc)]
    for sink in sinks:
        if sink.off():
            continue
        # a directory that a secret names is known at the job's start only, where its driver checks it again
        if isinstance(sink, FileSink) and "${secret:" not in sink.path:
            if not Path(sink.path).is_absolute():
                problems.append(f"sink {sink.name}: its directory must be an absolute path, not {sink.path!r}")
            elif not under_roots(Path(sink.path), settings.FILE_SINK_ROOTS):
                problems.append(
                    f"sink {sink.name}: files are written only under {', '.join(map(str, settings.FILE_SINK_ROOTS))} "
                    f"(STATEKEEPER_FILE_SINK_ROOTS), not to {sink.path}"
                )
        elif isinstance(sink, KafkaSink):
            if not kafka_connector():
                problems.append(
                    f"sink {sink.name}: Spark's Kafka connector is not on the class path (the pyspark wheel does not "
                    "ship it): put the spark-sql-kafka-0-10 jars in STATEKEEPER_SPARK_JARS, or use another sink"
                )
            problems += [f"sink {sink.name}: {problem}" for problem in security_problems(sink.security)]
    return problems


def under_roots(path: Path, roots: list[Path]) -> bool:
    """Whether ``path``, resolved (``..`` and symbolic links followed), is one of ``roots`` or lies under one."""
    resolved = path.resolve()
    return any(resolved == root or root in resolved.parents for root in roots)


def parse_parameters(text: str) -> dict[str, Any]:
    """Parameter values as an operator types them: ``name = value`` lines (``#`` starts a comment; the value is
    checked against the parameter's type later) or a JSON object. ValueError naming what is wrong."""
    text = text.strip()
    if len(text) > 20_000:
        raise ValueError("Parameters are at most 20,000 characters.")
    if text.startswith("{"):
        try:
            found = json.loads(text)
        except (ValueError, RecursionError):
            raise ValueError("Parameters that start with { must be a JSON object.") from None
        if not isinstance(found, dict):
            raise ValueError("Parameters must be a JSON object.")
        return found
    values: dict[str, Any] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if not line:
            continue
        name, equals, value = line.partition("=")
        name = name.strip()
        if not equals or not name.isidentifier():
            raise ValueError(f"Line {number}: write name = value (e.g. window_minutes = 10).")
        if name in values:
            raise ValueError(f"Line {number}: {name} is set twice.")
        values[name] = value.strip()
    return values


def format_parameters(values: dict[str, Any], pipeline: str = "") -> str:
    """Values as ``name = value`` lines, in the order the pipeline declares them (a JSON column keeps no order)."""
    declared = [p.name for p in getattr(find(pipeline), "parameters", ()) or ()] if pipeline else []
    order = {name: i for i, name in enumerate(declared)}
    return "\n".join(
        f"{name} = {str(value).lower() if isinstance(value, bool) else value}"
        for name, value in sorted(values.items(), key=lambda item: (order.get(item[0], len(order)), item[0]))
    )
