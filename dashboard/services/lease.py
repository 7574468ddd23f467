"""The checkpoint lease: one writer per checkpoint location, with a fencing token that only ever grows.

The lease lives in the database, not in Redis, so a Redis restart cannot hand it to a second driver. A driver renews it
while it runs; a sink write checks the token in the same transaction, so a driver that lost its lease writes nothing.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db.models import F, Q
from django.utils import timezone

from dashboard.models import Job


def lease_acquire(*, job_id: int) -> int | None:
    """A new fencing token if the lease is free or expired; None if someone holds it."""
    now = timezone.now()
    taken = (
        Job.objects.filter(id=job_id)
        .filter(Q(lease_expires_at__isnull=True) | Q(lease_expires_at__lte=now))
        .update(lease_token=F("lease_token") + 1, lease_expires_at=now + timedelta(seconds=settings.LEASE_TTL_SECONDS))
    )
    if not taken:
        return None
    return int(Job.objects.values_list("lease_token", flat=True).get(id=job_id))


def lease_renew(*, job_id: int, token: int) -> bool:
    """Extend the lease of the driver holding this token; False when another token holds it or it has expired (a
    driver paused past its lease must not take it back: someone may have started in its place)."""
    now = timezone.now()
    expires = now + timedelta(seconds=settings.LEASE_TTL_SECONDS)
    renewed = Job.objects.filter(id=job_id, lease_token=token, lease_expires_at__gt=now).update(
        lease_expires_at=expires
    )
    return renewed == 1


def lease_release(*, job_id: int, token: int) -> None:
    Job.objects.filter(id=job_id, lease_token=token).update(lease_expires_at=None)
