"""The weekly capacity review and autoscaling, on a week of checkpoint history written the way a job leaves it."""

from __future__ import annotations

import csv
import io
from datetime import timedelta

import pytest
from django.core import mail
from django.utils import timezone

from dashboard.models import (
    Action,
    ActionKind,
    AuditEntry,
    AutoscaleMode,
    Checkpoint,
    Recovery,
    Run,
    RunStatus,
)
from dashboard.selectors.capacity import fit_line, forecast, week_review
from dashboard.selectors.database import ConsoleDatabase
from dashboard.services.autoscale import autoscale_run
from dashboard.services.rollups import job_rollup

pytestmark = pytest.mark.django_db


def week_of_history(job, *, duration_ms: int, rows_per_hour: int, bytes_per_hour: int, removed: int = 0, every_min=30):
    """A checkpoint every `every_min` minutes over the last 7 days, state growing linearly."""
    now = timezone.now()
    start = now - timedelta(days=7)
    count = 7 * 24 * 60 // every_min
    Checkpoint.objects.bulk_create(
        Checkpoint(
            job=job, batch_id=i, committed_at=start + timedelta(minutes=every_min * i), duration_ms=duration_ms,
            input_rows=600, input_rate=10.0, processed_rate=20.0, lag_records=i % 7,
            state_rows_total=1000 + rows_per_hour * i * every_min // 60, state_rows_removed=removed,
            state_memory_bytes=50_000_000 + bytes_per_hour * i * every_min // 60,
            full_size_bytes=80_000_000 + bytes_per_hour * i * every_min // 60, checkpointed_bytes=4000,
            state_operators=[{"numRowsDroppedByWatermark": 0}],
        )
        for i in range(count)
    )  # fmt: skip
    job_rollup(job, timezone.now() + timedelta(seconds=10))


def test_a_straight_line_is_fitted_and_forecast_with_its_uncertainty():
    fit = fit_line([0, 1, 2, 3, 4], [100, 150, 200, 250, 300])
    assert (fit.slope, fit.intercept, fit.r2, fit.stderr) == pytest.approx((50, 100, 1, 0))
    assert forecast(fit, 300, 1300, "memory").days == pytest.approx(20)
    noisy = fit_line([0, 1, 2, 3, 4, 5], [100, 180, 190, 260, 330, 340])
    ahead = forecast(noisy, 340, 1340, "disk")
    assert ahead.earliest < ahead.days < ahead.latest, "the range around the fitted growth"
    assert forecast(fit_line([0, 1, 2], [5, 5, 5]), 5, 10, "disk").days is None, "not growing: never"


def test_the_review_finds_growth_a_leak_a_memory_budget_and_too_little_parallelism(make_job):
    job = make_job(name="orders", parallelism=2, trigger_interval_seconds=2, memory_budget_mb=128)
    week_of_history(job, duration_ms=1800, rows_per_hour=100, bytes_per_hour=200_000)
    run = Run.objects.create(job=job, status=RunStatus.FAILED)
    Recovery.objects.create(job=job, failed_run=run, cause="boom", failed_at=timezone.now() - timedelta(days=1))

    review = week_review().jobs[0]
    assert review.rows_fit.slope == pytest.approx(2400, rel=0.01), "100 rows an hour"
    assert review.rows_fit.r2 > 0.99 and review.restarts == 1
    assert review.utilisation == pytest.approx(0.9)
    assert review.headroom == pytest.approx((600 / 1.8) / 10, rel=0.01), "capacity 333 rows/s against a 10/s peak"
    kinds = {r.kind: r for r in review.recommendations}
    assert kinds["parallelism"].text == "Raise parallelism 2 → 3"
    assert kinds["parallelism"].params == {"parallelism": 3}
    assert kinds["backend"].text == "Move to the RocksDB backend"
    assert kinds["leak"].text == "Likely state leak"
    budget = review.budget
    assert budget.unit == "memory" and budget.days == pytest.approx(
        (128 * 2**20 - review.state_bytes[1]) / (4_800_000), rel=0.02
    )


def test_no_parallelism_advice_inside_the_band_or_right_after_a_rescale(make_job):
    calm = make_job(name="calm", parallelism=2, trigger_interval_seconds=2)
    week_of_history(calm, duration_ms=1200, rows_per_hour=0, bytes_per_hour=0, removed=5)
    hot = make_job(name="hot", parallelism=2, trigger_interval_seconds=2)
    week_of_history(hot, duration_ms=1900, rows_per_hour=0, bytes_per_hour=0, removed=5)
    Action.objects.create(job=hot, kind=ActionKind.RESCALE, status="succeeded", finished_at=timezone.now())
    reviews = {r.job.name: r for r in week_review().jobs}
    assert reviews["calm"].recommendations == [], "60% is inside the band; state steady: nothing to do"
    assert [r.kind for r in reviews["hot"].recommendations] == [], "rescaled an hour ago: no flapping"


def test_the_review_page_csv_and_printable_view(client, django_user_model, make_job, settings):
    client.force_login(django_user_model.objects.create_user("planner", password="x"))
    job = make_job(name="orders", parallelism=2, trigger_interval_seconds=2)
    week_of_history(job, duration_ms=1800, rows_per_hour=100, bytes_per_hour=1000)
    response = client.get("/capacity/")
    page = response.content.decode()
    assert "Raise parallelism 2 → 3" in page and 'data-chart="state"' in page
    review = response.context["review"]
    assert response.context["charts"]["orders"]["range"] == [review.start.isoformat(), review.end.isoformat()], (
        "every chart spans the week, however few hourly buckets it has"
    )
    rows = list(csv.DictReader(io.StringIO(client.get("/capacity/?format=csv").content.decode())))
    assert rows[0]["job"] == "orders" and float(rows[0]["utilisation"]) == pytest.approx(0.9)
    assert 'class="printable"' in client.get("/capacity/?print=1").content.decode()
    assert "Not a date" in client.get("/capacity/?end=last-week", follow=True).content.decode()
    old = client.get("/capacity/?end=2020-01-01").content.decode()
    assert "No checkpoints in this week" in old
    leftover = settings.CHECKPOINT_ROOT / "deleted-job"
    leftover.mkdir(parents=True)
    (leftover / "f").write_bytes(b"z" * 2048)
    assert "<code>deleted-job</code> (2.0 KB)" in client.get("/capacity/").content.decode()


def test_the_weekly_summary_is_emailed(make_job, settings):
    from workers.tasks import capacity_report

    settings.CAPACITY_EMAILS = ["capacity@example.com"]
    job = make_job(name="orders", parallelism=2, trigger_interval_seconds=2)
    week_of_history(job, duration_ms=1800, rows_per_hour=100, bytes_per_hour=1000)
    assert capacity_report() == "sent to capacity@example.com"
    message = mail.outbox[-1]
    assert "Capacity review" in message.subject and "Raise parallelism 2 → 3" in message.body
    assert "/capacity/?end=" in message.body


def test_apply_mode_rescales_once_the_advice_holds_and_within_its_daily_cap(make_job):
    job = make_job(
        name="orders", parallelism=1, trigger_interval_seconds=1, autoscale_mode=AutoscaleMode.APPLY,
        autoscale_window_minutes=10, autoscale_max_per_day=1,
    )  # fmt: skip
    Run.objects.create(job=job, status=RunStatus.RUNNING, started_at=timezone.now() - timedelta(hours=1))
    now = timezone.now()
    for i in range(40):  # the last 20 minutes, every 30 s, batch time 950 ms against a 1 s trigger
        Checkpoint.objects.create(
            job=job, batch_id=i, committed_at=now - timedelta(seconds=30 * (40 - i)), duration_ms=950
        )
    notes = autoscale_run(now)
    action = Action.objects.get(job=job, kind=ActionKind.RESCALE)
    assert action.origin == "autoscaler" and action.params["parallelism"] == 2, notes
    assert AuditEntry.objects.filter(verb="rescale", origin="autoscaler", outcome="requested").exists()

    Action.objects.filter(id=action.id).update(status="succeeded", finished_at=now)
    later = now + timedelta(minutes=11)
    for i in range(40, 62):
        Checkpoint.objects.create(
            job=job, batch_id=i, committed_at=later - timedelta(seconds=30 * (62 - i)), duration_ms=950
        )
    Action.objects.filter(id=action.id).update(finished_at=later - timedelta(days=2))  # not a quiet-period block
    notes = autoscale_run(later)
    assert Action.objects.filter(job=job, kind=ActionKind.RESCALE).count() == 1
    assert "cap" in " ".join(notes), "the daily cap holds the second one back"


def test_recommend_mode_only_shows(client, django_user_model, make_job):
    client.force_login(django_user_model.objects.create_user("viewer", password="x"))
    job = make_job(name="orders", parallelism=1, trigger_interval_seconds=1)
    Run.objects.create(job=job, status=RunStatus.RUNNING)
    now = timezone.now()
    for i in range(40):
        Checkpoint.objects.create(
            job=job, batch_id=i, committed_at=now - timedelta(seconds=20 * (40 - i)), duration_ms=950
        )
    assert autoscale_run() == [] and not Action.objects.exists()
    assert "Raise parallelism 1 → 2" in client.get("/jobs/orders/").content.decode()
    # stopped, its last run's batches are no advice for a run it does not have
    Run.objects.filter(job=job).update(status=RunStatus.STOPPED, ended_at=timezone.now())
    page = client.get("/jobs/orders/").content.decode()
    assert "Raise parallelism" not in page and "no change (the job is not running)" in page


def test_the_review_shows_the_consoles_database_and_warns_when_autovacuum_is_off(client, django_user_model, make_job):
    """Found by the soak: a server with autovacuum off kept every dead row of the results and undo tables."""
    client.force_login(django_user_model.objects.create_user("planner", password="x"))
    make_job(name="orders")
    database = client.get("/capacity/").context["database"]
    sizes = [size for _, size, _ in database.tables]
    assert database.size_bytes >= sum(sizes) > 0 and sizes == sorted(sizes, reverse=True), "the largest tables first"
    assert all(name.startswith(("dashboard_", "auth_", "django_")) for name, _, _ in database.tables)
    assert database.autovacuum is (database.warning == "")
    off = ConsoleDatabase("postgresql", 1, [], autovacuum=False)
    assert "autovacuum is off" in off.warning and "ALTER SYSTEM SET autovacuum = on" in off.warning
