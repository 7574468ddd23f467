"""Statekeeper's pipeline SDK: what a pipeline package imports to be run, savepointed, upgraded and rolled back by
the console. It depends on PySpark only.

    from statekeeper_sdk import Parameter, Pipeline, PayloadFormat, ResultView

Register a ``Pipeline`` under the ``statekeeper.pipelines`` entry-point group of your package, and declare
``statekeeper-sdk>=1,<2`` among its dependencies: the console refuses a package built for an SDK major it does not
support, with the reason.
"""

from statekeeper_sdk.events import Limits, Rejected, parse_id
from statekeeper_sdk.migration import Migration, OldState
from statekeeper_sdk.nested import SchemaError, parse_ddl
from statekeeper_sdk.payload import Field, PayloadFormat
from statekeeper_sdk.pipeline import Parameter, Params, Pipeline, Result, ResultRecord, ResultView, apply, resolve
from statekeeper_sdk.sinks import KAFKA_SECURITY, FileSink, KafkaSink, ResultsTable, TableSink

__version__ = "1.9.0"
MAJOR = 1

__all__ = [
    "KAFKA_SECURITY", "MAJOR", "Field", "FileSink", "KafkaSink", "Limits", "Migration", "OldState", "Parameter", "Params", "PayloadFormat", "Pipeline",
    "Rejected", "Result", "ResultRecord", "ResultView", "ResultsTable", "SchemaError", "TableSink", "__version__", "apply",
    "parse_ddl", "parse_id", "resolve",
]  # fmt: skip

_DEPRECATED = {  # name -> where it lives now (1.5): the console's and the test kit's, not what a pipeline declares
    "parse_entries": "statekeeper_sdk._runtime.events",
    "sample_events": "dashboard.engine.samples",
}


def __getattr__(name: str) -> object:
    if name not in _DEPRECATED:
        raise AttributeError(f"module 'statekeeper_sdk' has no attribute {name!r}")
    from statekeeper_sdk._moved import moved

    return moved(__name__, _DEPRECATED[name], frozenset({name}), name, since="1.5")
