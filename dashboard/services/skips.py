"""Skip a failing batch's entries. When a job fails the same batch again and again (a bug in its code, not an entry
the source can recognise as bad), the operator sends that batch's entries to the dead letter and the job resumes
after them: an audited action, only while the job is down, only for the batch that is failing now. The entries can
be re-driven into the source once the code is fixed."""

from __future__ import annotations

import json

from dashboard.checkpoint_dir.files import planned_batch
from dashboard.connections import redis_client
from dashboard.models import Action
from dashboard.services.action_keys import action_progress
from dashboard.services.errors import ActionFailed
from dashboard.services.run_waits import refuse_while_alive
from dashboard.services.runs import job_request_start


def skip_action(action: Action) -> str:
    job = action.job
    refuse_while_alive(job, "skipping entries")
    planned = planned_batch(job.checkpoint_location)
    wanted = action.params.get("batch")
    if planned is None or planned.batch != wanted:
        now = f"batch {planned.batch} is planned now" if planned else "no batch is planned and uncommitted now"
        raise ActionFailed(f"Batch {wanted} is no longer the failing one ({now}); nothing was skipped.")
    if "id" not in planned.after or "id" not in planned.upto:
        raise ActionFailed(f"Batch {planned.batch}'s offsets name no stream entries; nothing was skipped.")
    record = {"after": planned.after["id"], "upto": planned.upto["id"], "action": action.id, "batch": planned.batch}
    client = redis_client(timeout=5)
    existing = [json.loads(r) for r in client.lrange(job.skip_list, 0, -1)]
    if not any((r["after"], r["upto"]) == (record["after"], record["upto"]) for r in existing):
        client.rpush(job.skip_list, json.dumps(record))
    action_progress(action, f"skipping {planned.entries} entries; starting {job.name}")
    run = job_request_start(job=job)
    return (
        f"Batch {planned.batch}'s {planned.entries:,} entries (after {record['after']} up to {record['upto']}) go to "
        f"the dead letter as the batch is replayed; {job.name} resumes after them (run #{run.id})."
    )
