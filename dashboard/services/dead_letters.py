"""Dead letters stay bounded (per job: how many and how old, trimmed with their once-only markers), and an operator
can re-drive them into the source once the cause is fixed: each goes back as a new entry and leaves the dead letter
in one step, so a retried action re-drives nothing twice."""

from __future__ import annotations

from datetime import datetime, timedelta

import redis
from django.utils import timezone

from dashboard.connections import redis_client
from dashboard.models import Action, Job
from dashboard.services.action_keys import action_progress
from dashboard.services.errors import ActionFailed

# XADD the payload to the source and XDEL the dead letter, only if it is still there: a retry finds it gone.
_REDRIVE = """
local moved = 0
for i = 1, #ARGV do
  local found = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
  if #found == 1 then
    local fields = found[1][2]
    local payload, stage = nil, nil
    for j = 1, #fields, 2 do
      if fields[j] == 'payload' then payload = fields[j + 1] end
      if fields[j] == 'stage' then stage = fields[j + 1] end
    end
    if payload and stage ~= 'sink' then
      redis.call('XADD', KEYS[2], '*', 'v', payload)
      redis.call('XDEL', KEYS[1], ARGV[i])
      moved = moved + 1
    end
  end
end
return moved
"""
CHUNK = 500


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
    if not job.reads_redis:
        raise ActionFailed(f"{job.name} reads Kafka: export the dead letters and produce them to the topic again.")
    client = redis_client(timeout=30)
    if action.params.get("all"):
        ids = [i.decode() for i, _ in client.xrange(job.dead_letter_stream)]
    else:
        ids = [str(i) for i in action.params.get("ids", [])]
    if not ids:
        raise ActionFailed("No dead letters were chosen; nothing was re-driven.")
    script = client.register_script(_REDRIVE)
    moved = 0
    for start in range(0, len(ids), CHUNK):
        moved += int(script(keys=[job.dead_letter_stream, job.source_stream], args=ids[start : start + CHUNK]))
        action_progress(action, f"re-driven {moved} of {len(ids)}")
    left = len(ids) - moved
    note = f"; {left} stayed (a sink's refusal is not an event, or already re-driven)" if left else ""
    return f"{moved} dead letters re-driven into {job.source_stream} as new entries{note}."
