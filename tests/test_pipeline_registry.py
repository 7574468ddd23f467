"""Pipelines are found by reference (settings and entry points); a broken one is refused with its module and reason,
and the rest still load."""

from __future__ import annotations

import sys
import types

import pytest

from dashboard import pipelines
from dashboard.services.enqueue import TASKS
from statekeeper.celery import app  # the app the workers and beat run


@pytest.fixture
def fresh_registry():
    pipelines.registry.cache_clear()
    yield
    pipelines.registry.cache_clear()


def test_the_shipped_pipelines_register_like_any_other(fresh_registry, settings):
    shipped = {
        "url-counts", "url-counts-live", "order-state-machine", "order-state-machine-v2", "count-window-average",
        "dedup", "minute-windows",
    }  # fmt: skip
    assert shipped <= set(pipelines.names())
    assert {pipelines.reference(name) for name in shipped} == set(settings.BUILTIN_PIPELINES)
    assert pipelines.registry().refused == ()


def test_a_broken_pipeline_is_refused_with_its_module_and_the_reason(fresh_registry, settings, monkeypatch):
    not_a_pipeline = types.ModuleType("user_jobs")
    not_a_pipeline.PIPELINE = types.SimpleNamespace(name="half", title="Half")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "user_jobs", not_a_pipeline)
    settings.PIPELINES = [*settings.BUILTIN_PIPELINES, "user_jobs:PIPELINE", "missing_package.jobs:PIPELINE", "nocolon"]
    refused = {r.reference: r.reason for r in pipelines.registry().refused}
    assert refused["user_jobs:PIPELINE"].startswith("not a pipeline: no description, payload, transform")
    assert "ModuleNotFoundError" in refused["missing_package.jobs:PIPELINE"]
    assert "module:attribute" in refused["nocolon"]
    assert "url-counts" in pipelines.names(), "the others still load"
    with pytest.raises(pipelines.UnknownPipeline, match="unknown pipeline 'half'"):
        pipelines.get("half")


def test_every_task_the_dashboard_queues_by_name_is_a_worker_task():
    app.loader.import_default_modules()
    assert set(TASKS) <= set(app.tasks), "a renamed task would leave its requests unread in the queue"
