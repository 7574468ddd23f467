"""Deploys and upgrades of a job, as the Deploys tab shows them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import Count, Max, Min
from statekeeper_sdk._runtime.compatibility import parameter_changes

from dashboard import pipelines
from dashboard.models import Action, ActionKind, ActionStatus, Deploy, Job


def deploy_history(job: Job) -> list[Deploy]:
    """Every deploy, newest first, with how many runs ran it and when, and its parameters' changes from the deploy
    before it (``parameter_changes``; every value for the first)."""
    deploys: list[Deploy] = list(
        job.deploys.select_related("operator", "upgrade")
        .annotate(run_count=Count("runs"), first_run=Min("runs__requested_at"), last_run=Max("runs__requested_at"))
        .order_by("-id")
    )
    for deploy, before in zip(deploys, [*deploys[1:], None], strict=False):  # the oldest has none before it
        if before is None:
            deploy.parameter_changes = pipelines.format_parameters(deploy.parameters, deploy.pipeline).splitlines()  # type: ignore[attr-defined]
        else:
            deploy.parameter_changes = [  # type: ignore[attr-defined]
                *parameter_changes(before.parameters, deploy.parameters),
                *secret_changes(before.secret_versions or {}, deploy.secret_versions or {}),
            ]
    return deploys


def secret_changes(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """Each secret rotated between two deploys, as ``secret NAME: changed`` (never a value)."""
    return [f"secret {name}: changed" for name in sorted(after) if name in before and before[name] != after[name]]


@dataclass
class UpgradeView:
    targets: list[tuple[str, str]]  # (name, title) of every other registered pipeline
    plan: Action | None  # the newest preview or upgrade with a plan
    running: Action | None  # the preview, shadow run or upgrade in flight, if any
    shadow: Action | None  # the newest shadow run that finished with a diff
    rollback: Action | None  # the latest succeeded upgrade, while the job still runs its target
    history: list[Action]
    parameters: str  # the job's values now, as the upgrade form's text (name = value lines)
    declared: list[tuple[str, list[Any]]]  # (pipeline, its Parameter records) for every target that declares any
    migrations: list[tuple[str, str]]  # (pipeline, what it does) for every target that migrates the job's state


def upgrade_view(job: Job) -> UpgradeView:
    kinds = [ActionKind.UPGRADE_PREVIEW, ActionKind.UPGRADE_SHADOW, ActionKind.UPGRADE, ActionKind.UPGRADE_ROLLBACK,
             ActionKind.BLUE_GREEN]  # fmt: skip
    history = list(job.actions.filter(kind__in=kinds).select_related("requested_by").order_by("-id")[:20])
    plan = next((a for a in history if a.params.get("plan")), None)
    shadow = next((a for a in history if a.params.get("shadow")), None)
    upgrades = (ActionKind.UPGRADE, ActionKind.BLUE_GREEN)
    latest = next((a for a in history if a.kind in upgrades and a.status == ActionStatus.SUCCEEDED), None)
    rolled_back = latest is not None and any(
        a.kind == ActionKind.UPGRADE_ROLLBACK and a.status == ActionStatus.SUCCEEDED and a.id > latest.id
        for a in history
    )
    rollback = latest if latest and not rolled_back and latest.params.get("pipeline") == job.pipeline else None
    found = pipelines.registry()
    module = found.references.get(job.pipeline, "").partition(":")[0]
    # versions from the same module first: the likely upgrades
    others = sorted(
        (name for name in found.pipelines if name != job.pipeline),
        key=lambda name: (found.references[name].partition(":")[0] != module, name),
    )
    targets = [(name, found.pipelines[name].title) for name in others]
    current = found.pipelines.get(job.pipeline)
    if current is not None and tuple(
        getattr(current, "parameters", None) or ()
    ):  # the same code with other values is an upgrade
        targets.insert(0, (job.pipeline, "the same pipeline, with the parameters below"))
    values = pipelines.values_or_stored(job.pipeline, job.parameters)
    declared = [(name, list(found.pipelines[name].parameters)) for name, _ in targets
                if tuple(getattr(found.pipelines[name], "parameters", None) or ())]  # fmt: skip
    migrations = [(name, migration.description) for name in others
                  if (migration := pipelines.migration(name, job.pipeline)) is not None]  # fmt: skip
    return UpgradeView(
        targets,
        plan,
        next((a for a in history if a.in_flight), None),
        shadow,
        rollback,
        history,
        pipelines.format_parameters(values, job.pipeline),
        declared,
        migrations,
    )
