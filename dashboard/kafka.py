"""The console's own Kafka client (confluent-kafka), for what it reads beside Spark: the broker's end offsets and the
time of the oldest unread record, per partition, so that a Kafka job's lag stays true while it is down (Spark's
connector reads and writes the topics themselves); and, for the demo and the tests, a topic made and written to.

No Django here: the servers arrive as arguments. Every call is bounded by ``timeout`` seconds, and a broker that does
not answer raises ``KafkaUnavailable`` rather than hanging the beat that samples lag."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from dashboard.records import kafka_offsets


class KafkaUnavailable(Exception):
    """The broker did not answer, or the topic does not exist."""


def _config(servers: str, timeout: float) -> dict[str, Any]:
    ms = int(timeout * 1000)
    return {"bootstrap.servers": servers, "socket.timeout.ms": ms, "socket.connection.setup.timeout.ms": ms}


def _consumer(servers: str, timeout: float) -> Consumer:
    # no group: the console only looks (assign, never subscribe) and commits nothing
    return Consumer(
        {**_config(servers, timeout), "group.id": "statekeeper-console", "enable.auto.commit": False,
         "enable.partition.eof": True, "log_level": 0, "logger": _quiet}
    )  # fmt: skip


class _Quiet:
    def log(self, *args: Any, **kwargs: Any) -> None:
        pass


_quiet = _Quiet()


def _listed(consumer: Consumer, servers: str, topic: str, timeout: float) -> list[int]:
    """The topic's partitions as the broker lists them now; KafkaUnavailable when it does not answer or the topic
    cannot be read."""
    try:
        meta = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
    except KafkaException as exc:
        raise KafkaUnavailable(f"Kafka at {servers} did not answer: {exc.args[0]}") from exc
    if meta is None or meta.error is not None or not meta.partitions:
        why = meta.error.str() if meta is not None and meta.error is not None else "no partitions"
        raise KafkaUnavailable(f"topic {topic!r} cannot be read at {servers}: {why}")
    return sorted(meta.partitions)


def partitions(servers: str, topic: str, timeout: float = 5.0) -> list[int]:
    """The topic's partitions, as the broker lists them now."""
    consumer = _consumer(servers, timeout)
    try:
        return _listed(consumer, servers, topic, timeout)
    finally:
        consumer.close()


def end_offsets(servers: str, topic: str, timeout: float = 5.0) -> dict[int, tuple[int, int]]:
    """Each partition's (earliest, end) offsets: the first record the broker still holds and the next one to come."""
    consumer = _consumer(servers, timeout)
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout, cached=False)
            for p in _listed(consumer, servers, topic, timeout)
        }
    except KafkaException as exc:
        raise KafkaUnavailable(f"Kafka at {servers} did not answer: {exc.args[0]}") from exc
    finally:
        consumer.close()


def record_times(servers: str, topic: str, at: dict[int, int], timeout: float = 5.0) -> dict[int, float]:
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
        raise KafkaUnavailable(f"Kafka at {servers} did not answer: {exc.args[0]}") from exc
    finally:
        consumer.close()
    return found


def ensure_topic(servers: str, topic: str, partitions: int, timeout: float = 10.0) -> bool:
    """Make the topic with this many partitions unless it exists; True when it was made now."""
    admin = AdminClient(_config(servers, timeout))
    future = admin.create_topics([NewTopic(topic, partitions, 1)], request_timeout=timeout)[topic]
    try:
        future.result(timeout=timeout)
    except KafkaException as exc:
        if exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
            return False
        raise KafkaUnavailable(f"topic {topic!r} could not be made at {servers}: {exc.args[0]}") from exc
    return True


def delete_topic(servers: str, topic: str, timeout: float = 10.0) -> None:
    """Delete the topic and wait for the broker to say so (a topic already gone is fine)."""
    admin = AdminClient(_config(servers, timeout))
    try:
        admin.delete_topics([topic], request_timeout=timeout)[topic].result(timeout=timeout)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
            raise KafkaUnavailable(f"topic {topic!r} could not be deleted at {servers}: {exc.args[0]}") from exc


def producer(servers: str, timeout: float = 10.0) -> Producer:
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
