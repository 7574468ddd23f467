"""Incidents reach the browsers the moment they are recorded: the code that records a run's start or end, an
action's outcome, a recovery or an alert calls ``incidents_publish``, and the incidents go to the live stream once
that transaction commits. The page dedups them by key, so publishing one again (an alert's opening with its
resolution) is harmless; a Redis outage loses only the push (a page load reads them from the database)."""

from __future__ import annotations

import logging
from typing import Any

import redis
from django.conf import settings
from django.db import transaction

from dashboard.connections import redis_client
from dashboard.engine.live import live_add, live_message

log = logging.getLogger(__name__)


def _push(job_id: int, incidents: list[dict[str, Any]]) -> None:
    try:
        pipe = redis_client(timeout=2).pipeline(transaction=False)
        for incident in incidents:
            live_add(pipe, settings.LIVE_STREAM, live_message(job_id, incident=incident))
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("incidents of job %s not pushed live (%s); the page shows them on its next load", job_id, exc)


def incidents_publish(job_id: int, incidents: list[dict[str, Any]]) -> None:
    if incidents:
        transaction.on_commit(lambda: _push(job_id, incidents))
