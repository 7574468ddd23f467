"""The console's database goes away for a while (its connections dropped, new ones refused, as in a restart or with
every slot taken) while a job runs in a driver of its own, events flow and an operator's savepoint is in flight:
nothing is lost or counted twice, and everything comes back on its own once the database answers again."""

from __future__ import annotations

import time

import pytest
from django.conf import settings
from django.db import connection

from dashboard.models import ActionKind, ActionStatus, RunStatus
from dashboard.services.actions import action_request
from dashboard.services.runs import job_request_start
from tests.conftest import wait_for
from tests.support import Producer, drain_and_stop, finished, running_with_progress, sink_total

pytestmark = pytest.mark.django_db(transaction=True)
OUTAGE_SECONDS = 20


def refuse_connections(refuse: bool) -> None:
    """The test database takes no new connection but a superuser's (as when every slot is taken: "too many
    connections"), and the sessions of this test's Celery worker and driver are ended (as in a restart); or it takes
    them again. Those processes connect as the app role; the test process's own sessions (a superuser's, which later
    tests go on using) and the session's state reader are left alone."""
    name = connection.settings_dict["NAME"]
    with connection.cursor() as cursor:
        cursor.execute(f'ALTER DATABASE "{name}" CONNECTION LIMIT {0 if refuse else -1}')
        if refuse:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND usename = %s "
                "AND application_name IN ('statekeeper-worker', 'statekeeper-driver', 'statekeeper-job-lock')",
                [name, settings.DB_APP_ROLE],
            )


def test_a_database_outage_loses_no_batch_and_everything_comes_back(make_job, redis, stream_name, celery_worker):
    job = make_job(pipeline="url-counts", driver="own", restart_strategy="fixed-delay", restart_delay_seconds=1)
    producer = Producer(redis, stream_name, rate=100)
    producer.start()
    job_request_start(job=job)
    first = wait_for(lambda: running_with_progress(job), 240, 0.5, "the job to commit")
    savepoint = action_request(job=job, kind=ActionKind.SAVEPOINT)
    refuse_connections(True)
    try:
        ended = time.monotonic() + OUTAGE_SECONDS
        while time.monotonic() < ended:  # a session opened as the refusal took effect ends too
            time.sleep(2)
            refuse_connections(True)
    finally:
        refuse_connections(False)
    done = finished(savepoint, 300)
    assert done.status == ActionStatus.SUCCEEDED, done.outcome
    wait_for(lambda: job.runs.filter(status=RunStatus.RUNNING).exists(), 240, 0.5, "the job running again")
    drain_and_stop(job, producer, redis)
    assert sink_total(job) == producer.sent, "every event once, through the outage"
    assert first.id <= job.runs.order_by("-id").first().id
