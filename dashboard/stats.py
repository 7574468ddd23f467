"""Statistics the pages and reviews share."""

from __future__ import annotations

import math
from collections.abc import Iterable


def quantile(values: Iterable[float], q: float) -> float:
    """The q-quantile by linear interpolation between closest ranks, as PostgreSQL's percentile_cont."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("the quantile of no values")
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
