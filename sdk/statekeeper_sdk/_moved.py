"""Names the console's engine used from the SDK (before 1.3; ``samples`` before 1.5), deprecated here: they now live in the console
(``dashboard.engine``), since a pipeline declares its sinks and never writes them. Inside a console they still
resolve, with a DeprecationWarning; they leave the SDK in 2.0."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def moved(module: str, engine: str, names: frozenset[str], name: str, since: str = "1.3") -> Any:
    """A module ``__getattr__``'s answer for ``name`` of ``module``, which moved to the console's ``engine`` module."""
    if name not in names:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(
        f"{module}.{name} is deprecated since statekeeper-sdk {since} and leaves in 2.0: it is the console's engine "
        f"({engine}), not part of what a pipeline declares",
        DeprecationWarning,
        stacklevel=3,
    )
    try:
        return getattr(importlib.import_module(engine), name)
    except ImportError:
        raise AttributeError(
            f"{module}.{name} moved to the Statekeeper console ({engine}), which is not installed here"
        ) from None


def to_runtime(module: str, names: set[str]) -> Callable[[str], Any]:
    """A public module's ``__getattr__`` for its ``names`` that moved to ``statekeeper_sdk._runtime`` in 1.7: each
    still resolves there, with a DeprecationWarning, until 2.0."""
    runtime = f"statekeeper_sdk._runtime.{module.rsplit('.', 1)[-1]}"
    moved_names = frozenset(names)

    def __getattr__(name: str) -> Any:
        return moved(module, runtime, moved_names, name, since="1.7")

    return __getattr__
