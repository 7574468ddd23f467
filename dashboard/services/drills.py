"""Restore drills: for each job, prove that its newest savepoint can really be restored. The files are checked against
the manifest's checksums, then Spark's state reader loads the state in a process of its own, and the rows it finds
must equal what the checkpoint history recorded for that batch. The result is stored on the savepoint."""

from __future__ import annotations

import json
from pathlib import Path

from django.utils import timezone

from dashboard.models import Checkpoint, Job, Savepoint
from dashboard.selectors.savepoints import savepoint_newest_verified
from dashboard.services.errors import ActionFailed
from dashboard.services.savepoints import MANIFEST, savepoint_read_back


def drill(savepoint: Savepoint) -> tuple[bool, str]:
    folder = Path(savepoint.path)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        return False, f"the manifest cannot be read: {exc}"
    try:
        result, _ = savepoint_read_back(folder, manifest)
    except ActionFailed as exc:  # SavepointDamaged says which files differ
        return False, str(exc)
    rows = sum(sum(op["rows"].values()) for op in result["operators"])
    recorded = (
        Checkpoint.objects.filter(
            job=savepoint.job, batch_id=int(manifest["batch_id"]), committed_at__lte=savepoint.created_at
        )
        .order_by("-committed_at")
        .values_list("state_rows_total", flat=True)
        .first()
    )
    if recorded is None:
        return True, f"Spark read {rows} state rows; no checkpoint record of batch {savepoint.batch_id} to compare with"
    if rows != recorded:
        return (
            False,
            f"Spark read {rows} state rows, the checkpoint history recorded {recorded} at batch {savepoint.batch_id}",
        )
    return True, f"Spark read {rows} state rows, as recorded at batch {savepoint.batch_id}"


def drills_run() -> list[str]:
    """Drill the newest verified savepoint of every job."""
    notes = []
    for job in Job.objects.all():
        savepoint = savepoint_newest_verified(job)
        if savepoint is None:
            continue
        ok, message = drill(savepoint)
        Savepoint.objects.filter(id=savepoint.id).update(drilled_at=timezone.now(), drill_ok=ok, drill_message=message)
        notes.append(f"{job.name} savepoint #{savepoint.id}: {'ok' if ok else 'FAILED'}: {message}")
    return notes
