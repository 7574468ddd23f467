"""Payloads described by a Spark schema: ``parse_ddl`` reads a DDL text without a JVM (a Python worker has none),
and ``SchemaError`` says what is wrong with one. Checking an event against the schema is the console's and the test
kit's (``statekeeper_sdk._runtime.nested``)."""

from statekeeper_sdk._moved import to_runtime
from statekeeper_sdk._runtime.nested import SchemaError, parse_ddl

__all__ = ["SchemaError", "parse_ddl"]


# moved to statekeeper_sdk._runtime.nested in 1.7
__getattr__ = to_runtime(
    __name__,
    {
        "SIMPLE",
        "INTEGER_RANGE",
        "FLOAT_MAX",
        "MAX_DEPTH",
        "TOKEN",
        "Bad",
        "to_ddl",
        "check_object",
        "epoch_ms",
        "arrow_schema",
    },
)
