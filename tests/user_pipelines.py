"""A user's pipeline, found only through settings.PIPELINES: url-counts with a bug that fails every batch holding a
request for /boom (the kind of failure no source check can see)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from pyspark.sql import Row
from statekeeper_sdk import KafkaSink, Parameter, Result, ResultsTable
from team_orders import jobs as team_jobs
from user_sessions import pipelines as user_sessions

from workers.spark.pipelines import url_counts


def results(rows: list[Row]) -> Iterable[Result]:
    for kind, key, value in url_counts.results(rows):
        if key == "/boom":
            raise ValueError(f"cannot count {key}: a bug in this pipeline")
        yield kind, key, value


PIPELINE = replace(url_counts.PIPELINE, name="failing-urls", title="Requests per URL, but for /boom", results=results)


def _fails_on_boom(rows: list[Row]) -> Iterable[Result]:
    for kind, key, value in user_sessions.results(rows):
        if key == "boom":
            raise ValueError("cannot store the totals of user boom: a bug in version 2")
        yield kind, key, value


# Version 2 of the example's user sessions with a bug its upgrade preview cannot see: storing results fails for the
# user "boom". Found through STATEKEEPER_PIPELINES in the processes a test starts.
BROKEN_SESSIONS_V2 = replace(user_sessions.SESSIONS_V2, name="user-sessions-v2-broken", results=_fails_on_boom)


# The team job writing its spend to a Kafka topic as well: refused where Spark's Kafka connector is not on the class
# path (the pyspark wheel does not ship it).
SPEND_TO_KAFKA = replace(
    team_jobs.CUSTOMER_SPEND,
    name="spend-to-kafka",
    sinks=(ResultsTable(), KafkaSink("spend-topic", servers="127.0.0.1:9092", topic="spend", key="customer")),
)


# url-counts with its counts also upserted into a Kafka topic (the parameter ``topic``; empty: not written), each
# batch one transaction: the exactly-once sink a team's consumer reads with read_committed
def counts_with(events, params):
    return url_counts.transform(events)


URLS_TO_KAFKA = replace(
    url_counts.PIPELINE,
    name="urls-to-kafka",
    transform=counts_with,
    parameters=(
        Parameter("servers", "str", "", "the Kafka cluster of the counts topic"),
        Parameter("topic", "str", "", "the topic the counts go to (empty: not written)"),
    ),
    sinks=(ResultsTable(), KafkaSink("counts", servers="{servers}", topic="{topic}", key="url")),
)

# the same into a cluster that asks for a SASL login over TLS: the password a secret parameter, the CA a parameter
URLS_TO_KAFKA_TLS = replace(
    URLS_TO_KAFKA,
    name="urls-to-kafka-tls",
    parameters=(
        *URLS_TO_KAFKA.parameters,
        Parameter("ca_file", "str", "", "the CA that signed the brokers' certificates (PEM)"),
        Parameter("kafka_password", "str", "", "the SASL password of the user statekeeper", secret=True),
    ),
    sinks=(
        ResultsTable(),
        KafkaSink(
            "counts",
            servers="{servers}",
            topic="{topic}",
            key="url",
            security={
                "security_protocol": "SASL_SSL",
                "sasl_mechanism": "PLAIN",
                "sasl_username": "statekeeper",
                "sasl_password": "{kafka_password}",
                "ssl_ca_file": "{ca_file}",
            },
        ),
    ),  # fmt: skip
)


# A new version of the real-time url-counts-live that Spark's real-time mode cannot run: its URLs go through a Python
# UDF. The kit's check_real_time and a real-time job's upgrade preview refuse it with Spark's reason.
def _lower_url(url: str | None) -> str | None:
    return url.lower() if url is not None else None


def counts_through_python(events, params):
    from pyspark.sql import functions as F

    lowered = F.udf(_lower_url, "string")
    return url_counts.transform(events.withColumn("url", lowered("url")))


URLS_LIVE_WITH_UDF = replace(
    url_counts.LIVE, name="url-counts-live-udf", version_of="url-counts-live", transform=counts_through_python
)
