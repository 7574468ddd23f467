"""The job list and job page, as an operator reads them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from dashboard.models import Checkpoint, DriverHost, HostStatus, Run, RunStatus
from dashboard.selectors.jobs import job_lag_status
from tests.conftest import grant

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 21, 10, 0, tzinfo=UTC)


@pytest.fixture
def viewer(client, django_user_model):
    client.force_login(django_user_model.objects.create_user("viewer", password="x"))
    return client


def with_history(job, batches: int) -> None:
    Checkpoint.objects.bulk_create(
        Checkpoint(
            job=job,
            batch_id=b,
            committed_at=T0 + timedelta(seconds=b),
            duration_ms=100 + b,
            input_rows=10,
            checkpointed_bytes=1000 + b,
            full_size_bytes=5000 + 10 * b,
            lag_records=50 - b,
            state_rows_total=b,
            end_offset={"id": f"{b}-0", "n": 10 * b},
        )
        for b in range(batches)
    )
    job.latest_checkpoint = job.checkpoints.order_by("-batch_id").first()
    job.save()


def queries_for(client, url: str) -> int:
    with CaptureQueriesContext(connection) as captured:
        assert client.get(url).status_code == 200
    return len(captured)


def test_the_job_list_costs_the_same_queries_for_one_job_or_many(viewer, make_job):
    first = make_job()
    with_history(first, 3)
    Run.objects.create(job=first, status=RunStatus.RUNNING)
    one = queries_for(viewer, "/")
    for _ in range(6):
        job = make_job()
        with_history(job, 2)
        Run.objects.create(job=job, status=RunStatus.STOPPED)
    assert queries_for(viewer, "/") == one


def test_the_job_list_shows_status_lag_and_state(viewer, make_job):
    job = make_job(name="clicks")
    with_history(job, 4)
    Run.objects.create(job=job, status=RunStatus.RUNNING)
    page = viewer.get("/").content.decode()
    assert "clicks" in page and "running" in page
    assert "#3" in page, "the last checkpoint's batch id"
    assert ">47<" in page, "lag in records of the last checkpoint"
    assert "<title>Jobs · Statekeeper</title>" in page, "the title is the title: no data or scripts in it"


def test_the_checkpoints_tab_pages_through_history_newest_first(viewer, make_job):
    job = make_job(name="clicks")
    with_history(job, 60)
    first = viewer.get("/jobs/clicks/checkpoints")
    history = first.context["history"]
    assert [c.batch_id for c in history.rows][:3] == [59, 58, 57] and len(history.rows) == 25
    assert f'href="?before={history.older}"' in first.content.decode(), "the page links to the next one"
    seen = [c.batch_id for c in history.rows]
    while history.older:
        history = viewer.get(f"/jobs/clicks/checkpoints?before={history.older}").context["history"]
        seen += [c.batch_id for c in history.rows]
    assert seen == list(range(59, -1, -1)), "every checkpoint once, newest first, across the pages"
    assert (
        "oldest raw checkpoint kept"
        in viewer.get(f"/jobs/clicks/checkpoints?before={history.rows[0].id}").content.decode()
    )
    bad = viewer.get("/jobs/clicks/checkpoints?before=zzz")
    assert bad.status_code == 200 and bad.context["history"].rows[0].batch_id == 59, "a bad cursor shows the newest"


def test_the_summary_has_min_avg_and_percentiles_like_flinks(viewer, make_job):
    job = make_job(name="clicks")
    with_history(job, 101)
    context = viewer.get("/jobs/clicks/checkpoints").context
    assert context["summary_count"] == 101
    duration = next(row for row in context["summary"] if row.label == "End to end duration")
    assert duration.values["min"] == 100 and duration.values["max"] == 200
    assert duration.values["avg"] == pytest.approx(150)
    assert duration.values["p50"] == pytest.approx(150)
    assert duration.values["p90"] == pytest.approx(190)
    assert duration.values["p99"] == pytest.approx(199)


def test_the_results_tab_shows_results_and_every_tab_the_start_button(viewer, make_job):
    job = make_job(name="clicks")
    job.results.create(kind="url", key="/api/a", value={"requests": 42}, batch_id=0)
    page = viewer.get("/jobs/clicks/results").content.decode()
    assert "Top URLs" in page and "/api/a" in page and ">42<" in page
    assert 'action="/jobs/clicks/start"' not in page, "a viewer is not offered actions"
    grant(viewer.get("/").wsgi_request.user, "operator")
    for tab in ("", "checkpoints", "state", "savepoints", "runs", "alerts", "results"):
        page = viewer.get(f"/jobs/clicks/{tab}").content.decode()
        assert 'action="/jobs/clicks/start"' in page, f"the header's actions are on the {tab or 'overview'} tab"


def test_each_tab_has_its_own_address_and_says_which_it_is(viewer, make_job):
    job = make_job(name="clicks")
    with_history(job, 3)
    Run.objects.create(job=job, status=RunStatus.FAILED, message="The query failed: boom", error="Traceback: boom")
    tabs = {
        "": "Live",
        "checkpoints": "Checkpoint summary",
        "state": "State partitions",
        "savepoints": "No savepoints yet",
        "runs": "Traceback: boom",
        "alerts": "Operational alerts",
        "results": "Top URLs",
    }
    for tab, content in tabs.items():
        page = viewer.get(f"/jobs/clicks/{tab}").content.decode()
        assert content in page, f"{tab or 'overview'} shows {content!r}"
        assert page.count('aria-current="page"') == 1, "one tab is marked as the current one"
    config = viewer.get("/jobs/clicks/checkpoints").content.decode()
    assert "Trigger interval" in config and "Batches retained" in config and "Spark settings" in config
    assert "Checkpoint summary" not in viewer.get("/jobs/clicks/").content.decode(), "the overview stays short"


def test_a_job_whose_pipeline_is_gone_is_shown_not_crashed_on(viewer, make_job):
    make_job(name="clicks", pipeline="uninstalled-pipeline")
    for tab in ("", "results", "checkpoints"):
        response = viewer.get(f"/jobs/clicks/{tab}")
        assert response.status_code == 200
    assert "not registered" in viewer.get("/jobs/clicks/").content.decode()


def test_a_stopped_job_in_the_shared_driver_is_not_shown_running_there(viewer, make_job, settings):
    """The overview's "Runs on" is the job's active run: once its last run stopped, it runs nowhere, though the
    header still shows that run's status and message."""
    host = DriverHost.objects.create(host=settings.HOST_ID, status=HostStatus.SERVING, pid=4321)
    job = make_job(name="clicks", driver="shared")
    run = Run.objects.create(job=job, status=RunStatus.RUNNING, driver_host=host, pid=4321, host="vm")
    assert "the shared driver #" in viewer.get("/jobs/clicks/").content.decode()
    Run.objects.filter(id=run.id).update(status=RunStatus.STOPPED, message="Stopped on request.")
    page = viewer.get("/jobs/clicks/").content.decode()
    assert "(not running)" in page and "the shared driver #" not in page
    assert "Stopped on request." in page


def test_the_run_message_pushed_live_is_the_one_the_header_shows(viewer, make_job):
    """The live status carries the run's message cut as the header's template cuts it: a push does not change it."""
    job = make_job(name="clicks")
    long = "Not started: the checkpoint directory is missing or empty " + "x" * 300
    Run.objects.create(job=job, status=RunStatus.FAILED, message=long)
    pushed = job_lag_status(job)["run"]
    assert pushed["status"] == RunStatus.FAILED and len(pushed["message"]) == 140
    page = viewer.get("/jobs/clicks/").content.decode()
    assert f'<span class="muted" id="run-message">· {pushed["message"]}</span>' in page


def test_an_unknown_job_is_a_404(viewer):
    assert viewer.get("/jobs/nope/").status_code == 404


def test_start_and_stop_need_a_post(viewer, make_job):
    job = make_job()
    assert viewer.get(f"/jobs/{job.name}/start").status_code == 405
    assert viewer.get(f"/jobs/{job.name}/stop").status_code == 405
