"""Demo event producer: ``produce_events url-counts=events:url-counts url-counts=kafka:access-log --rate 200``
writes to a Redis stream, or to a Kafka topic (``kafka:TOPIC``, on STATEKEEPER_KAFKA_BOOTSTRAP, made with
``--partitions`` partitions when missing, each record keyed at random so that every partition gets some); Ctrl-C
stops it."""

from __future__ import annotations

import random
import time
from typing import Any

import redis
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from dashboard import kafka, pipelines
from dashboard.engine.samples import sample_events

MALFORMED = ["GET /oops", '{"order_id": 42}', "not json at all", ""]


class Command(BaseCommand):
    help = "Write demo events for pipelines to Redis streams, at a steady rate, with a few malformed ones."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("targets", nargs="+", help="PIPELINE=STREAM or PIPELINE=kafka:TOPIC pairs")
        parser.add_argument("--partitions", type=int, default=3, help="partitions of a Kafka topic made here")
        parser.add_argument("--rate", type=float, default=200.0, help="events per second per stream")
        parser.add_argument("--malformed", type=float, default=0.002, help="share of malformed events")
        parser.add_argument("--count", type=int, default=0, help="stop after this many events per stream (0: never)")
        parser.add_argument("--seed", type=int, default=None)
        parser.add_argument(
            "--keep", type=int, default=500_000,
            help="entries each stream keeps (about 40 minutes at 200/s: what a restore of the last half hour replays)",
        )  # fmt: skip

    def handle(self, *args: Any, **opts: Any) -> None:
        targets = []
        rng = random.Random(opts["seed"])
        for target in opts["targets"]:
            name, _, stream = target.partition("=")
            pipeline = pipelines.find(name)
            if pipeline is None or not stream:
                raise CommandError(
                    f"{target!r}: expected PIPELINE=STREAM with a pipeline from {', '.join(pipelines.names())}"
                )
            if stream.startswith("kafka:"):
                kafka.ensure_topic(settings.KAFKA_BOOTSTRAP, stream.removeprefix("kafka:"), opts["partitions"])
            targets.append((stream, sample_events(pipeline, rng)))
        client = redis.Redis.from_url(settings.REDIS_URL)
        producing = (
            kafka.producer(settings.KAFKA_BOOTSTRAP) if any(s.startswith("kafka:") for s, _ in targets) else None
        )
        sent, tick, started = 0, 0.1, time.monotonic()
        while not opts["count"] or sent < opts["count"]:
            due = int((time.monotonic() - started) * opts["rate"]) - sent
            if opts["count"]:
                due = min(due, opts["count"] - sent)
            if due > 0:
                try:
                    pipe = client.pipeline(transaction=False)
                    now_ms = int(time.time() * 1000)
                    for stream, make in targets:
                        for _ in range(due):
                            bad = rng.random() < opts["malformed"]
                            value = rng.choice(MALFORMED) if bad else make(now_ms)
                            if producing is not None and stream.startswith("kafka:"):
                                # the producer's own queue holds what a broker away for a while has not taken yet
                                key = rng.randbytes(4)
                                kafka.send_all(
                                    producing, stream.removeprefix("kafka:"), [(key, value.encode())], flush=False
                                )
                            else:
                                pipe.xadd(stream, {"v": value}, maxlen=opts["keep"], approximate=True)
                    pipe.execute()
                    if producing is not None:
                        producing.poll(0)
                    sent += due
                except redis.ConnectionError as exc:  # Redis restarting: wait, the backlog is sent when it is back
                    self.stderr.write(f"Redis unreachable ({exc}); retrying")
                    time.sleep(1)
            time.sleep(tick)
