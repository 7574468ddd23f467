"""The pipelines catalog: each pipeline is a module of its own with a pure transform and its event generator."""

from __future__ import annotations

from workers.pipelines import count_window_average, dedup, minute_windows, order_state_machine, url_counts
from workers.pipelines.base import Pipeline

CATALOG: dict[str, Pipeline] = {
    p.PIPELINE.name: p.PIPELINE for p in (url_counts, order_state_machine, count_window_average, dedup, minute_windows)
}


def get(name: str) -> Pipeline:
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"unknown pipeline {name!r}; the catalog has {', '.join(sorted(CATALOG))}") from None
