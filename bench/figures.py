"""Figures the benchmarks compute the same way: when a batch was committed, and a percentile of a few samples.
Imported by the benchmarks after they have set Django up."""

from __future__ import annotations

from datetime import timedelta

from dashboard.models import Checkpoint


def committed(record: Checkpoint) -> float:
    """When the batch was committed: its trigger's time plus its duration."""
    return (record.committed_at + timedelta(milliseconds=record.duration_ms)).timestamp()


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile of a few samples, the nearest of them (the p95 of five is their maximum)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
