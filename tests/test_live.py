"""Live push and lag status: Burrow's rules, and a reconnecting browser that misses nothing."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.test import AsyncClient
from django.utils import timezone

from dashboard.models import Checkpoint
from dashboard.selectors.charts import MAX_POINTS, job_series
from dashboard.selectors.lag import lag_status

pytestmark = pytest.mark.django_db
NOW = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)


def points(lags, ends=None, rate=100.0, in_rate=50.0, last_age=1.0):
    ends = ends or [100 * (i + 1) for i in range(len(lags))]
    start = NOW - timedelta(seconds=last_age + len(lags) - 1)
    return [
        {
            "t": (start + timedelta(seconds=i)).isoformat(),
            "lag": lag,
            "end_n": end,
            "location": "checkpoint",
            "proc_rate": rate,
            "in_rate": in_rate,
        }
        for i, (lag, end) in enumerate(zip(lags, ends, strict=True))
    ]


@pytest.mark.parametrize(
    ("series", "status"),
    [
        (points([0, 0, 0]), "OK"),
        (points([500, 300, 100]), "OK"),
        (points([100, 200, 350, 600]), "WARN"),
        (points([100, 100, 100], ends=[400, 400, 400]), "STALL"),
        (points([0, 0, 0], ends=[400, 300, 500]), "REWIND"),
        (points([0, 0], last_age=600), "STOP"),
        ([], ""),
    ],
)
def test_lag_status_follows_burrows_rules(series, status):
    assert lag_status(series, trigger_seconds=2, now=NOW).status == status


def test_the_time_to_drain_uses_the_current_rates():
    assert lag_status(points([900, 600, 300]), 2, NOW).drain_seconds == 300 / 50
    assert lag_status(points([100, 200, 300], in_rate=200), 2, NOW).drain_seconds is None


def test_a_lag_that_fell_once_but_is_not_draining_is_not_called_catching_up():
    draining = lag_status(points([900, 600, 300]), 2, NOW)
    assert (draining.status, draining.reason) == ("OK", "catching up")
    # a job always behind: its lag dipped once in the window (Burrow's OK), but the input outruns the processing
    behind = lag_status(points([700, 800, 750, 900], in_rate=200), 2, NOW)
    assert (behind.status, behind.reason) == ("OK", "behind, not draining at the current rates")
    assert lag_status(points([0, 0, 0]), 2, NOW).reason == "keeping up"


def test_a_long_range_is_thinned_to_the_point_budget_keeping_the_newest(make_job):
    job = make_job()
    Checkpoint.objects.bulk_create(
        Checkpoint(job=job, batch_id=b, committed_at=NOW - timedelta(seconds=5000 - b), duration_ms=1)
        for b in range(5000)
    )
    series = job_series(job, NOW - timedelta(days=1))
    assert len(series) == MAX_POINTS and series[-1]["batch"] == 4999 and series[0]["batch"] == 0


def record(batch: int) -> dict:
    return {
        "batch_id": batch,
        "committed_at": NOW.isoformat(),
        "lag_records": 3,
        "processed_rate": 10.0,
        "end_offset": {"id": f"{batch}-0", "n": batch},
    }


def read_events(client, url: str, count: int, headers: dict | None = None) -> list[tuple[str, dict]]:
    async def go():
        response = await client.get(url, headers=headers)
        events, buffer = [], ""
        async for chunk in response.streaming_content:
            buffer += chunk.decode() if isinstance(chunk, bytes) else chunk
            while "\n\n" in buffer:
                block, buffer = buffer.split("\n\n", 1)
                fields = dict(
                    line.split(": ", 1) for line in block.splitlines() if ": " in line and not line.startswith(":")
                )
                if fields.get("event") in ("checkpoint", "incident"):
                    events.append((fields["id"], json.loads(fields["data"]) | {"event": fields["event"]}))
            if len(events) >= count:
                break
        return events

    return async_to_sync(go)()


def test_the_live_stream_resumes_from_the_last_event_id(make_job, redis, django_user_model):
    job, other = make_job(), make_job()
    for batch in range(5):
        for owner in (job, other):
            redis.xadd(settings.LIVE_STREAM, {"data": json.dumps({"job": owner.id, "record": record(batch)})})
    client = AsyncClient()
    client.force_login(django_user_model.objects.create_user("viewer", password="x"))
    url = f"/jobs/{job.name}/live?after=0-0"

    first = read_events(client, url, 3)
    assert [p["batch"] for _, p in first] == [0, 1, 2], "only this job's checkpoints"
    resumed = read_events(client, f"/jobs/{job.name}/live", 2, {"Last-Event-ID": first[-1][0]})
    assert [p["batch"] for _, p in resumed] == [3, 4], "the gap after a reconnect is filled, nothing repeated"


def test_each_pushed_point_carries_the_lag_status_judged_on_the_server(make_job, redis, django_user_model):
    job = make_job()
    now = timezone.now()
    for batch, lag in enumerate([100, 200, 300, 50]):
        point = record(batch) | {"lag_records": lag, "committed_at": (now - timedelta(seconds=4 - batch)).isoformat()}
        redis.xadd(settings.LIVE_STREAM, {"data": json.dumps({"job": job.id, "record": point})})
    client = AsyncClient()
    client.force_login(django_user_model.objects.create_user("viewer", password="x"))
    events = read_events(client, f"/jobs/{job.name}/live?after=0-0", 4)
    statuses = [p["status"]["status"] for _, p in events]
    assert statuses == ["OK", "OK", "WARN", "OK"], "lag grew three batches running, then fell"
    assert "lag never falls (100 → 300 records)" in events[2][1]["status"]["reason"]


def test_the_live_stream_needs_a_login(make_job):
    job = make_job()
    response = async_to_sync(AsyncClient().get)(f"/jobs/{job.name}/live")
    assert response.status_code == 302


def test_under_wsgi_the_live_stream_refuses_instead_of_holding_a_thread(client, make_job, django_user_model):
    client.force_login(django_user_model.objects.create_user("viewer", password="x"))
    response = client.get(f"/jobs/{make_job().name}/live")
    assert response.status_code == 503 and b"ASGI" in response.content


def test_a_partition_slower_than_max_p95_and_one_and_a_half_medians_is_a_straggler(make_job):
    from dashboard.selectors.partitions import partition_view

    job = make_job()
    for batch in range(5):
        parts = [{"op": 0, "part": n, "bytes": 1000, "added": 10, "commit_ms": 100 + batch} for n in range(7)]
        parts.append({"op": 0, "part": 7, "bytes": 4000, "added": 40, "commit_ms": 400 + batch})
        Checkpoint.objects.create(
            job=job, batch_id=batch, committed_at=NOW + timedelta(seconds=batch), duration_ms=500, partitions=parts
        )
    view = partition_view(job)
    assert view.batches == 5 and len(view.rows) == 8
    assert [r.part for r in view.rows if r.straggler] == [7]
    assert view.threshold_ms == pytest.approx(max(102 + 0.65 * 300, 1.5 * 102))
    assert view.bytes_skew == 4.0
    assert view.rows[0].commit_p50 == 102 and view.rows[7].commit_max == 404


def test_evenly_loaded_partitions_have_no_straggler(make_job):
    from dashboard.selectors.partitions import partition_view

    job = make_job()
    parts = [{"op": 0, "part": n, "bytes": 1000, "added": 10, "commit_ms": 100 + n} for n in range(8)]
    Checkpoint.objects.create(job=job, batch_id=0, committed_at=NOW, duration_ms=500, partitions=parts)
    assert partition_view(job).stragglers == 0


def test_the_job_list_stream_carries_every_jobs_checkpoints_and_incidents(make_job, redis, django_user_model):
    job, other = make_job(), make_job()
    redis.xadd(settings.LIVE_STREAM, {"data": json.dumps({"job": job.id, "record": record(0)})})
    redis.xadd(settings.LIVE_STREAM, {"data": "not json"})  # a malformed entry is skipped, not fatal
    redis.xadd(settings.LIVE_STREAM, {"data": json.dumps({"job": other.id, "record": record(7)})})
    incident = {"t": NOW.isoformat(), "kind": "savepoint", "text": "Savepoint #3 succeeded", "key": "action-3"}
    redis.xadd(settings.LIVE_STREAM, {"data": json.dumps({"job": job.id, "incident": incident})})
    client = AsyncClient()
    client.force_login(django_user_model.objects.create_user("viewer", password="x"))

    everything = read_events(client, "/live?after=0-0", 3)
    assert [(e["event"], e["job"]) for _, e in everything] == [
        ("checkpoint", job.id), ("checkpoint", other.id), ("incident", job.id),
    ]  # fmt: skip
    mine = read_events(client, f"/jobs/{job.name}/live?after=0-0", 2)
    assert [e["event"] for _, e in mine] == ["checkpoint", "incident"] and mine[1][1]["text"] == incident["text"]


def test_the_chart_data_carries_the_incidents_on_the_same_axis(client, make_job, django_user_model):
    from django.utils import timezone

    from dashboard.models import Action, Recovery, Run

    client.force_login(django_user_model.objects.create_user("viewer", password="x"))
    job = make_job(name="orders")
    now = timezone.now()
    failed = Run.objects.create(
        job=job, status="lost", started_at=now - timedelta(minutes=9), ended_at=now - timedelta(minutes=8)
    )
    Recovery.objects.create(job=job, failed_run=failed, cause="driver killed", failed_at=now - timedelta(minutes=8))
    Run.objects.create(job=job, status="running", started_at=now - timedelta(minutes=7))
    Action.objects.create(
        job=job, kind="rescale", status="succeeded", finished_at=now - timedelta(minutes=5), requested_at=now
    )
    Action.objects.create(job=job, kind="savepoint", status="running", requested_at=now)  # not finished: no marker
    Action.objects.create(  # a read of the state changes nothing: no marker
        job=job, kind="inspect-state", status="succeeded", finished_at=now - timedelta(minutes=4), requested_at=now
    )
    data = client.get("/jobs/orders/series.json?range=15m").json()
    assert [e["kind"] for e in data["incidents"]] == ["start", "failure", "restart", "start", "rescale"]
    assert data["resolution"] == "batch"
    assert client.get("/jobs/orders/series.json?range=4w").json()["resolution"] == "hour"


def test_a_bad_cursor_is_answered_once_and_open_streams_are_capped(make_job, django_user_model, settings, monkeypatch):
    import time as clock

    from dashboard import views

    job = make_job()
    user = django_user_model.objects.create_user("viewer", password="x")
    client = AsyncClient()
    client.force_login(user)
    bad = async_to_sync(client.get)(f"/jobs/{job.name}/live?after=not-an-id")
    assert bad.status_code == 400 and b"stream entry id" in bad.content
    settings.LIVE_STREAMS_PER_USER = 1
    monkeypatch.setattr(views, "_open_streams", {(user.pk, 1): clock.monotonic()})  # a tab already watching
    capped = async_to_sync(client.get)(f"/jobs/{job.name}/live")
    assert capped.status_code == 429 and b"1 live streams are open for you already" in capped.content
    stale = clock.monotonic() - views.LIVE_STREAM_SECONDS - 60  # a stream whose clean-up never ran
    monkeypatch.setattr(views, "_open_streams", {(user.pk, 1): stale})
    slot = views._stream_slot(user.pk)
    assert not isinstance(slot, str) and list(views._open_streams) == [slot], "the stale one no longer counts"
