"""The pipeline registry: every pipeline the console can run, found by reference, never by importing worker code.

A pipeline is any object with the fields the console reads (below) and the ones a driver runs (``payload``,
``transform``, ``output_mode``, ``results``, ``conf``); the shipped ones are ``workers.spark.pipelines.base.Pipeline``
records. References come from ``settings.PIPELINES`` ("module:attribute") and the entry-point group
``statekeeper.pipelines``. One that fails to import or lacks a field is refused with the module and the reason, and
kept out of the registry; the rest still load.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points, packages_distributions, version
from typing import Any

from django.conf import settings

ENTRY_POINT_GROUP = "statekeeper.pipelines"
# What the console and its driver read from a pipeline; a missing one is refused at registration, not at run time.
REQUIRED = ("name", "title", "description", "payload", "transform", "output_mode", "results", "generator", "views")
CALLABLE = ("transform", "results", "generator")


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


@dataclass(frozen=True)
class CodeVersion:
    """Which code a pipeline is: where it was found, the installed distribution that holds it, and a hash of its
    module's source (so an edit without a version bump is still seen)."""

    reference: str
    package: str
    code_hash: str


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
        if reason := check(pipeline):
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


def reference(name: str) -> str:
    get(name)
    return registry().references[name]


def code_version(name: str) -> CodeVersion:
    """The code the registered pipeline ``name`` runs, as imported in this process."""
    ref = reference(name)
    module = sys.modules[ref.partition(":")[0]]
    source = module.__spec__.origin if module.__spec__ and module.__spec__.origin else ""
    try:
        with open(source, "rb") as handle:
            digest = hashlib.sha256(handle.read()).hexdigest()
    except OSError:
        digest = "unknown"
    top = module.__name__.partition(".")[0]
    dists = packages_distributions().get(top, [])
    package = f"{dists[0]} {version(dists[0])}" if dists else ""
    return CodeVersion(ref, package, digest)
