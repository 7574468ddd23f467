"""Figures stay true while a job is down: lag is read from the source itself, so a stopped job's lag grows on the
page, the job list and /metrics, and the lag alert fires, with events flowing and no progress event at all."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from dashboard.metrics import render_metrics
from dashboard.models import AlertKind, Checkpoint, Job, Run, RunStatus
from dashboard.services.alerts import alerts_evaluate
from dashboard.services.source_lag import source_lag_sample
from tests.conftest import send_events

pytestmark = pytest.mark.django_db(transaction=True)


def stopped_after(job, redis, stream, consumed: int) -> None:
    """The job read ``consumed`` entries, committed, and stopped."""
    send_events(redis, stream, "url-counts", consumed)
    last_id = redis.xrevrange(stream, count=1)[0][0].decode()
    checkpoint = Checkpoint.objects.create(
        job=job, batch_id=4, committed_at=timezone.now() - timedelta(minutes=5), duration_ms=100,
        lag_records=0, end_offset={"id": last_id, "n": consumed},
    )  # fmt: skip
    Job.objects.filter(id=job.id).update(latest_checkpoint=checkpoint)


def test_a_stopped_jobs_lag_grows_from_the_source_and_its_alert_fires(make_job, redis, stream_name, client, admin_user):
    job = make_job(name="orders")
    stopped_after(job, redis, stream_name, 100)
    Run.objects.create(job=job, status=RunStatus.STOPPED, ended_at=timezone.now() - timedelta(minutes=5))
    now = timezone.now()
    for i, more in enumerate((10, 20, 30)):  # the producer goes on while the job is down
        send_events(redis, stream_name, "url-counts", more, seed=i)
        source_lag_sample(now + timedelta(seconds=5 * i))
    samples = list(job.source_lag.order_by("sampled_at").values_list("lag_records", flat=True))
    assert samples == [10, 30, 60], "the backlog the job will have to read, sample after sample"
    newest = job.source_lag.order_by("-sampled_at").first()
    # the oldest waiting entry was sent just after ``now``; the third sample is taken at now + 10 s
    assert 8 <= newest.lag_seconds <= 10.5, f"the oldest waiting entry's age: {newest.lag_seconds}"

    changes = alerts_evaluate(now + timedelta(seconds=11), deliver=lambda *_: None)
    assert [(a.kind, event) for a, event in changes] == [(AlertKind.LAG_STOP, "firing")]
    assert "orders is not running and its source moves on: 60 records waiting" in changes[0][0].message

    assert 'statekeeper_job_lag_records{job="orders"} 60' in render_metrics()
    client.force_login(admin_user)
    assert ">60<br>" in client.get("/").content.decode(), "the job list shows the source's count"
    overview = client.get("/jobs/orders/").content.decode()
    assert "60 records" in overview and "not running: 60 records waiting" in overview, "the header says STOP"
    series = client.get("/jobs/orders/series.json").json()
    assert [p["lag"] for p in series["source"]] == [10, 30, 60]
    assert series["status"]["status"] == "STOP"


def test_a_job_never_started_is_not_paged_for_its_sources_backlog(make_job, redis, stream_name, client, admin_user):
    job = make_job(name="fresh")  # created, not started yet (as the demo's sessions job waits for its user)
    now = timezone.now()
    for i, more in enumerate((10, 20, 30)):
        send_events(redis, stream_name, "url-counts", more, seed=i)
        source_lag_sample(now + timedelta(seconds=5 * i))
    assert alerts_evaluate(now + timedelta(seconds=11), deliver=lambda *_: None) == []
    client.force_login(admin_user)
    assert "60 records" in client.get("/jobs/fresh/").content.decode(), "its page still shows what it would read"
    Run.objects.create(job=job, status=RunStatus.FAILED, ended_at=now)  # it ran and died: now the backlog pages
    send_events(redis, stream_name, "url-counts", 10, seed=9)
    source_lag_sample(now + timedelta(seconds=15))
    changes = alerts_evaluate(now + timedelta(seconds=16), deliver=lambda *_: None)
    assert [(a.kind, event) for a, event in changes] == [(AlertKind.LAG_STOP, "firing")]


def test_a_stopped_job_whose_source_is_quiet_raises_nothing(make_job, redis, stream_name):
    job = make_job(name="quiet")
    stopped_after(job, redis, stream_name, 100)
    now = timezone.now()
    for i in range(3):
        source_lag_sample(now + timedelta(seconds=5 * i))
    assert set(job.source_lag.values_list("lag_records", flat=True)) == {0}
    assert alerts_evaluate(now + timedelta(seconds=11), deliver=lambda *_: None) == []


def test_a_job_on_its_way_up_is_not_alerted_for_the_lag_it_has_yet_to_read(make_job, redis, stream_name):
    job = make_job(name="starting")
    stopped_after(job, redis, stream_name, 100)
    Run.objects.create(job=job, status=RunStatus.STARTING)
    now = timezone.now()
    for i, more in enumerate((10, 20, 30)):
        send_events(redis, stream_name, "url-counts", more, seed=i)
        source_lag_sample(now + timedelta(seconds=5 * i))
    assert alerts_evaluate(now + timedelta(seconds=11), deliver=lambda *_: None) == []


def test_a_job_switched_to_a_fork_shows_the_lag_from_the_forks_offsets_before_its_first_batch_there(
    make_job, redis, stream_name
):
    """A rescale or an upgrade switches the job to a fork of its checkpoint and clears its latest record until the new
    run's first batch there. The lag then is still what the job has to read from the fork's committed offset, not the
    whole stream (81,111 records and 405 s on the demo stack during a rescale)."""
    import json

    job = make_job(name="rescaled")
    send_events(redis, stream_name, "url-counts", 100)
    read_to = redis.xrevrange(stream_name, count=1)[0][0].decode()
    send_events(redis, stream_name, "url-counts", 30, seed=3)  # sent while the job is switched over
    fork = job.checkpoint_location
    (fork / "offsets").mkdir(parents=True)
    (fork / "commits").mkdir()
    (fork / "offsets" / "7").write_text(
        "v1\n" + json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": 0}) + "\n"
        + json.dumps({"id": read_to, "n": 100}) + "\n"
    )  # fmt: skip
    (fork / "commits" / "7").write_text('v1\n{"nextBatchWatermarkMs":0}\n')
    assert job.latest_checkpoint is None
    source_lag_sample()
    sample = job.source_lag.get()
    assert (sample.committed_n, sample.lag_records) == (100, 30), "from the fork's offset, not the stream's start"
    assert sample.lag_seconds < 60

    (fork / "offsets" / "7").write_text("v1\n{not json")  # a damaged fork: the start of the stream, as before
    source_lag_sample()
    assert job.source_lag.order_by("-sampled_at").first().lag_records == 130
