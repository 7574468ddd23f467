"""The live console in Chromium against uvicorn: points arrive without a reload, the lag status follows the backlog,
and a reconnect fills the gap."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from django.conf import settings
from django.utils import timezone

from dashboard.models import Alert, AlertKind, Checkpoint, Job, Run, RunStatus
from dashboard.services.runs import job_request_start, job_request_stop
from dashboard.services.source_lag import committed
from tests.conftest import send_events, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def page(asgi_server: str, browser_login: Any) -> Any:
    return browser_login(asgi_server, "watcher")


def shown(tab: Any) -> int:
    return int(tab.locator("#charts").get_attribute("data-points") or 0)


def incident_kinds(tab: Any) -> list[str]:
    return tab.evaluate("window.statekeeperLive.incidents().map(e => e.kind)")


def status(tab: Any) -> str:
    return tab.locator("#lag-status").inner_text()


def run_shown(tab: Any) -> str:
    return tab.locator("#run-status").inner_text().lower()


def buttons(tab: Any) -> list[str]:
    return [b.strip() for b in tab.locator("#job-actions button").all_inner_texts()]


def fact(tab: Any, name: str) -> str:
    return tab.locator(f"#job-facts dt:text-is('{name}') + dd").inner_text()


def test_the_charts_follow_the_job_live(page, asgi_server, celery_worker, make_job, redis, stream_name, tmp_path):
    job = make_job(name="clicks", parallelism=1, trigger_interval_seconds=1, max_records_per_batch=40)
    send_events(redis, stream_name, "url-counts", 30)
    job_request_start(job=job)
    wait_for(lambda: job.checkpoints.exists(), 120, 0.5, "the first checkpoint")

    page.goto(f"{asgi_server}/jobs/clicks/")
    page.screenshot(path=str(tmp_path / "opened.png"))
    wait_for(lambda: page.locator("#live-state").inner_text(timeout=1000) == "live", 30, 0.5, "the live connection")
    before = shown(page)
    send_events(redis, stream_name, "url-counts", 10, seed=2)
    wait_for(lambda: shown(page) > before, 30, 0.5, "a new point without a reload")
    assert status(page) == "OK"
    # the overview's facts follow the batches too: its last checkpoint is the newest batch, not the one at the load
    newest = job.checkpoints.order_by("-batch_id").first().batch_id
    wait_for(lambda: fact(page, "Last checkpoint").startswith(f"#{newest},"), 30, 0.5, "the overview's last checkpoint")

    # the producer outruns the job (150 events/s against 40 per 1 s batch): lag grows batch after batch
    halt = threading.Event()

    def produce() -> None:
        seed = 10
        while not halt.wait(0.2):
            seed += 1
            send_events(redis, stream_name, "url-counts", 30, seed=seed)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    wait_for(lambda: status(page) == "WARN", 60, 0.5, "the lag status to turn WARN")
    page.screenshot(path=str(tmp_path / "warn.png"), full_page=True)
    # the alert evaluator (Celery beat, every 5 s) opens a lag alert, and its marker reaches the open page
    wait_for(lambda: job.alerts.filter(kind=AlertKind.LAG_WARN).exists(), 30, 0.5, "a lag alert")
    wait_for(lambda: "alert" in incident_kinds(page), 30, 0.5, "the alert's marker on the timeline")
    halt.set()
    producer.join()
    # takes effect at the next start: restart so the job can catch up (update(), not save(): the driver holds the
    # lease token in the row, and a stale copy written back fences it)
    Job.objects.filter(id=job.id).update(max_records_per_batch=5000)
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 60, 0.5, "the stop")
    # the header's run follows without a reload: its status and its message
    wait_for(lambda: run_shown(page) == "stopped", 30, 0.5, "the header to show the run stopped")
    assert "Stopped on request" in page.locator("#run-message").inner_text()
    # and so do the buttons and the overview: Start in place of Stop, no driver
    wait_for(lambda: buttons(page) == ["Savepoint", "Start"], 30, 0.5, "Start in place of Stop")
    assert "(not running)" in fact(page, "Runs on")
    # while it is down, the overview's lag follows the source's samples (every 5 s), as the header's does
    send_events(redis, stream_name, "url-counts", 25, seed=50)
    job.refresh_from_db()
    waiting = int(redis.xinfo_stream(stream_name)["entries-added"]) - int(committed(job)["n"])
    wait_for(lambda: fact(page, "Lag").startswith(f"{waiting} records"), 30, 0.5, f"the overview's lag at {waiting}")
    reason = page.locator("#lag-reason")
    wait_for(lambda: f"{waiting} records waiting" in reason.inner_text(), 30, 0.5, f"the header's lag at {waiting}")
    job_request_start(job=job)
    wait_for(lambda: run_shown(page) == "running", 120, 0.5, "the header to show the new run running")
    wait_for(lambda: "Stop" in buttons(page), 30, 0.5, "the Stop button back")
    wait_for(
        lambda: f"driver pid {job.runs.order_by('-id').first().pid} " in fact(page, "Runs on"),
        30,
        0.5,
        "the new run's driver in the overview",
    )
    wait_for(lambda: status(page) == "OK", 120, 0.5, "the lag status back to OK once the job catches up")
    assert job.runs.order_by("id").first().status == RunStatus.STOPPED, "a clean stop, not a fenced driver"
    wait_for(lambda: {"stop", "start"} <= set(incident_kinds(page)[-4:]), 30, 0.5, "the restart on the timeline")

    # a dropped connection: batches commit meanwhile, and the reconnect replays exactly those
    page.evaluate("window.statekeeperLive.disconnect()")
    away_from = Checkpoint.objects.filter(job=job).count()
    for round_ in (1, 2):  # a job commits a batch only when there is new data: two rounds, two batches
        send_events(redis, stream_name, "url-counts", 10, seed=100 + round_)
        wait_for(
            lambda n=round_: Checkpoint.objects.filter(job=job).count() >= away_from + n, 60, 0.5, "a batch while away"
        )
    assert shown(page) < Checkpoint.objects.filter(job=job).count(), "the page really missed them"
    page.evaluate("window.statekeeperLive.reconnect()")
    expected = wait_for(lambda: Checkpoint.objects.filter(job=job).count(), 5, 0.5, "the count")
    wait_for(lambda: shown(page) >= expected, 30, 0.5, "the gap to be filled")
    batches = page.evaluate("window.statekeeperLive.points().map(p => p.location + ':' + p.batch)")
    assert len(batches) == len(set(batches)), "no point twice"
    assert sorted(int(b.split(":")[1]) for b in batches) == list(range(len(batches))), "no point missing"

    # the job list's sparklines and cells follow the same commits
    jobs = page
    jobs.goto(f"{asgi_server}/")
    lag_line = jobs.locator('tr[data-job] [data-spark="lag"]').first
    wait_for(lambda: lag_line.get_attribute("data-points"), 10, 0.2, "the sparkline")
    drawn = int(lag_line.get_attribute("data-points") or 0)
    send_events(redis, stream_name, "url-counts", 10, seed=77)
    wait_for(lambda: int(lag_line.get_attribute("data-points") or 0) > drawn, 30, 0.5, "a sparkline point, no reload")
    jobs.screenshot(path=str(tmp_path / "job-list.png"), full_page=True)
    job_request_stop(job=job)


def test_a_range_without_batches_is_drawn_as_the_range_and_says_so(page, asgi_server, make_job, redis, stream_name):
    job = make_job(name="quiet")
    # an incident but no batch (a lag alert on a job never started): the timeline spans the range all the same
    Alert.objects.create(job=job, kind=AlertKind.LAG_STOP, message="not running")
    page.goto(f"{asgi_server}/jobs/quiet/")
    wait_for(lambda: page.locator("#live-state").inner_text(timeout=1000) == "live", 30, 0.5, "the live connection")

    def shown_span(chart: str) -> float:
        return page.evaluate(
            "(id) => { const r = document.getElementById(id).layout.xaxis.range;"
            " return (Date.parse(r[1]) - Date.parse(r[0])) / 60000; }",
            chart,
        )

    assert page.locator("#chart-incidents").get_attribute("data-incidents") == "1"
    for chart in ("chart-duration", "chart-incidents"):
        assert 14.9 < shown_span(chart) < 15.1, f"{chart} spans the 15 minutes, not an instant"
    assert "no batch committed in this range" in page.locator("#chart-duration").inner_text()
    page.get_by_role("button", name="1h", exact=True).click()
    wait_for(lambda: 59.9 < shown_span("chart-duration") < 60.1, 10, 0.2, "the hour's range")

    # the range's first batch, pushed live: drawn, and the note gone
    wait_for(lambda: page.locator("#live-state").inner_text(timeout=1000) == "live", 30, 0.5, "the live connection")
    point = {"batch_id": 0, "committed_at": timezone.now().isoformat(), "lag_records": 0, "processed_rate": 5.0,
             "end_offset": {"id": "1-0", "n": 10}}  # fmt: skip
    redis.xadd(settings.LIVE_STREAM, {"data": json.dumps({"job": job.id, "record": point})})
    wait_for(lambda: shown(page) == 1, 30, 0.5, "the first point")
    assert "no batch committed in this range" not in page.locator("#chart-duration").inner_text()


def test_a_run_that_ends_while_the_page_loads_leaves_no_stale_buttons(page, asgi_server, make_job):
    job = make_job(name="ending")
    now = timezone.now()
    run = Run.objects.create(job=job, status=RunStatus.STOPPING, started_at=now, stop_requested_at=now)

    def end_the_run_then_answer(route: Any) -> None:  # the run ends between the page's render and its series
        Run.objects.filter(id=run.id).update(status=RunStatus.STOPPED, ended_at=timezone.now())
        route.continue_()

    page.route("**/series.json*", end_the_run_then_answer)
    page.goto(f"{asgi_server}/jobs/ending/")
    # a quiet live stream re-judges the job after 15 s and would mend the buttons then: they must be right before it
    wait_for(lambda: "Start" in buttons(page), 10, 0.25, "the stopped run's Start button")
    assert "Stop" not in buttons(page) and run_shown(page) == "stopped"
