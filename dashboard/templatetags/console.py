"""Formatting for the console: byte sizes and durations the way Flink's UI writes them."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from django import template
from django.utils import timezone

from dashboard import units
from dashboard.records import offset_text

register = template.Library()


@register.filter
def bytes_h(value: float | int | None) -> str:
    return units.bytes_h(value)


@register.filter
def lag_count(job: Any, count: int) -> str:
    """``{{ job|lag_count:n }}``: what the job's lag counts, in words ("1 file", "60 records"), as its alerts say it."""
    return str(job.lag_count(count))


@register.filter
def ms_h(value: float | int | None) -> str:
    if value is None:
        return "–"
    ms = float(value)
    if ms < 1000:
        return f"{ms:.0f}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{int(seconds)}s {int(ms % 1000)}ms"
    return f"{int(seconds // 60)}m {int(seconds % 60)}s"


@register.filter
def age(value: datetime | None) -> str:
    if value is None:
        return "never"
    seconds = max(0, (timezone.now() - value).total_seconds())
    if seconds < 60:
        return f"{seconds:.0f}s ago"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m ago"
    if seconds < 86400:
        return f"{seconds // 3600:.0f}h ago"
    return f"{seconds // 86400:.0f}d ago"


@register.filter
def stat(value: float | None, unit: str) -> str:
    if value is None:
        return "–"
    if unit == "bytes":
        return bytes_h(value)
    if unit == "ms":
        return ms_h(value)
    return f"{value:,.0f}"


@register.filter
def offset_id(value: object) -> str:
    return offset_text(value)


@register.filter
def compact_json(value: object) -> str:
    """A result value as one line of JSON; "–" for none."""
    return "–" if value is None else json.dumps(value, separators=(", ", ": "), sort_keys=True, default=str)


@register.filter
def get_item(mapping: dict[object, object], key: object) -> object:
    return mapping.get(key)


@register.filter
def make_list_words(value: str) -> list[str]:
    return value.split()


@register.filter
def partition_json(rows: list[Any]) -> list[dict[str, Any]]:
    """The partition rows as plain data for the chart."""
    return [dict(vars(r)) for r in rows]


@register.filter
def duration_h(seconds: float | int | None) -> str:
    """Seconds as 0s, 42s, 3m 20s, 2h 5m."""
    if seconds is None:
        return "–"
    total = int(seconds)
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m {total % 60}s"
    return f"{total // 3600}h {total % 3600 // 60}m"


@register.filter
def ms_moment(value: int | None) -> str:
    """Epoch milliseconds (a timer's firing time, a TTL's expiry) as a UTC time and how far off it is."""
    if value is None:
        return "–"
    moment = datetime.fromtimestamp(int(value) / 1000, UTC)
    delta = (moment - timezone.now()).total_seconds()
    off = f"in {duration_h(delta)}" if delta >= 0 else f"{duration_h(-delta)} ago"
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC ({off})"
