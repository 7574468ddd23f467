"""Waiting for a condition, for tests and benchmarks that watch a real job."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(condition: Callable[[], Any], timeout: float = 60, every: float = 0.2, what: str = "condition") -> Any:
    """The condition's first truthy value; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
