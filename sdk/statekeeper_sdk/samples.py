"""Deprecated since 1.5, gone in 2.0: making sample events for a pipeline (the demo producer's, a standby's warm-up)
is the console's business (``dashboard.engine.samples``); a pipeline declares its ``generator`` or ``samples`` file."""

from __future__ import annotations

from typing import Any

_MOVED = frozenset({"sample_events"})


def __getattr__(name: str) -> Any:
    from statekeeper_sdk._moved import moved

    return moved(__name__, "dashboard.engine.samples", _MOVED, name, since="1.5")
