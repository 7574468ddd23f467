"""The console's own Kafka client (confluent-kafka), for what it reads beside Spark: the broker's end offsets and the
time of the oldest unread record, per partition, so that a Kafka job's lag stays true while it is down (Spark's
connector reads and writes the topics themselves); and, for the demo and the tests, a topic made and written to.

No Django here: the servers arrive as arguments (a ``Cluster``: the bootstrap servers and the client's security, TLS
and SASL, or the servers alone). Every call is bounded by ``timeout`` seconds, and a broker that does not answer raises
``KafkaUnavailable`` rather than hanging the beat that samples lag.

A job's Kafka security (``Job.source_security``) is one set of settings that both clients take, each in its own
words: this module's (librdkafka's names) and Spark's connector (the Java client's, ``spark_options``)::

    security_protocol = SASL_SSL          # PLAINTEXT (the default), SSL, SASL_PLAINTEXT or SASL_SSL
    sasl_mechanism = SCRAM-SHA-512        # PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512
    sasl_username = orders-reader
    sasl_password = ${secret:kafka-orders}  # a secret's reference, never the password
    ssl_ca_file = /etc/kafka/ca.pem        # the CA's certificates (PEM) when the brokers' are not in the system's
    ssl_check_hostname = true              # false: accept a certificate whose name is not the broker's
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from dashboard.records import kafka_offsets


class KafkaUnavailable(Exception):
    """The broker did not answer, or the topic does not exist."""


PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = {  # a SASL mechanism -> the Java client's login module for it
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}
SECURITY = {  # a setting -> what it is, for the form's help and the errors
    "security_protocol": f"one of {', '.join(PROTOCOLS)}",
    "sasl_mechanism": f"one of {', '.join(MECHANISMS)}",
    "sasl_username": "the SASL user",
    "sasl_password": "the SASL password, as a secret's reference ${secret:NAME}",
    "ssl_ca_file": "the absolute path of the CA's certificates (PEM) the brokers' certificates are checked against",
    "ssl_check_hostname": "true (the default) or false: whether a broker's certificate must name the broker",
}


@dataclass(frozen=True)
class Cluster:
    """Where a job's topic lives: its bootstrap servers, and its client's security settings (``SECURITY``'s names,
    the password revealed)."""

    servers: str
    security: Mapping[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.servers


def security_problems(settings: Mapping[str, Any]) -> list[str]:
    """What is wrong with a job's Kafka security settings, one sentence each (none: they are whole). That the password
    is a secret's reference is the secrets' rule (``services.secrets.value_problems``), which the form adds."""
    problems = [f"{name}: not a setting (the settings are {', '.join(SECURITY)})" for name in settings
                if name not in SECURITY]  # fmt: skip
    values = {k: str(v) for k, v in settings.items() if k in SECURITY}
    protocol = values.get("security_protocol", "PLAINTEXT").upper()
    if protocol not in PROTOCOLS:
        problems.append(f"security_protocol: {SECURITY['security_protocol']}, not {values['security_protocol']!r}")
    sasl = protocol.startswith("SASL_")
    if sasl:
        if values.get("sasl_mechanism", "").upper() not in MECHANISMS:
            problems.append(f"sasl_mechanism: {protocol} needs {SECURITY['sasl_mechanism']}")
        problems += [f"{name}: {protocol} needs {SECURITY[name]}" for name in ("sasl_username", "sasl_password")
                     if not values.get(name)]  # fmt: skip
    else:
        problems += [f"{name}: only with a SASL security_protocol" for name in values if name.startswith("sasl_")]
    if '"' in values.get("sasl_username", "") or "\\" in values.get("sasl_username", ""):
        problems.append("sasl_username: no quotes or backslashes")
    if (ca := values.get("ssl_ca_file")) is not None:
        problems += [f"ssl_ca_file: {why}" for why in _ca_problems(ca)]
    if "SSL" not in protocol:
        problems += [f"{name}: only with SSL or SASL_SSL" for name in values if name.startswith("ssl_")]
    if values.get("ssl_check_hostname", "true").lower() not in ("true", "false"):
        problems.append(f"ssl_check_hostname: {SECURITY['ssl_check_hostname']}")
    return problems


def _ca_problems(path: str) -> list[str]:
    """Why ``path`` is no CA file a client can take, on the console's host (the drivers' share its paths)."""
    if not os.path.isabs(path):
        return [SECURITY["ssl_ca_file"]]
    if not os.path.isfile(path):  # a device or a pipe is never read here: it could block the web process
        return [f"{path} is no file on the console's host"]
    try:
        with open(path, "rb") as file:
            head = file.read(1 << 16)
    except OSError as exc:
        return [f"{path} cannot be read here ({exc.strerror})"]
    if b"-----BEGIN CERTIFICATE-----" not in head:
        return [f"{path} holds no certificate in PEM (-----BEGIN CERTIFICATE-----)"]
    return []


def client_config(security: Mapping[str, str]) -> dict[str, str]:
    """The settings in librdkafka's names (this module's client)."""
    config = {"security.protocol": security.get("security_protocol", "PLAINTEXT").upper()}
    if "sasl_mechanism" in security:
        config |= {"sasl.mechanisms": security["sasl_mechanism"].upper(), "sasl.username": security["sasl_username"],
                   "sasl.password": security["sasl_password"]}  # fmt: skip
    if "ssl_ca_file" in security:
        config["ssl.ca.location"] = security["ssl_ca_file"]
    if "SSL" in config["security.protocol"]:
        checked = security.get("ssl_check_hostname", "true").lower() == "true"
        config["ssl.endpoint.identification.algorithm"] = "https" if checked else "none"
    return config


def spark_options(security: Mapping[str, str]) -> dict[str, str]:
    """The settings in the Java client's names, as options of Spark's Kafka source (``kafka.``-prefixed). A password
    goes into the JAAS line, quoted; the Java client logs that line as ``[hidden]``."""
    protocol = security.get("security_protocol", "PLAINTEXT").upper()
    options = {"kafka.security.protocol": protocol}
    if (mechanism := security.get("sasl_mechanism", "").upper()) in MECHANISMS and protocol.startswith("SASL_"):
        password = security["sasl_password"].replace("\\", "\\\\").replace('"', '\\"')
        options |= {
            "kafka.sasl.mechanism": mechanism,
            "kafka.sasl.jaas.config": f'{MECHANISMS[mechanism]} required username="{security["sasl_username"]}" '
            f'password="{password}";',
        }
    if "ssl_ca_file" in security:
        options |= {"kafka.ssl.truststore.type": "PEM", "kafka.ssl.truststore.location": security["ssl_ca_file"]}
    if "SSL" in protocol:
        checked = security.get("ssl_check_hostname", "true").lower() == "true"
        options["kafka.ssl.endpoint.identification.algorithm"] = "https" if checked else ""
    return options


def _config(servers: Cluster | str, timeout: float) -> dict[str, Any]:
    ms = int(timeout * 1000)
    security = servers.security if isinstance(servers, Cluster) else {}
    return {"bootstrap.servers": str(servers), "socket.timeout.ms": ms, "socket.connection.setup.timeout.ms": ms,
            **client_config(security)}  # fmt: skip


class Heard:
    """A client's own errors (its ``error_cb``): a broker that refuses the login or the TLS handshake answers a request
    only with "transport failure" or not at all, and its reason comes as such an error."""

    def __init__(self) -> None:
        self.errors: list[KafkaError] = []

    def __call__(self, error: KafkaError) -> None:
        self.errors.append(error)

    def refusal(self) -> str:
        """The broker's newest refusal of the login or the TLS handshake; empty when there was none."""
        refused = [e for e in self.errors if e.code() in (KafkaError._AUTHENTICATION, KafkaError._SSL)]
        return refused[-1].str() if refused else ""

    def reason(self, otherwise: Any) -> str:
        return self.refusal() or str(otherwise)


class _Looking(Consumer):
    """The console's consumer, which keeps the client's own errors (``Heard``)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.heard = Heard()
        super().__init__({**config, "error_cb": self.heard})

    def failed(self, servers: Cluster | str, exc: KafkaException) -> KafkaUnavailable:
        self.poll(0)  # the client hands its errors over as it is polled
        return KafkaUnavailable(f"Kafka at {servers} did not answer: {self.heard.reason(exc.args[0])}")


def _consumer(servers: Cluster | str, timeout: float) -> _Looking:
    # no group: the console only looks (assign, never subscribe) and commits nothing
    return _Looking(
        {**_config(servers, timeout), "group.id": "statekeeper-console", "enable.auto.commit": False,
         "enable.partition.eof": True, "log_level": 0, "logger": _quiet}
    )  # fmt: skip


class _Quiet:
    def log(self, *args: Any, **kwargs: Any) -> None:
        pass


_quiet = _Quiet()


def _listed(consumer: _Looking, servers: Cluster | str, topic: str, timeout: float) -> list[int]:
    """The topic's partitions as the broker lists them now; KafkaUnavailable when it does not answer or the topic
    cannot be read."""
    try:
        meta = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
    except KafkaException as exc:
        raise consumer.failed(servers, exc) from exc
    if meta is None or meta.error is not None or not meta.partitions:
        why = meta.error.str() if meta is not None and meta.error is not None else "no partitions"
        raise KafkaUnavailable(f"topic {topic!r} cannot be read at {servers}: {why}")
    return sorted(meta.partitions)


def partitions(servers: Cluster | str, topic: str, timeout: float = 5.0) -> list[int]:
    """The topic's partitions, as the broker lists them now."""
    consumer = _consumer(servers, timeout)
    try:
        return _listed(consumer, servers, topic, timeout)
    finally:
        consumer.close()


def end_offsets(servers: Cluster | str, topic: str, timeout: float = 5.0) -> dict[int, tuple[int, int]]:
    """Each partition's (earliest, end) offsets: the first record the broker still holds and the next one to come."""
    consumer = _consumer(servers, timeout)
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout, cached=False)
            for p in _listed(consumer, servers, topic, timeout)
        }
    except KafkaException as exc:
        raise consumer.failed(servers, exc) from exc
    finally:
        consumer.close()


def record_times(servers: Cluster | str, topic: str, at: dict[int, int], timeout: float = 5.0) -> dict[int, float]:
    """The timestamp (seconds) of the record at each partition's offset in ``at``, where the broker still holds one."""
    if not at:
        return {}
    consumer = _consumer(servers, timeout)
    found: dict[int, float] = {}
    done: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        consumer.assign([TopicPartition(topic, p, o) for p, o in at.items()])
        while len(done) < len(at) and (left := deadline - time.monotonic()) > 0:
            message = consumer.poll(left)
            if message is None:
                break
            error, partition = message.error(), message.partition()
            if (
                partition is None
                or partition in done
                or (error is not None and error.code() != KafkaError._PARTITION_EOF)
            ):
                continue
            if error is None and (stamp := message.timestamp())[0] != 0:  # 0: TIMESTAMP_NOT_AVAILABLE
                found[partition] = stamp[1] / 1000
            done.add(partition)  # a record, or the end of the partition: one look each is enough
            consumer.pause([TopicPartition(topic, partition)])
    except KafkaException as exc:
        raise consumer.failed(servers, exc) from exc
    finally:
        consumer.close()
    return found


def ensure_topic(servers: Cluster | str, topic: str, partitions: int, timeout: float = 10.0) -> bool:
    """Make the topic with this many partitions unless it exists; True when it was made now."""
    heard = Heard()
    admin = AdminClient({**_config(servers, timeout), "error_cb": heard, "logger": _quiet})  # type: ignore[dict-item]
    future = admin.create_topics([NewTopic(topic, partitions, 1)], request_timeout=timeout)[topic]
    try:
        future.result(timeout=timeout)
    except (KafkaException, TimeoutError) as exc:
        error = exc.args[0] if isinstance(exc, KafkaException) else None
        if error is not None and error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
            return False
        admin.poll(0)  # the client hands its errors over as it is polled
        why = heard.reason(error if error is not None else f"no answer within {timeout:g} s")
        raise KafkaUnavailable(f"topic {topic!r} could not be made at {servers}: {why}") from exc
    return True


def delete_topic(servers: Cluster | str, topic: str, timeout: float = 10.0) -> None:
    """Delete the topic and wait for the broker to say so (a topic already gone is fine)."""
    admin = AdminClient(_config(servers, timeout))
    try:
        admin.delete_topics([topic], request_timeout=timeout)[topic].result(timeout=timeout)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise KafkaUnavailable(f"topic {topic!r} could not be deleted at {servers}: {exc.args[0]}") from exc


def producer(servers: Cluster | str, timeout: float = 10.0) -> Producer:
    """A producer that waits for the broker's acknowledgement and retries on its own (idempotent: no duplicate
    from a retry), so a broker that is away for a while loses nothing that was handed to it."""
    return Producer(
        {**_config(servers, timeout), "enable.idempotence": True, "acks": "all", "linger.ms": 20,
         "message.timeout.ms": 300_000}
    )  # fmt: skip


def offsets_of(end_offset: Any, topic: str) -> dict[int, int]:
    """A checkpoint's end offset for ``topic`` ({"topic": {"0": n, ...}}, or its JSON text) as partition -> offset
    (``records.kafka_offsets`` reads it)."""
    if isinstance(end_offset, str):
        try:
            end_offset = json.loads(end_offset)
        except ValueError:
            return {}
    return (kafka_offsets(end_offset) or {}).get(topic, {})


def spread(start: dict[str, int], ending: dict[str, int], most: int) -> dict[str, int]:
    """Each partition's end of a batch that reads at most ``most`` records between ``start`` and ``ending``, shared
    evenly among the partitions that have records (one with fewer leaves its share to the others).

    >>> spread({"0": 0, "1": 10}, {"0": 100, "1": 12}, 10)
    {'0': 8, '1': 12}
    """
    end = dict(start)
    left = most
    open_ = [p for p in ending if ending[p] > start.get(p, 0)]
    while left > 0 and open_:
        share = max(1, left // len(open_))
        for p in list(open_):
            take = min(share, ending[p] - end.get(p, 0), left)
            end[p] = end.get(p, 0) + take
            left -= take
            if end[p] >= ending[p]:
                open_.remove(p)
            if left <= 0:
                break
    return end


def lag_by_partition(ends: dict[int, tuple[int, int]], committed: dict[int, int]) -> dict[int, int]:
    """Records not yet read, per partition: its end offset against the committed one (a partition the job has not
    seen yet counts from the earliest record the broker holds: Spark starts new partitions there)."""
    return {p: max(0, end - committed.get(p, earliest)) for p, (earliest, end) in ends.items()}


def send_all(producing: Producer, topic: str, values: Iterable[tuple[bytes | None, bytes]], flush: bool = True) -> int:
    """Hand every (key, value) to the producer and, with ``flush``, wait until the broker has them all; the count."""
    sent = 0
    for key, value in values:
        while True:
            try:
                producing.produce(topic, value=value, key=key)
                break
            except BufferError:  # the local queue is full: let deliveries drain, then go on
                producing.poll(0.5)
        sent += 1
    if flush:
        producing.flush()
    return sent


def headers_since(
    servers: Cluster | str, topic: str, since: dict[int, int], header: str, timeout: float = 30.0
) -> set[str]:
    """The values of ``header`` on the records written to ``topic`` from the offsets ``since`` (partition -> offset; a
    partition not there from its earliest) up to its end now: what a re-drive that was cut short had written."""
    ends = end_offsets(servers, topic, timeout)
    wanted = {p: since.get(p, first) for p, (first, end) in ends.items() if since.get(p, first) < end}
    found: set[str] = set()
    if not wanted:
        return found
    consumer = _consumer(servers, timeout)
    deadline = time.monotonic() + timeout
    try:
        consumer.assign([TopicPartition(topic, p, o) for p, o in wanted.items()])
        left = dict(wanted)
        while left and time.monotonic() < deadline:
            message = consumer.poll(1.0)
            if message is None or message.error() is not None:
                continue
            partition, offset = message.partition(), message.offset()
            headers: Any = message.headers() or []  # a consumer's: a list of (name, bytes or None)
            found.update(value.decode() for name, value in headers if name == header and value is not None)
            if partition in left and offset is not None and offset + 1 >= ends[partition][1]:
                del left[partition]
        if left:
            raise KafkaUnavailable(f"topic {topic!r} at {servers} was not read to its end in {timeout:.0f} s")
    except KafkaException as exc:
        raise consumer.failed(servers, exc) from exc
    finally:
        consumer.close()
    return found
