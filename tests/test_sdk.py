"""The pipeline SDK as a package author meets it: its schema language reads DDL as Spark does, a package built for
another SDK major is refused by the registry with its name and the reason, the deploy's code version sees an edit to
any file of the package, and parameters are checked as the job form and the API check them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import pytest
from statekeeper_sdk import Field, Parameter, PayloadFormat, ResultView, SchemaError, apply, parse_ddl, resolve

from dashboard import pipelines
from dashboard.engine.code import code_version

DDL = [
    "a string, b bigint, c double",
    "order_id string NOT NULL, items array<struct<sku: string NOT NULL, qty: int, price: decimal(10,2)>> NOT NULL",
    "customer struct<id: string NOT NULL, tags: map<string, array<string>>>, seen timestamp, day date, ok boolean",
    "`odd name` string, `back``tick` int, n smallint, t tinyint, f float, ts timestamp_ntz",
    "deep struct<a: struct<b: struct<c: array<map<string, decimal(38, 0)>>>>>",
]


@pytest.mark.spark
@pytest.mark.parametrize("ddl", DDL)
def test_the_sdk_reads_a_schema_exactly_as_spark_does(spark, ddl):
    assert parse_ddl(ddl) == spark.createDataFrame([], ddl).schema


@pytest.mark.parametrize(
    ("ddl", "reason"),
    [
        ("a strin", "unknown type 'strin'"),
        ("a array<string", "expected > in the schema"),
        ("a map<int, string>", "a map's keys must be strings"),
        ("a decimal(40, 2)", "decimal"),
        ("a string, a bigint", "twice"),
        ("", "at least one field"),
    ],
)
def test_a_schema_spark_would_not_take_is_refused_with_the_reason(ddl, reason):
    with pytest.raises(SchemaError) as refused:
        parse_ddl(ddl)
    assert reason in str(refused.value), str(refused.value)


def _distribution(site: Path, name: str, requires: str, helper: str = "RATE = 1\n") -> None:
    """An installed package on ``site``: module, helper module and its metadata, as pip leaves them."""
    package = site / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text(helper)
    (package / "jobs.py").write_text(
        "from statekeeper_sdk import Field, PayloadFormat, Pipeline\n"
        "from .helpers import RATE\n\n"
        f"PIPELINE = Pipeline(name={name + '-job'!r}, title='t', description='d', "
        "payload=PayloadFormat('json', (Field('a', 'string'),)), transform=lambda events: events, "
        "output_mode='append', results=lambda rows: [], views=())\n"
    )
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\nRequires-Dist: {requires}\n")
    (info / "top_level.txt").write_text(f"{name}\n")
    (info / "entry_points.txt").write_text(f"[statekeeper.pipelines]\n{name}-job = {name}.jobs:PIPELINE\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    pipelines.registry.cache_clear()
    yield tmp_path
    pipelines.registry.cache_clear()


def test_the_registry_refuses_a_package_built_for_another_sdk_major_and_keeps_the_rest(site):
    _distribution(site, "acme_future", "statekeeper-sdk>=2,<3")
    _distribution(site, "acme_current", "statekeeper-sdk>=1,<2")
    found = pipelines.registry()
    refused = {r.reference: r.reason for r in found.refused}
    reason = refused["acme_future.jobs:PIPELINE"]
    assert "acme_future 1.0 is built for statekeeper-sdk<3,>=2" in reason and "supports statekeeper-sdk 1.x" in reason
    assert "acme_current-job" in found.pipelines and "acme_future-job" not in found.pipelines
    assert "url-counts" in found.pipelines, "the other pipelines still load"


def test_a_deploys_code_version_sees_an_edit_to_a_helper_module(site):
    _distribution(site, "acme_helpers", "statekeeper-sdk>=1,<2")
    import acme_helpers.jobs

    before = code_version(acme_helpers.jobs)
    assert before.package == "acme_helpers 1.0" and before.files == 3
    (site / "acme_helpers" / "helpers.py").write_text("RATE = 2\n")
    after = code_version(acme_helpers.jobs)
    assert after.package == before.package and after.code_hash != before.code_hash, "the helper's edit is a new version"


def test_a_distribution_installed_after_a_code_version_was_taken_is_named_in_the_next(site):
    """Which distribution holds each package is read once and kept until an install changes a directory on the path:
    a package installed since is still named in its deploy record."""
    _distribution(site, "acme_first", "statekeeper-sdk>=1,<2")
    import acme_first.jobs

    assert code_version(acme_first.jobs).package == "acme_first 1.0"
    _distribution(site, "acme_later", "statekeeper-sdk>=1,<2")
    import acme_later.jobs

    assert code_version(acme_later.jobs).package == "acme_later 1.0"
    assert code_version(acme_first.jobs).package == "acme_first 1.0"


def test_parameters_are_checked_against_what_the_pipeline_declares():
    declared = (
        Parameter("window_minutes", "int", 60, minimum=1, maximum=1440),
        Parameter("threshold", "float", 100.0, minimum=0),
        Parameter("mode", "str", "fast", choices=("fast", "exact")),
        Parameter("dry_run", "bool", False),
    )
    assert resolve(declared, {"window_minutes": "15", "dry_run": "true"}) == {
        "window_minutes": 15, "threshold": 100.0, "mode": "fast", "dry_run": True,
    }  # fmt: skip
    with pytest.raises(ValueError) as wrong:
        resolve(declared, {"window_minutes": 0, "threshold": "nan", "mode": "slow", "colour": 1, "dry_run": 2})
    lines = str(wrong.value).splitlines()
    assert "colour: the pipeline has no such parameter" in lines
    assert "window_minutes: must be at least 1, got 0" in lines
    assert any(line.startswith("threshold: expected a number") for line in lines)
    assert "mode: 'slow' is not one of fast, exact" in lines and any(line.startswith("dry_run:") for line in lines)
    with pytest.raises(ValueError, match="out of range for a 64-bit integer"):
        resolve(declared, {"window_minutes": 2**70})
    with pytest.raises(ValueError, match="must be at most 1440"):
        resolve(declared, {"window_minutes": 10**18})


def test_an_operator_types_parameters_as_lines_or_json():
    assert pipelines.parse_parameters("window_minutes = 10\n# a comment\nthreshold=50  # euros\n") == {
        "window_minutes": "10", "threshold": "50",
    }  # fmt: skip
    assert pipelines.parse_parameters(json.dumps({"threshold": 5})) == {"threshold": 5}
    for text, reason in [("window 10", "Line 1"), ("a = 1\na = 2", "set twice"), ("[1]", "Line 1"), ("{", "JSON")]:
        with pytest.raises(ValueError, match=reason):
            pipelines.parse_parameters(text)


def test_the_sdk_declares_and_the_consoles_engine_writes():
    """The engine left the SDK in 1.3: a name only the console used still resolves inside a console, with a warning,
    and the engine imports no Django (the drivers and the pages both use it)."""
    import statekeeper_sdk.code
    import statekeeper_sdk.sinks

    from dashboard.engine import code as engine_code
    from dashboard.engine import sinks as engine_sinks

    assert "TableWriter" not in vars(statekeeper_sdk.sinks) and "code_version" not in vars(statekeeper_sdk.code)
    with pytest.warns(DeprecationWarning, match="statekeeper_sdk.sinks.TableWriter is deprecated since"):
        assert statekeeper_sdk.sinks.TableWriter is engine_sinks.TableWriter
    with pytest.warns(DeprecationWarning, match="leaves in 2.0"):
        assert statekeeper_sdk.code.code_version is engine_code.code_version
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        _ = statekeeper_sdk.sinks.nothing
    import statekeeper_sdk.events
    import statekeeper_sdk.samples

    from dashboard.engine import samples as engine_samples

    with pytest.warns(
        DeprecationWarning, match="statekeeper_sdk.sample_events is deprecated since statekeeper-sdk 1.5"
    ):
        assert statekeeper_sdk.sample_events is engine_samples.sample_events
    with pytest.warns(DeprecationWarning, match="statekeeper_sdk.samples.sample_events is deprecated since"):
        assert statekeeper_sdk.samples.sample_events is engine_samples.sample_events
    from statekeeper_sdk._runtime import events as runtime_events

    with pytest.warns(DeprecationWarning, match=r"the console's engine \(statekeeper_sdk._runtime.events\)"):
        assert statekeeper_sdk.parse_entries is runtime_events.parse_entries
    assert not {"parse_entries", "sample_events"} & set(statekeeper_sdk.__all__), "a star import warns of nothing"
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        _ = statekeeper_sdk.nothing
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, dashboard.engine.sinks, dashboard.engine.code, dashboard.engine.samples; "
         "print(sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'statekeeper')))"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert imported.stdout.strip() == "[]", imported.stdout


def test_the_sdk_runtime_is_private_and_the_old_paths_still_resolve():
    """1.7: the code only the console and the test kit run lives in ``statekeeper_sdk._runtime``. The public modules
    keep what a pipeline declares (``Rejected``, ``Limits``, ``Migration``, ``OldState``, ``parse_ddl``) without a
    warning; every name that moved still resolves at its old path until 2.0, with a DeprecationWarning naming where
    it went; and no console module imports a public SDK module but the package itself."""
    import warnings

    import statekeeper_sdk.compatibility
    import statekeeper_sdk.events
    import statekeeper_sdk.migration
    import statekeeper_sdk.nested
    from statekeeper_sdk._runtime import compatibility, migration, nested

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from statekeeper_sdk.events import Limits, Rejected, parse_id  # noqa: F401
        from statekeeper_sdk.migration import Migration, OldState  # noqa: F401
        from statekeeper_sdk.nested import SchemaError, parse_ddl  # noqa: F401

        assert statekeeper_sdk.nested.parse_ddl is statekeeper_sdk.parse_ddl
    for module, runtime, name in [
        (statekeeper_sdk.compatibility, compatibility, "compare"),
        (statekeeper_sdk.compatibility, compatibility, "summary"),
        (statekeeper_sdk.migration, migration, "read_state"),
        (statekeeper_sdk.nested, nested, "check_object"),
    ]:
        with pytest.warns(
            DeprecationWarning, match=rf"{module.__name__}.{name} is deprecated since statekeeper-sdk 1.7"
        ):
            assert getattr(module, name) is getattr(runtime, name)
    with pytest.raises(AttributeError, match="has no attribute 'compare_all'"):
        _ = statekeeper_sdk.compatibility.compare_all
    root = Path(__file__).resolve().parent.parent
    deep = [
        f"{path.relative_to(root)}: {line.strip()}"
        for top in ("dashboard", "workers", "statekeeper", "bench")
        for path in (root / top).rglob("*.py")
        for line in path.read_text().splitlines()
        if line.lstrip().startswith(("from statekeeper_sdk.", "import statekeeper_sdk."))
        and not line.lstrip().startswith(("from statekeeper_sdk._runtime", "from statekeeper_sdk._passwords"))
    ]
    assert deep == [], "the console imports the SDK's package or its private runtime, not its public modules"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"output_mode": "upsert"}, "output_mode is one of append, update, complete, not 'upsert'"),
        ({"sinks": ("results",)}, "'results' is not a sink: declare ResultsTable"),
        ({"views": (ResultView("url", "A", ()), ResultView("url", "B", ()))}, "two views show the kind 'url'"),
    ],
)
def test_a_pipeline_the_console_would_refuse_fails_where_it_is_made(change, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        replace(pipelines.get("url-counts"), **change)


def test_a_kafka_sinks_security_takes_the_sources_names_and_its_password_only_from_a_secret_parameter(tmp_path):
    from statekeeper_sdk import KAFKA_SECURITY, KafkaSink, Parameter
    from statekeeper_sdk.sinks import bound

    from dashboard import kafka

    assert set(KAFKA_SECURITY) == set(kafka.SECURITY), "a sink and a job's source take the same settings"
    pipe = tmp_path / "ca.pem"
    os.mkfifo(pipe)  # a CA "file" that would block whoever reads it
    assert kafka.security_problems({"security_protocol": "SSL", "ssl_ca_file": str(pipe)}) == [
        f"ssl_ca_file: {pipe} is no file on the console's host"
    ]
    with pytest.raises(ValueError, match="'sasl_pasword' is not a Kafka security setting"):
        KafkaSink("out", servers="s:1", topic="t", security={"sasl_pasword": "{pw}"})
    secret, plain = Parameter("pw", "str", "", secret=True), Parameter("user", "str", "")
    login = {"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "{user}"}
    for password in ("hunter2", "{user}", "x{pw}"):
        with pytest.raises(ValueError, match="sasl_password from a parameter declared secret=True"):
            replace(pipelines.get("url-counts"), parameters=(secret, plain),
                    sinks=(KafkaSink("out", "s:1", "t", security={**login, "sasl_password": password}),))  # fmt: skip
    declared = replace(pipelines.get("url-counts"), parameters=(secret, plain),
                       sinks=(KafkaSink("out", "s:1", "t", security={**login, "sasl_password": "{pw}"}),))  # fmt: skip
    assert declared.target_parameters() >= {"pw", "user"}, "what names the login is never operational"
    sink = bound(declared.sinks[0], {"pw": "the-password", "user": "reader"})
    assert sink.security["sasl_password"] == "the-password" and sink.security["sasl_username"] == "reader"
    assert "the-password" not in repr(sink), "a bound sink's repr holds no password"
    assert declared.sinks[0].security["sasl_password"] == "{pw}", "binding leaves the declared sink as it was"


@pytest.mark.spark
def test_the_sdk_readmes_example_is_a_pipeline_that_runs(spark):
    """sdk/README.md's example, as written: it makes a Pipeline, and its transformation and results run on events."""
    text = (Path(__file__).resolve().parent.parent / "sdk" / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(compile(code, "sdk/README.md", "exec"), scope)
    pipeline = scope["CUSTOMER_SPEND"]
    assert pipeline.views[0].keep_rows == 100_000 and pipeline.parameters[0].operational
    events = spark.createDataFrame(
        [("o1", ("c1", "eu"), datetime(2026, 11, 26, 10, 5)), ("o2", ("c1", "eu"), datetime(2026, 11, 26, 10, 40)),
         ("o3", ("c2", None), datetime(2026, 11, 26, 10, 7))],
        "order_id string, customer struct<id: string, region: string>, placed_at timestamp",
    )  # fmt: skip
    rows = apply(pipeline, events, {"window_minutes": 30}).collect()
    results = sorted((key, value["orders"]) for _, key, value in pipeline.results(rows))
    assert results == [
        ("c1|2026-11-26 10:00:00", 1), ("c1|2026-11-26 10:30:00", 1), ("c2|2026-11-26 10:00:00", 1)
    ]  # fmt: skip


def test_a_field_and_a_parameter_take_one_type_vocabulary():
    assert Field("n", "int") == Field("n", "long") and Field("s", "str").type == "string"
    assert Parameter("w", "long", 5).type == "int" and Parameter("t", "double", 1.0).type == "float"
    flat = PayloadFormat("json", fields=(Field("url", "str"), Field("ms", "int")))
    assert flat.columns() == "`url` string, `ms` bigint"
    with pytest.raises(SchemaError, match="a flat field is string, long or double, not 'date'"):
        PayloadFormat("json", fields=(Field("d", "date"),))


@pytest.mark.spark
def test_the_test_kit_puts_a_result_no_view_shows_among_the_dead_letters_as_the_console_does(kit_spark, tmp_path):
    from statekeeper_sdk.testing import run_batches
    from user_sessions.pipelines import SESSIONS

    def results(rows):
        yield from SESSIONS.results(rows)
        yield "everyone", "all", {"events": len(rows)}

    [batch] = [b for b in run_batches(replace(SESSIONS, results=results),
                                      [[{"user": "u1", "region": "eu", "amount": 2}]], spark=kit_spark,
                                      workdir=tmp_path) if b.rows]  # fmt: skip
    [(kind, key, value)] = batch.results
    assert (kind, key, value["events"]) == ("totals", "u1", 1) and batch.results[0].kind == "totals"
    [refused] = batch.dead_letters
    assert refused.stage == "sink" and refused.reason.startswith("the kind 'everyone' has no view in user-sessions")


def test_the_sdks_docstring_examples_run_as_written():
    """Every ``>>>`` example in the SDK's modules, as an author would copy it."""
    import doctest
    import importlib
    import pkgutil

    import statekeeper_sdk

    attempted = 0
    for module in pkgutil.walk_packages(statekeeper_sdk.__path__, "statekeeper_sdk."):  # _runtime's too
        result = doctest.testmod(importlib.import_module(module.name), optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, f"{module.name}: {result.failed} example(s) failed"
        attempted += result.attempted
    assert attempted >= 10, "the SDK's examples were found"


@pytest.mark.spark
def test_a_replay_that_fails_in_its_batch_function_names_the_python_error_not_the_proxy(spark, tmp_path):
    """A preview whose re-run fails inside ``foreachBatch`` (a pipeline's bug, a state file Spark cannot load) tells
    the operator why: Spark reports such an error as py4j's "An exception was raised by the Python Proxy", and its
    first line is all an operator used to see."""
    from statekeeper_sdk._runtime.compatibility import replayed

    def fails(batch, batch_id):
        raise KeyError("region: version 2 reads a field version 1 never wrote")

    rates = spark.readStream.format("rate").option("rowsPerSecond", 1).load()
    query = rates.writeStream.foreachBatch(fails).option("checkpointLocation", str(tmp_path / "checkpoint")).start()
    why = replayed(query, tmp_path / "checkpoint", 0, timeout=120)
    assert why == "KeyError: 'region: version 2 reads a field version 1 never wrote'"
    assert not query.isActive
