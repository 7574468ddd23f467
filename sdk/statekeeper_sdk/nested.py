"""Payloads described by a Spark schema: ``parse_ddl`` reads a DDL text without a JVM (a Python worker has none),
and ``SchemaError`` says what is wrong with one. Checking an event against the schema is the console's and the test
kit's (``statekeeper_sdk._runtime.nested``)."""

from statekeeper_sdk._runtime.nested import SchemaError, parse_ddl

__all__ = ["SchemaError", "parse_ddl"]


_RUNTIME = frozenset(
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
    }
)  # moved to statekeeper_sdk._runtime.nested in 1.7


def __getattr__(name: str) -> object:
    from statekeeper_sdk._moved import moved

    return moved(__name__, "statekeeper_sdk._runtime.nested", _RUNTIME, name, since="1.7")
