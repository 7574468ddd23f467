"""Steps that several actions share: report progress, stop the job and wait, read state with Spark in a process of
its own."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from django.conf import settings

from dashboard.models import ACTIVE_RUN_STATUSES, Action, Job, Run
from dashboard.services.errors import ActionFailed, ActionRefused
from dashboard.services.runs import job_request_stop, pid_alive


def action_progress(action: Action, text: str) -> None:
    Action.objects.filter(id=action.id).update(progress=text[:300])
    action.progress = text


def run_state_tool(
    command: str, path: Path, number: int, timeout: int = 900, spec: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Spark's reading of a checkpoint copy, in a process of its own (see workers/spark/state_tool.py)."""
    extra = [json.dumps(spec)] if spec is not None else []
    try:
        done = subprocess.run(
            [sys.executable, "-m", "workers.spark.state_tool", command, str(path), str(number), *extra],
            cwd=settings.BASE_DIR,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise ActionFailed(f"Spark's state reader did not finish within {timeout} s") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": done.stderr.strip().splitlines()[-1:] or "no output"}
    if done.returncode != 0 or "error" in result:
        raise ActionFailed(f"Spark could not read the state: {result.get('error')}")
    return dict(result)


def active_run(job: Job) -> Run | None:
    return job.runs.filter(status__in=ACTIVE_RUN_STATUSES).first()


def alive_run(job: Job) -> Run | None:
    """A run whose driver may still touch the checkpoint: one in flight, or an ended one whose process on this host
    is still there (a fenced driver on its way out)."""
    if (run := active_run(job)) is not None:
        return run
    host = socket.gethostname()
    return next((r for r in job.runs.order_by("-id")[:5] if r.host == host and r.pid and pid_alive(r.pid)), None)


def refuse_while_alive(job: Job, doing: str) -> None:
    """Checkpoint files are changed only while no driver of the job is alive."""
    if (run := alive_run(job)) is not None:
        state = run.get_status_display().lower() if run.is_active else f"{run.status}, its process still alive"
        raise ActionRefused(f"{job.name} has run #{run.id} ({state}): stop it before {doing}; nothing was changed.")


def wait_until_stopped(action: Action, job: Job, timeout: float | None = None) -> None:
    """Ask the running driver to drain and stop, and wait for it (a no-op when the job is not running)."""
    if active_run(job) is None:
        return
    action_progress(action, "stopping the job: the batch in flight commits first")
    job_request_stop(job=job)
    deadline = time.monotonic() + (timeout or settings.STOP_GRACE_SECONDS + 30)
    while active_run(job) is not None:
        if time.monotonic() > deadline:
            raise ActionFailed(f"{job.name} did not stop in time; nothing else was changed")
        time.sleep(0.5)
