"""The Nginx access-log line the shipped url-counts and minute-windows pipelines read, as a regex payload."""

from __future__ import annotations

from statekeeper_sdk import Field, PayloadFormat

ACCESS_LOG_PATTERN = (
    r'^(?P<remote>\S+) \S+ \S+ \[(?P<time>[^\]]+)\] "(?P<method>[A-Z]+) (?P<url>\S+) [^"]*" '
    r"(?P<status>\d{3}) (?P<bytes>\d+|-)"
)
ACCESS_LOG = PayloadFormat(
    "regex",
    (
        Field("remote", "string"),
        Field("time", "string"),
        Field("method", "string"),
        Field("url", "string"),
        Field("status", "long"),
        Field("bytes", "string"),
    ),
    ACCESS_LOG_PATTERN,
)
