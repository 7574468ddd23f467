"""Moved in 1.7 to ``statekeeper_sdk._runtime.compatibility``: the upgrade verdict's rules are the console's and the
test kit's (``statekeeper_sdk.testing.check_upgrade`` gives the verdict offline). The names below still resolve here,
with a DeprecationWarning, until 2.0."""

from statekeeper_sdk._moved import to_runtime

# moved to statekeeper_sdk._runtime.compatibility in 1.7
__getattr__ = to_runtime(
    __name__,
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
    },
)
