"""Moved in 1.7 to ``statekeeper_sdk._runtime.compatibility``: the upgrade verdict's rules are the console's and the
test kit's (``statekeeper_sdk.testing.check_upgrade`` gives the verdict offline). The names below still resolve here,
with a DeprecationWarning, until 2.0."""

_RUNTIME = frozenset(
    {
        "COMPATIBLE",
        "EVOLVES",
        "INCOMPATIBLE",
        "TTL_FIELDS",
        "Verdict",
        "operator_schemas",
        "forget_batch",
        "replayed",
        "compare",
        "parameter_changes",
        "described",
        "summary",
        "describe",
        "PYTHON_ERROR",
        "python_error",
    }
)  # moved to statekeeper_sdk._runtime.compatibility in 1.7


def __getattr__(name: str) -> object:
    from statekeeper_sdk._moved import moved

    return moved(__name__, "statekeeper_sdk._runtime.compatibility", _RUNTIME, name, since="1.7")
