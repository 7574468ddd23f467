"""Dead letters stay bounded (per job: how many and how old, trimmed with their once-only markers), and an operator
can re-drive them into the source once the cause is fixed. Into a Redis stream, each goes back as a new entry and
leaves the dead letter in one step, so a retried action re-drives nothing twice. Into a Kafka topic, a chunk leaves
the dead letters for the action's own list in one step, after the topic's end offsets are noted; each record carries
its dead letter's id in a header; the list goes once the broker has them all. A retry of an action cut short reads
the topic from the noted offsets for those headers and sends only what is not there."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import redis
from django.utils import timezone

from dashboard import kafka
from dashboard.connections import redis_client
from dashboard.models import Action, Job
from dashboard.services.action_keys import action_progress
from dashboard.services.errors import ActionFailed
from dashboard.services.secrets import kafka_cluster

# Move the chosen dead letters (still there, not a sink's refusal) out of KEYS[1] in one step, each only if it is still
# there (a retry finds it gone): ARGV[1] "stream" adds each payload to the Redis stream KEYS[2] as a new entry (a Redis
# job's source); "list" keeps it in the hash KEYS[2], id -> payload (a Kafka re-drive's list on its way to the topic).
_MOVE = """
local moved = 0
for i = 2, #ARGV do
  local found = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
  if #found == 1 then
    local fields = found[1][2]
    local payload, stage = nil, nil
    for j = 1, #fields, 2 do
      if fields[j] == 'payload' then payload = fields[j + 1] end
      if fields[j] == 'stage' then stage = fields[j + 1] end
    end
    if payload and stage ~= 'sink' then
      if ARGV[1] == 'stream' then
        redis.call('XADD', KEYS[2], '*', 'v', payload)
      else
        redis.call('HSET', KEYS[2], ARGV[i], payload)
      end
      redis.call('XDEL', KEYS[1], ARGV[i])
      moved = moved + 1
    end
  end
end
return moved
"""
CHUNK = 500
REDRIVE_HEADER = "statekeeper-redrive"  # a re-driven record's header: the id of the dead letter it was


def dead_letters_trim(now: datetime | None = None) -> dict[str, int]:
    """Keep each job's dead letters within its max count and age; their once-only markers go with them."""
    now = now or timezone.now()
    client = redis_client(timeout=10)
    trimmed = 0
    for job in Job.objects.all():
        cutoff_ms = int((now - timedelta(hours=job.dead_letter_max_age_hours)).timestamp() * 1000)
        try:
            trimmed += int(client.xtrim(job.dead_letter_stream, maxlen=job.dead_letter_max_entries, approximate=True))
            trimmed += int(client.xtrim(job.dead_letter_stream, minid=f"{cutoff_ms}-0", approximate=True))
            client.zremrangebyscore(f"{job.dead_letter_stream}:seen", "-inf", f"({cutoff_ms}")
        except redis.RedisError:
            continue
    return {"trimmed": trimmed}


def redrive_action(action: Action) -> str:
    """Re-drive the chosen dead letters (params "ids"), or all of them ("all"), into the job's source stream.
    Results the sink refused are not events and stay."""
    job = action.job
    if job.reads_files:
        raise ActionFailed(
            f"{job.name} reads files: its dead letters cannot be re-driven into {job.source_path}. Export them, fix "
            "the rows, and drop them into the directory as a new file; nothing was moved."
        )
    client = redis_client(timeout=30)
    if action.params.get("all"):
        ids = [i.decode() for i, _ in client.xrange(job.dead_letter_stream)]
    else:
        ids = [str(i) for i in action.params.get("ids", [])]
    if job.reads_kafka:
        return _redrive_kafka(action, client, ids)
    if not ids:
        raise ActionFailed("No dead letters were chosen; nothing was re-driven.")
    script = client.register_script(_MOVE)
    moved = 0
    for start in range(0, len(ids), CHUNK):
        moved += int(
            script(keys=[job.dead_letter_stream, job.source_stream], args=["stream", *ids[start : start + CHUNK]])
        )
        action_progress(action, f"re-driven {moved} of {len(ids)}")
    left = len(ids) - moved
    note = f"; {left} stayed (a sink's refusal is not an event, or already re-driven)" if left else ""
    return f"{moved} dead letters re-driven into {job.source_stream} as new entries{note}."


def _redrive_kafka(action: Action, client: redis.Redis, ids: list[str]) -> str:
    job = action.job
    cluster = kafka_cluster(job)
    pending, since = (
        f"{job.dead_letter_stream}:redriving:{action.id}",
        f"{job.dead_letter_stream}:redriving:{action.id}:from",
    )
    moved = _redrive_pending(job, client, cluster, pending, since)  # what a run cut short had taken
    if not ids and not moved:
        raise ActionFailed("No dead letters were chosen; nothing was re-driven.")
    claim = client.register_script(_MOVE)
    for start in range(0, len(ids), CHUNK):
        try:  # noted before any of the chunk is sent: a retry reads the topic from here for what was
            client.set(since, json.dumps(kafka.end_offsets(cluster, job.source_stream, timeout=10)))
        except kafka.KafkaUnavailable as exc:
            raise ActionFailed(f"{exc}; {moved} re-driven so far, the rest are still dead letters.") from None
        if int(claim(keys=[job.dead_letter_stream, pending], args=["list", *ids[start : start + CHUNK]])):
            moved += _redrive_pending(job, client, cluster, pending, since)
        action_progress(action, f"re-driven {moved} of {len(ids)}")
    left = len(ids) - moved
    note = f"; {left} stayed (a sink's refusal is not an event, or already re-driven)" if left > 0 else ""
    return f"{moved} dead letters re-driven into the Kafka topic {job.source_stream} as new records{note}."


def _redrive_pending(job: Job, client: redis.Redis, cluster: kafka.Cluster, pending: str, since: str) -> int:
    """Send the action's list to the topic, each record once: those a run cut short had sent already (their header
    found after the noted offsets) are not sent again. The list goes once the broker has them all."""
    taken = {k.decode(): v for k, v in client.hgetall(pending).items()}
    if not taken:
        return 0
    noted = {int(p): (first, end) for p, (first, end) in json.loads(client.get(since) or "{}").items()}
    try:
        sent = kafka.headers_since(
            cluster, job.source_stream, {p: end for p, (_, end) in noted.items()}, REDRIVE_HEADER
        )
        producing = kafka.producer(cluster)
        for entry, payload in taken.items():
            if entry not in sent:
                producing.produce(job.source_stream, value=payload, headers=[(REDRIVE_HEADER, entry.encode())])
                producing.poll(0)
        if producing.flush(60):
            raise kafka.KafkaUnavailable(f"the broker at {cluster} did not take every record within 60 s")
    except kafka.KafkaUnavailable as exc:
        raise ActionFailed(f"{exc}; the {len(taken)} taken are kept and sent when the action is retried.") from None
    client.delete(pending, since)
    return len(taken)
