"""The secrets the console keeps, as the Secrets page and the API list them: names, versions and the jobs that use
them; never a value (dashboard/services/secrets.py keeps those)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dashboard.models import ACTIVE_RUN_STATUSES, Job, Run, Secret

REFERENCE = re.compile(r"\$\{secret:([^}]*)\}")


def referenced(values: Any) -> list[str]:
    """The secrets a value (a job's parameters, any JSON) names, in order, once each."""
    found: list[str] = []
    for text in _texts(values):
        found += REFERENCE.findall(text)
    return list(dict.fromkeys(found))


def _texts(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _texts(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _texts(item)


def used_by(name: str) -> list[Job]:
    """The jobs (archived ones too) whose parameters name the secret."""
    return [job for job in Job.objects.order_by("name") if name in referenced(job.parameters or {})]


@dataclass
class SecretRow:
    secret: Secret
    jobs: list[str] = field(default_factory=list)
    # running jobs whose run started with an older version: the rotation reaches them at their next start or upgrade
    stale: list[str] = field(default_factory=list)


def secret_row(name: str) -> SecretRow | None:
    """One secret as ``secret_list`` gives it; None when there is none of that name."""
    return next(iter(secret_list(name=name)), None)


def secret_list(name: str = "") -> list[SecretRow]:
    """Every secret (``name``: that one only), with the jobs that name it and those still running an older version of
    it. One query for the secrets, one for the jobs, one for their active runs' deploys."""
    secrets = Secret.objects.order_by("name")
    rows = {s.name: SecretRow(s) for s in (secrets.filter(name=name) if name else secrets)}
    jobs = list(Job.objects.filter(archived_at__isnull=True).order_by("name").only("id", "name", "parameters"))
    active = {
        r.job_id: (r.deploy.secret_versions if r.deploy else {})
        for r in Run.objects.filter(status__in=ACTIVE_RUN_STATUSES, job__in=jobs).select_related("deploy")
    }
    for job in jobs:
        for name in referenced(job.parameters or {}):
            if (row := rows.get(name)) is None:
                continue
            row.jobs.append(job.name)
            ran = active.get(job.id, {}).get(name)
            if job.id in active and ran is not None and ran != row.secret.version:
                row.stale.append(job.name)
    return list(rows.values())
