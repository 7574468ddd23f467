"""A batch that fails again and again (a bug in user code) is named, with its entries, and an operator can skip
them: they go to the dead letter and the job resumes after them, every other event counted exactly once."""

from __future__ import annotations

import random

import pytest

from dashboard import pipelines
from dashboard.models import Action, ActionKind, ResultRow, RunStatus
from dashboard.services.actions import action_execute
from tests.conftest import grant, send_events, wait_for
from workers.spark.pipelines.url_counts import access_log_line

pytestmark = [pytest.mark.spark, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def failing_pipeline(settings):
    settings.PIPELINES = [*settings.BUILTIN_PIPELINES, "tests.user_pipelines:PIPELINE"]
    pipelines.registry.cache_clear()
    yield
    pipelines.registry.cache_clear()


def total(job) -> int:
    return sum(row.value["requests"] for row in ResultRow.objects.filter(job=job, kind="url"))


def test_a_failing_batch_is_named_skipped_by_an_operator_and_the_job_resumes_after_it(
    failing_pipeline, make_job, start_driver, redis, stream_name, client, django_user_model
):
    job = make_job(pipeline="failing-urls", max_records_per_batch=100)
    before = send_events(redis, stream_name, "url-counts", 250)
    redis.xadd(stream_name, {"v": access_log_line(random.Random(1), 0, urls=["/boom"])})
    after = send_events(redis, stream_name, "url-counts", 150, seed=2)

    driver = start_driver(job)
    driver.thread.join(180)
    assert driver.status == RunStatus.FAILED
    run = job.runs.get()
    assert "ValueError: cannot count /boom: a bug in this pipeline" in run.message
    assert run.message.startswith("Batch 2 failed (entries after "), "the batch and its entries come first"
    assert "100 entries" in run.message

    user = django_user_model.objects.create_user("oncall", password="x")
    grant(user, "operator")
    client.force_login(user)
    page = client.get(f"/jobs/{job.name}/exceptions").content.decode()
    assert "Failing batch 2" in page and "Skip these entries" in page
    assert "ValueError: cannot count /boom" in page

    client.post(f"/jobs/{job.name}/skip-entries", {"batch": "2"})
    action = Action.objects.get(job=job, kind=ActionKind.SKIP_ENTRIES)
    assert action_execute(action_id=action.id).status == "succeeded", action.outcome
    restart = job.runs.filter(status=RunStatus.PENDING).get()  # the action started the job; run it here
    restart.delete()
    second = start_driver(job)
    wait_for(lambda: total(job) == before + after + 1 - 100, 180, what="the job to resume after the skipped entries")
    second.stop()

    dead = redis.xrange(job.dead_letter_stream)
    assert len(dead) == 100 and {e[b"stage"] for _, e in dead} == {b"skipped"}
    assert any(b"/boom" in e[b"payload"] for _, e in dead), "the failing entry is among them, for a re-drive"
    assert f"skipped by operator action #{action.id}".encode() == dead[0][1][b"reason"]
