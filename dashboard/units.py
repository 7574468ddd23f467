"""Sizes as the console writes them, on its pages and in its messages alike."""

from __future__ import annotations


def bytes_h(value: float | int | None) -> str:
    """A byte count in the largest binary unit under 1024 of it, one decimal: 2147483648 → "2.0 GB"."""
    if value is None:
        return "–"
    size = float(value)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(size) < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TB"
