"""PySpark's `have_numpy` without pandas, numpy and pyarrow in every driver process.

`lit()` and the conversion of a Python value to a JVM one ask ``pyspark.testing.utils.have_numpy`` at each call.
Importing that module imports PySpark's test helpers, and with them pandas, numpy and pyarrow: about 85 MiB of
resident memory in a driver whose pipeline uses none of them (a url-counts job's own driver held 114 MiB of Python,
docs/benchmarks.md). The question it answers there is "could this value be a numpy one", and a value can be a numpy
one only once numpy is imported.

``install()`` puts stand-ins for ``pyspark.testing`` and ``pyspark.testing.utils`` in ``sys.modules``: their
``have_numpy`` is whether numpy is imported now, and any other name loads PySpark's real modules in their place and
gives theirs (``have_pandas`` for a pandas UDF, ``assertDataFrameEqual`` for a team's test). A pipeline that uses
pandas or numpy imports them itself, and then has them."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

PACKAGE = "pyspark.testing"
UTILS = "pyspark.testing.utils"


def install() -> None:
    """Put the stand-ins in place unless PySpark's test helpers are imported already (a test session's)."""
    if UTILS in sys.modules or PACKAGE in sys.modules:
        return
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:  # a PySpark without its test helpers
        return
    package = _stand_in(PACKAGE)
    package.__path__ = list(spec.submodule_search_locations or [])  # so its other modules import as before
    utils = _stand_in(UTILS)
    sys.modules[PACKAGE] = package
    sys.modules[UTILS] = utils


def _stand_in(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module._statekeeper_stand_in = True  # type: ignore[attr-defined]

    def __getattr__(attribute: str) -> Any:
        if attribute.startswith("__"):  # the import system's and inspect's questions: not a reason to load
            raise AttributeError(attribute)
        if attribute == "have_numpy" and name == UTILS:
            return "numpy" in sys.modules
        return getattr(_real(name), attribute)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    return module


def _real(name: str) -> types.ModuleType:
    for each in (UTILS, PACKAGE):
        if getattr(sys.modules.get(each), "_statekeeper_stand_in", False):
            del sys.modules[each]
    return importlib.import_module(name)
