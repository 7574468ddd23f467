"""Counting state rows per partition: Spark's state reader on the job's newest committed batch, in a process of its
own. Spark's progress events give rows per operator only; this is the per-partition count, on request."""

from __future__ import annotations

from dashboard.checkpoint_dir.files import CheckpointError, latest_committed
from dashboard.models import Action, Job
from dashboard.services.action_steps import (
    Steps,
    action_progress,
    one_step,
    reader_step,
    run_state_tool,
)
from dashboard.services.errors import ActionFailed


def count_rows_action(action: Action) -> str:
    job: Job = action.job
    if not job.has_state():
        raise ActionFailed(f"{job.name} has no committed state to count yet.")
    try:
        batch = latest_committed(job.checkpoint_location)
    except CheckpointError as exc:
        raise ActionFailed(str(exc)) from None
    action_progress(action, f"reading the state of batch {batch} with Spark's state reader")
    # the files of a committed batch never change; a running job writes only newer versions beside them
    result = run_state_tool("partition-rows", job.checkpoint_location, batch)
    rows = {f"{op['id']}:{part}": n for op in result["operators"] for part, n in op["rows"].items()}
    Action.objects.filter(id=action.id).update(
        params={**action.params, "batch": batch, "location": job.checkpoint_dir, "rows": rows}
    )
    total = sum(rows.values())
    return f"Counted {total} state rows in {len(rows)} partitions at batch {batch}."


COUNT_ROWS_STEPS: Steps = {**reader_step(then="run"), **one_step("count rows", count_rows_action)}
