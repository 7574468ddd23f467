"""The checks every source's rows pass (``statekeeper_sdk._runtime.events.parse_entries``), written as Spark SQL
expressions, so that a source Spark reads in the JVM (Kafka) checks its records there too: no record goes JVM →
Python → JVM to be checked (docs/benchmarks.md measured that trip as most of a Kafka job's source cost).

For flat payloads: JSON objects with ``Field`` s, and regex payloads whose pattern means the same in Java's regex
syntax as in RE2's (named groups, classes, anchors, flags other than RE2's ``U``; not POSIX ``[:alpha:]`` classes).
A nested schema, or a pattern outside that set, is checked by the Python checks as before (``checks_for`` answers
None). The same stages and, where the JVM can say it, the same reasons as the Python checks:

- decode: the payload's size, and UTF-8 (the position of a bad byte is not said);
- parse: not valid JSON (strict JSON: NaN or Infinity anywhere, trailing text and lone surrogates are not), not an
  object, a required field missing or null, a field of another JSON type than its own (a long must be an integer,
  ``true`` is not a number); a line the pattern does not match, a group that is not a number in range;
- validate: text with a NUL or longer than a result key holds, a number that is not finite, an event time far ahead of
  the record's arrival.

``rejected`` gives each rejected record's stage and reason, for the dead letters (``workers/spark/sources/
kafka_rejected.py`` writes them from a batch's offset range once the query reports that the batch rejected some).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from statekeeper_sdk import Limits, PayloadFormat

# A text Spark's JSON reader (parse_json) takes as a whole ends with its first value, whatever follows. The payload is
# read as the first element of an array whose second is this string, chosen anew in each process: a payload with
# text after its object breaks the array, unless it holds this string, which a producer cannot know.
_END = f"statekeeper-end-{secrets.token_hex(12)}"
_UNSAFE_PATTERN = re.compile(r"\[:|\(\?[a-zA-Z]*U|\\C|\(\?P=|\\[pP]\{?\^")
_NAMED_GROUP = re.compile(r"(?<!\\)((?:\\\\)*)\(\?P<[A-Za-z_][A-Za-z0-9_]*>")
_NUMBER = {"long": r"^[0-9]+$", "double": r"^-?[0-9]+(\.[0-9]+)?$"}
# what a Spark session reading payloads this way needs: a JSON object's repeated key takes its last value, as
# Python's JSON reader does (Spark's refuses the object by default)
SESSION_CONF = {"spark.sql.variant.allowDuplicateKeys": "true"}


@dataclass(frozen=True)
class _Check:
    stage: str
    failed: Column  # true when the record fails it (never null)
    reason: Column


def java_pattern(pattern: str) -> str | None:
    """An RE2 pattern in Java's syntax (named groups made plain, their numbers unchanged), or None when the two may
    read it differently."""
    if _UNSAFE_PATTERN.search(pattern):
        return None
    translated = _NAMED_GROUP.sub(lambda m: m.group(1) + "(", pattern)
    try:
        if re.compile(translated).groups != re.compile(pattern).groups:
            return None
    except re.error:
        return None
    return translated


def checks_for(payload: PayloadFormat, limits: Limits) -> JvmChecks | None:
    """The payload's checks in Spark SQL, or None when only the Python checks can read it."""
    if payload.nested:
        return None
    if any("'" in f.name or "\\" in f.name or "]" in f.name for f in payload.fields):
        return None
    if payload.kind == "regex":
        pattern = java_pattern(payload.pattern)
        return None if pattern is None else JvmChecks(payload, limits, pattern)
    return JvmChecks(payload, limits, "")


class JvmChecks:
    """Checks over a frame of ``_id`` (string), ``value`` (binary) and ``arrival_ms`` (long) columns.

    The frame is read in steps, each a projection of the one before: the payload parsed once (JSON into a variant, a
    line through its pattern once), then each field's type and value, then whether a check fails. Spark keeps the
    steps apart rather than parse again for every check that reads the parse."""

    def __init__(self, payload: PayloadFormat, limits: Limits, pattern: str) -> None:
        self.payload, self.limits, self.pattern = payload, limits, pattern
        # a field's columns in the frame's steps are named by its place: a name with a dot or a space reads otherwise
        self.place = {f.name: i for i, f in enumerate(payload.fields)}

    def _f(self, name: str) -> str:  # its raw part: its JSON value, its group's text
        return f"_f{self.place[name]}"

    def _k(self, name: str) -> str:  # its JSON value's type
        return f"_k{self.place[name]}"

    def _v(self, name: str) -> str:  # its value, as the pipeline reads it
        return f"_v{self.place[name]}"

    def events(self, raw: DataFrame, metric: str = "") -> DataFrame:
        """The records that pass, as the pipeline's events (``_id`` and the payload's fields); ``metric`` names the
        query's observed count of the records the checks refuse (``rejected``)."""
        checked = self._checked(raw)
        if metric:
            checked = checked.observe(metric, F.count_if("_failed").alias("rejected"))
        return checked.filter(~F.col("_failed")).select(
            "_id", *[F.col(self._v(f.name)).alias(f.name) for f in self.payload.fields]
        )

    def rejected(self, raw: DataFrame) -> DataFrame:
        """The records that fail: ``_id``, ``stage``, ``reason`` (the first check each fails, as the Python checks
        order them) and ``value``."""
        checks = self._checks()
        stage = F.coalesce(*[F.when(c.failed, F.lit(c.stage)) for c in checks])
        reason = F.coalesce(*[F.when(c.failed, c.reason) for c in checks])
        return (
            self._checked(raw).filter("_failed")
            .select("_id", stage.alias("stage"), reason.alias("reason"), "value")
        )  # fmt: skip

    def _checked(self, raw: DataFrame) -> DataFrame:
        text = F.col("value").cast("string")
        if self.payload.kind == "json":
            wrapped = F.try_parse_json(F.concat(F.lit("["), text, F.lit(f',"{_END}"]')))
            parsed = raw.select("*", wrapped.alias("_w")).select(
                "*", F.variant_get("_w", "$[0]", "variant").alias("_o"),
                (F.try_variant_get("_w", "$[1]", "string") == F.lit(_END)).alias("_end"),
                F.variant_get("_w", "$[2]", "variant").isNull().alias("_only"),
            )  # fmt: skip
            spark_type = {"string": "string", "long": "bigint", "double": "double"}
            fields = parsed.select("*", F.schema_of_variant("_o").alias("_kind"), *[
                F.variant_get("_o", f"$['{f.name}']", "variant").alias(self._f(f.name)) for f in self.payload.fields
            ]).select("*", *[
                col for f in self.payload.fields for col in (
                    F.schema_of_variant(self._f(f.name)).alias(self._k(f.name)),
                    F.try_variant_get(self._f(f.name), "$", spark_type[f.type]).alias(self._v(f.name)),
                )
            ])  # fmt: skip
        else:
            index = re.compile(self.payload.pattern).groupindex
            whole = rf"^(?s:.*?)(?:{self.pattern})(?s:.*)\z"
            joined = "\u0002" + "\u0001".join(f"${index[f.name]}" for f in self.payload.fields)
            parsed = raw.select("*", F.regexp_replace(text, whole, joined).alias("_m")).select(
                "*", (F.col("_m") != text).alias("_hit"), F.split(F.substring("_m", 2, 1 << 30), "\u0001").alias("_g")
            )  # fmt: skip
            parts = len(self.payload.fields)
            fields = parsed.select("*", *[
                # a group that holds the separator (a hostile line's) is read through the pattern once more
                F.when(F.size("_g") == parts, F.element_at("_g", i + 1))
                .otherwise(F.regexp_extract(text, self.pattern, index[f.name])).alias(self._f(f.name))
                for i, f in enumerate(self.payload.fields)
            ]).select("*", *[
                (F.col(self._f(f.name)) if f.type == "string" else
                 F.col(self._f(f.name)).cast("bigint" if f.type == "long" else "double")).alias(self._v(f.name))
                for f in self.payload.fields
            ])  # fmt: skip
        checks = self._checks()
        failed = F.greatest(*[c.failed for c in checks]) if len(checks) > 1 else checks[0].failed
        return fields.select("*", failed.alias("_failed"))

    def _checks(self) -> list[_Check]:
        """Each check over the frame's steps (``_checked``), in the Python checks' order."""
        limits = self.limits
        size = F.octet_length("value")
        checks = [
            _Check("decode", size > limits.max_payload_bytes,
                   F.format_string(f"payload is %,d bytes (limit {limits.max_payload_bytes:,})", size)),
            _Check("decode", ~F.coalesce(F.is_valid_utf8(F.col("value").cast("string")), F.lit(False)),
                   F.lit("not valid UTF-8")),
        ]  # fmt: skip
        checks += self._json_checks() if self.payload.kind == "json" else self._regex_checks()
        for f in self.payload.fields:
            value = F.col(self._v(f.name))
            if f.type == "string":
                checks.append(_Check("validate", F.coalesce(F.contains(value, F.char(F.lit(0))), F.lit(False)),
                                     F.lit(f"field '{f.name}' holds a NUL character")))  # fmt: skip
                length = F.char_length(value)
                checks.append(_Check(
                    "validate", F.coalesce(length > limits.max_string_chars, F.lit(False)),
                    F.format_string(f"field '{f.name}' is %,d characters (limit {limits.max_string_chars})", length),
                ))  # fmt: skip
            elif f.type == "double":
                finite = ~F.isnan(value) & (F.abs(value) != F.lit(float("inf")))
                checks.append(_Check("validate", ~F.coalesce(finite, F.lit(True)),
                                     F.lit(f"field '{f.name}' is not a finite number")))  # fmt: skip
        if self.payload.event_time and limits.max_future_seconds > 0:
            at = F.col(self._v(self.payload.event_time))
            ahead = at - F.col("arrival_ms")
            checks.append(_Check(
                "validate", F.coalesce(ahead > int(limits.max_future_seconds * 1000), F.lit(False)),
                F.format_string(
                    f"event time %d is %,.0f s after the entry arrived (limit {limits.max_future_seconds:g} s): it "
                    "would move the watermark", at, ahead / 1000.0,
                ),
            ))  # fmt: skip
        return checks

    def _json_checks(self) -> list[_Check]:
        whole = F.col("_w").isNotNull() & F.col("_end") & F.col("_only")
        checks = [
            _Check("parse", ~F.coalesce(whole, F.lit(False)), F.lit("not valid JSON")),
            _Check("parse", ~F.coalesce(F.col("_kind").startswith("OBJECT<"), F.lit(False)),
                   F.lit("not a JSON object")),
        ]  # fmt: skip
        for f in self.payload.fields:
            kind = F.col(self._k(f.name))
            absent = F.coalesce(kind == F.lit("VOID"), F.lit(True))
            if f.required:
                checks.append(_Check("parse", absent, F.lit(f"missing field '{f.name}'")))
            if f.type == "string":
                checks.append(_Check("parse", ~absent & (kind != F.lit("STRING")),
                                     F.lit(f"field '{f.name}' is not a string")))  # fmt: skip
            elif f.type == "long":
                # a whole number beyond 64 bits (19 digits or more); 10.0 is DECIMAL(2,0) too, and not an integer
                wide = kind.rlike(r"^DECIMAL\((19|[2-9][0-9]),0\)$")
                checks.append(_Check("parse", ~absent & wide,
                                     F.lit(f"field '{f.name}' is out of range for a 64-bit integer")))  # fmt: skip
                checks.append(_Check("parse", ~absent & (kind != F.lit("BIGINT")),
                                     F.lit(f"field '{f.name}' is not an integer")))  # fmt: skip
            else:
                number = kind.isin("BIGINT", "DOUBLE", "FLOAT") | kind.startswith("DECIMAL(")
                checks.append(_Check("parse", ~absent & ~number, F.lit(f"field '{f.name}' is not a number")))
        return checks

    def _regex_checks(self) -> list[_Check]:
        checks = [_Check("parse", ~F.col("_hit"), F.lit("line does not match the expected format"))]
        for f in self.payload.fields:
            if f.type == "string":
                continue
            group = F.col(self._f(f.name))
            numeric = group.rlike(_NUMBER[f.type])
            if f.type == "long":  # 18 digits always fit in 64 bits; more are out of range
                numeric = numeric & (F.char_length(group) <= 18)
            checks.append(_Check("parse", ~F.coalesce(numeric, F.lit(False)),
                                 F.lit(f"field '{f.name}' is not a number in range")))  # fmt: skip
        return checks
