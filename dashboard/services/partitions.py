"""Counting state rows per partition: Spark's state reader on the job's newest committed batch, in a process of its
own. Spark's progress events give rows per operator only; this is the per-partition count, on request."""

from __future__ import annotations

from dashboard.checkpoint_dir.files import CheckpointError, latest_committed
from dashboard.models import Action, Job
from dashboard.services.action_keys import SPARK_READS, Keys, action_progress, memo_save, remember
from dashboard.services.action_steps import Done, Outcome, Steps, Wait
from dashboard.services.errors import ActionFailed
from dashboard.services.state_reader_client import reader_step, state_read


def count_rows(action: Action) -> Outcome:
    job: Job = action.job
    if (batch := action.memo.get("batch")) is None:
        if not job.has_state():
            raise ActionFailed(f"{job.name} has no committed state to count yet.")
        try:
            batch = latest_committed(job.checkpoint_location)
        except CheckpointError as exc:
            raise ActionFailed(str(exc)) from None
        memo_save(action, batch=batch)
        action_progress(action, f"reading the state of batch {batch} with Spark's state reader")
    # the files of a committed batch never change; a running job writes only newer versions beside them
    result = state_read(action, "rows", "partition-rows", job.checkpoint_location, batch)
    if result is None:
        return Wait(f"reading the state of batch {batch} with Spark's state reader", 0.5)
    rows = {f"{op['id']}:{part}": n for op in result["operators"] for part, n in op["rows"].items()}
    remember(action, batch=batch, location=job.checkpoint_dir, rows=rows)
    total = sum(rows.values())
    return Done(f"Counted {total} state rows in {len(rows)} partitions at batch {batch}.")


# the batch read (for the next visit, and shown), the checkpoint directory, the rows per "operator:partition"
COUNT_ROWS_KEYS = SPARK_READS + Keys(memo={"batch": int}, params={"batch": int, "location": str, "rows": dict})
COUNT_ROWS_STEPS: Steps = {**reader_step(then="run"), "run": ("count rows", count_rows)}
