"""The watch over upgrades that returned before their new version proved itself (see ``upgrades``): a quiet job's
upgrade returns once the new run is up, and its first batch, or its failure, is seen here."""

from __future__ import annotations

from django.utils import timezone

from dashboard.models import Action, ActionKind, ActionStatus, Run, RunStatus
from dashboard.services.action_keys import remember
from dashboard.services.actions import action_request
from dashboard.services.errors import ActionRefused
from dashboard.services.upgrades import after_batch, first_batch


def upgrades_watch() -> list[str]:
    """Upgrades that returned before their new version committed a batch: proven by its first batch; rolled back by
    themselves when the run fails or is lost before it (an automatic "Roll back the upgrade", retried while another
    action holds the job); ended as "stopped" when an operator stopped it first. Runs before the restart strategy in
    each supervision, so a failed new version is rolled back, not restarted."""
    notes = []
    for upgrade in Action.objects.filter(
        kind=ActionKind.UPGRADE, status=ActionStatus.SUCCEEDED, params__proof__state="unproven"
    ).select_related("job"):
        run = Run.objects.filter(id=upgrade.params.get("run")).first()
        if run is None:
            continue
        proof = upgrade.proof
        if (batch := first_batch(run, after_batch(upgrade))) is not None:
            proof.update(state="proven", batch=batch, at=timezone.now().isoformat())
            notes.append(f"upgrade {upgrade.id} proven at batch {batch}")
        elif run.is_active:
            continue
        elif run.status in (RunStatus.FAILED, RunStatus.LOST) and not run.stop_requested_at:
            cause = run.message or f"run #{run.id} ended {run.status}"
            try:
                back = action_request(
                    job=upgrade.job, kind=ActionKind.UPGRADE_ROLLBACK, origin="upgrade-watch",
                    params={"upgrade": upgrade.id, "automatic": True, "cause": cause},
                )  # fmt: skip
            except ActionRefused as exc:
                notes.append(f"upgrade {upgrade.id} failed; its rollback waits: {exc}")
                continue
            proof.update(state="failed", cause=cause, rollback=back.id, at=timezone.now().isoformat())
            notes.append(f"upgrade {upgrade.id} failed before its first batch: rollback #{back.id}")
        else:
            proof.update(state="stopped", at=timezone.now().isoformat())
        remember(upgrade, proof=proof)
    return notes
