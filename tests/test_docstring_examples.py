"""The ``>>>`` examples in the console's own docstrings run as written (the SDK's run in test_sdk.py): an example
that went stale with its function fails here."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import dashboard


def _modules() -> list[str]:
    return [
        m.name
        for m in pkgutil.walk_packages(dashboard.__path__, "dashboard.")
        if ".migrations." not in m.name and not m.name.endswith(".migrations")
    ]


@pytest.mark.django_db
def test_the_consoles_docstring_examples_run_as_written():
    attempted = 0
    for name in _modules():
        result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, f"{name}: {result.failed} example(s) failed"
        attempted += result.attempted
    assert attempted >= 5, "the console's examples were found"
