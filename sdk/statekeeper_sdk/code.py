"""Deprecated since 1.3, gone in 2.0: a deploy's code version is the console's business (``dashboard.engine.code``)."""

from __future__ import annotations

from typing import Any

_MOVED = frozenset({"CodeVersion", "code_files", "code_version", "installed_owners", "newest_change"})


def __getattr__(name: str) -> Any:
    from statekeeper_sdk._moved import moved

    return moved(__name__, "dashboard.engine.code", _MOVED, name)
