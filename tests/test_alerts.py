"""Alerts as the on-call engineer receives them: opened once when a condition starts, delivered to a real webhook
and as an e-mail, an all-clear when it has been gone for a while, and shown in the console as open and past."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from django.conf import settings as django_settings
from django.core import mail
from django.utils import timezone

from dashboard.models import (
    Alert,
    AlertKind,
    Checkpoint,
    Recovery,
    Run,
    RunStatus,
    Savepoint,
    SavepointStatus,
    SourceLag,
)
from dashboard.services.alerts import DeliveryFailed, alert_deliver, alerts_evaluate, job_conditions
from dashboard.services.runs import run_finish, run_started

pytestmark = pytest.mark.django_db(transaction=True)


class Webhook:
    """A real HTTP endpoint on 127.0.0.1 that records what it is sent; `fail` makes it answer 500."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.fail = False
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if owner.fail:
                    self.send_response(500)
                else:
                    owner.received.append(json.loads(body))
                    self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def webhook(settings) -> Iterator[Webhook]:
    hook = Webhook()
    settings.ALERT_WEBHOOK_URL = hook.url
    settings.ALERT_EMAILS = ["oncall@example.com"]
    settings.ALERT_RESOLVE_AFTER_SECONDS = 20
    yield hook
    hook.server.shutdown()


def mails() -> list[str]:
    """E-mail leaves the machine: in tests Django keeps what it would hand to the SMTP server in mail.outbox."""
    return [f"{m.subject}\n{m.body}" for m in mail.outbox]


def running(job, started_seconds_ago: float = 600) -> Run:
    started = timezone.now() - timedelta(seconds=started_seconds_ago)
    return Run.objects.create(job=job, status=RunStatus.RUNNING, started_at=started, requested_at=started)


def commits(job, lags: list[int], ends: list[int] | None = None, age: float = 1.0, first: int = 0) -> None:
    now = timezone.now()
    ends = ends or [100 * (i + 1 + first) for i in range(len(lags))]
    run = Run.objects.filter(job=job).order_by("-id").first()  # the run that committed them
    for i, (lag, end) in enumerate(zip(lags, ends, strict=True)):
        Checkpoint.objects.create(
            job=job, run=run, batch_id=first + i, committed_at=now - timedelta(seconds=age + len(lags) - i),
            duration_ms=100, lag_records=lag, input_rate=50, processed_rate=40, end_offset={"id": "x", "n": end},
        )  # fmt: skip


def evaluate(at=None):
    sent = []
    changes = alerts_evaluate(at, deliver=lambda alert_id, event: sent.append(alert_deliver(alert_id, event)))
    return [(a.kind, e) for a, e in changes], sent


def test_a_growing_lag_fires_once_and_sends_an_all_clear_when_it_has_drained(make_job, webhook):
    job = make_job(name="orders", trigger_interval_seconds=1)
    running(job)
    commits(job, [100, 200, 350, 600])

    assert evaluate()[0] == [(AlertKind.LAG_WARN, "firing")]
    assert evaluate()[0] == [], "the same condition does not fire twice"
    alert = Alert.objects.get(job=job)
    assert alert.is_open and "lag never falls" in alert.message
    assert [(h["status"], h["job"], h["alert"]) for h in webhook.received] == [("firing", "orders", "lag-warn")]
    assert webhook.received[0]["url"].endswith("/jobs/orders/")
    assert len(mails()) == 1 and "FIRING: Lag growing (WARN) on orders" in mails()[0]

    commits(job, [300, 100, 0], first=10)  # the job catches up
    assert evaluate()[0] == [], "not resolved on the first clear evaluation: a flapping lag would page twice"
    later = timezone.now() + timedelta(seconds=25)
    assert evaluate(later)[0] == [(AlertKind.LAG_WARN, "resolved")]
    alert.refresh_from_db()
    assert alert.resolved_at == later
    assert [h["status"] for h in webhook.received] == ["firing", "resolved"]
    assert "RESOLVED" in mails()[-1]
    assert {(n["channel"], n["event"]) for n in alert.notifications if n["ok"]} == {
        ("webhook", "firing"), ("email", "firing"), ("webhook", "resolved"), ("email", "resolved"),
    }  # fmt: skip


def test_a_condition_back_before_the_all_clear_keeps_the_alert_open(make_job, webhook):
    job = make_job(trigger_interval_seconds=1)
    running(job)
    commits(job, [100, 200, 350, 600])
    evaluate()
    commits(job, [300, 100, 0], first=10)
    evaluate()
    # growing again over a whole window of batches committed after the drain
    commits(job, [100 * k for k in range(1, 11)], first=20, age=-12)
    evaluate(timezone.now() + timedelta(seconds=12))
    assert evaluate(timezone.now() + timedelta(seconds=25))[0] == []
    assert Alert.objects.get(job=job).is_open and Alert.objects.get(job=job).clear_since is None


def test_a_job_that_stays_behind_keeps_its_lag_warning_when_the_lag_dips_once(make_job, webhook):
    job = make_job(trigger_interval_seconds=1)
    running(job)
    commits(job, [100, 200, 350, 600])
    assert evaluate()[0] == [(AlertKind.LAG_WARN, "firing")]
    # one dip in the window makes it Burrow's OK, but the input (50/s) still outruns the processing (40/s)
    start = timezone.now()
    commits(job, [700, 650, 800, 900], first=10, age=-10)  # committed 6-9 s from now
    at = start + timedelta(seconds=10)
    assert job_conditions(job, at)[AlertKind.LAG_WARN][0].startswith("lag still behind: behind, not draining")
    assert evaluate(at)[0] == [] and evaluate(at + timedelta(seconds=25))[0] == [], "no all-clear while behind"
    assert [h["status"] for h in webhook.received] == ["firing"]
    # the job drains at last: the all-clear once that has held for a while
    commits(job, [500, 200, 0], first=20, age=-50)  # committed 47-49 s from now
    assert evaluate(start + timedelta(seconds=50))[0] == []
    assert evaluate(start + timedelta(seconds=75))[0] == [(AlertKind.LAG_WARN, "resolved")]
    # a job that was never warned is not warned for the same dip: the warning opens on Burrow's WARN only
    quiet = make_job(name="quiet", trigger_interval_seconds=1)
    running(quiet)
    commits(quiet, [700, 650, 800, 900])
    assert job_conditions(quiet, timezone.now())[AlertKind.LAG_WARN] == (None, None)


def test_a_driver_heap_nearly_full_after_a_collection_is_an_alert_that_names_the_shared_driver(make_job, webhook):
    from dashboard.models import DriverHost

    own, shared = make_job(name="own"), make_job(name="shared")
    host = DriverHost.objects.create(host="here", pid=1)
    gib = 2**30
    for job, after_gc in ((own, 0.5 * gib), (shared, 1.8 * gib)):
        run = running(job, started_seconds_ago=5)  # too young for a checkpoint stall
        Run.objects.filter(id=run.id).update(
            heap_after_gc_bytes=int(after_gc), heap_max_bytes=2 * gib, last_heartbeat_at=timezone.now(),
            driver_host=host if job is shared else None,
        )  # fmt: skip
    assert evaluate()[0] == [(AlertKind.DRIVER_HEAP, "firing")]
    alert = Alert.objects.get(kind=AlertKind.DRIVER_HEAP)
    assert alert.job == shared
    assert (  # its sizes written as the overview writes them
        f"the shared driver #{host.id}'s heap, which all its jobs share, held 1.8 GB of 2.0 GB (90%)" in alert.message
    )
    assert "STATEKEEPER_SHARED_DRIVER_MEMORY" in alert.message
    # its own driver's heap fills too: the remedy is that driver's memory
    Run.objects.filter(job=own).update(heap_after_gc_bytes=int(1.9 * gib))
    assert "a larger STATEKEEPER_DRIVER_MEMORY" in job_conditions(own, timezone.now())[AlertKind.DRIVER_HEAP][0]
    # figures from a heartbeat long gone say nothing about now (the driver is gone or paused: other alerts say so)
    Run.objects.filter(job=own).update(last_heartbeat_at=timezone.now() - timedelta(minutes=5))
    assert job_conditions(own, timezone.now())[AlertKind.DRIVER_HEAP] == (None, None)
    # the shared driver's heap drains (a job moved away): the all-clear
    Run.objects.filter(job=shared).update(heap_after_gc_bytes=int(0.6 * gib))
    evaluate()
    later = evaluate(timezone.now() + timedelta(seconds=25))[0]  # (a checkpoint stall by then: no batch in 30 s)
    assert (AlertKind.DRIVER_HEAP, "resolved") in later


def test_stalled_offsets_and_a_checkpoint_stall(make_job, webhook, settings):
    settings.ALERT_CHECKPOINT_STALL_TRIGGERS = 10
    stalled = make_job(name="stalled", trigger_interval_seconds=1)
    running(stalled)
    commits(stalled, [40, 40, 40], ends=[500, 500, 500])
    silent = make_job(name="silent", trigger_interval_seconds=2)
    running(silent, started_seconds_ago=45)  # no batch in 45 s, the limit is max(30, 10 x 2 s)
    SourceLag.objects.create(job=silent, source_n=90, committed_n=70, lag_records=20)
    stopped = make_job(name="stopped", trigger_interval_seconds=1)
    Run.objects.create(job=stopped, status=RunStatus.STOPPED)  # a stopped job is not stuck
    idle = make_job(name="idle", trigger_interval_seconds=2)
    running(idle, started_seconds_ago=45)  # no batch either, but its source has nothing waiting: Spark is idle
    SourceLag.objects.create(job=idle, source_n=70, committed_n=70, lag_records=0)

    fired = sorted(evaluate()[0])
    assert fired == [(AlertKind.CHECKPOINT_STALL, "firing"), (AlertKind.LAG_STALL, "firing")]
    assert Alert.objects.get(kind=AlertKind.CHECKPOINT_STALL).job == silent
    message = Alert.objects.get(job=silent).message
    assert "no checkpoint for 45 s since the run started, with 20 records waiting" in message


def test_a_restart_loop_and_a_failed_savepoint(make_job, webhook, settings):
    settings.ALERT_RESTART_LOOP_COUNT = 3
    job = make_job(name="flaky", failure_rate_window_minutes=10)
    for i in range(3):
        run = Run.objects.create(job=job, status=RunStatus.FAILED)
        Recovery.objects.create(
            job=job, failed_run=run, cause="Py4JError: boom", failed_at=timezone.now() - timedelta(minutes=i)
        )
    Savepoint.objects.create(job=job, status=SavepointStatus.FAILED, error="disk full", origin="periodic")
    assert sorted(evaluate()[0]) == [(AlertKind.RESTART_LOOP, "firing"), (AlertKind.SAVEPOINT_FAILED, "firing")]
    assert "3 restarts within 10 minutes" in Alert.objects.get(kind=AlertKind.RESTART_LOOP).message
    assert "disk full" in Alert.objects.get(kind=AlertKind.SAVEPOINT_FAILED).message

    Savepoint.objects.create(job=job, status=SavepointStatus.VERIFIED, origin="user")  # the next one succeeds
    evaluate()
    changes = evaluate(timezone.now() + timedelta(seconds=25))[0]
    assert (AlertKind.SAVEPOINT_FAILED, "resolved") in changes
    assert (AlertKind.RESTART_LOOP, "resolved") not in changes, "the restarts are still inside the window"


def test_a_webhook_that_fails_is_recorded_and_retried_without_resending_the_mail(make_job, webhook):
    job = make_job(trigger_interval_seconds=1)
    running(job)
    commits(job, [100, 200, 350, 600])
    webhook.fail = True
    with pytest.raises(DeliveryFailed, match="webhook: HTTPError"):
        evaluate()
    alert = Alert.objects.get(job=job)
    assert [(n["channel"], n["ok"]) for n in alert.notifications] == [("webhook", False), ("email", True)]

    webhook.fail = False
    alert_deliver(alert.id, "firing")  # what the Celery retry does
    alert.refresh_from_db()
    assert [(n["channel"], n["ok"]) for n in alert.notifications][-1] == ("webhook", True)
    assert len(webhook.received) == 1 and len(mails()) == 1, "the e-mail already sent is not sent again"


def test_the_console_lists_open_and_past_alerts(client, django_user_model, make_job):
    client.force_login(django_user_model.objects.create_user("viewer", password="x"))
    job, other = make_job(name="orders"), make_job(name="clicks")
    Alert.objects.create(job=job, kind=AlertKind.LAG_WARN, message="lag never falls (1 → 9 records)")
    Alert.objects.create(
        job=other, kind=AlertKind.CHECKPOINT_STALL, message="no checkpoint for 99 s", resolved_at=timezone.now()
    )
    page = client.get("/alerts/").content.decode()
    assert "lag never falls" in page and "no checkpoint for 99 s" in page and "(1 open)" in page
    only_open = client.get("/alerts/?state=open").content.decode()
    assert "lag never falls" in only_open and "no checkpoint for 99 s" not in only_open
    assert "no checkpoint for 99 s" not in client.get("/alerts/?job=orders").content.decode()
    assert "Lag growing (WARN)" in client.get("/jobs/orders/").content.decode(), "an open alert heads the job page"
    assert "1 open" in client.get("/").content.decode(), "the job list counts open alerts"


def test_incidents_reach_the_live_stream_as_they_are_recorded(make_job, redis):
    """No rescan: a run's start and end and an alert's opening and all-clear are pushed by the code that records
    them, each once, in the order they happened."""
    job = make_job()
    run = Run.objects.create(job=job, status=RunStatus.STARTING)
    run_started(run_id=run.id)
    Run.objects.filter(id=run.id).update(started_at=timezone.now() - timedelta(seconds=99))
    now = timezone.now()
    alerts_evaluate(now, deliver=lambda *_: None)  # no checkpoint for 99 s: a checkpoint stall opens
    run_finish(run_id=run.id, status=RunStatus.STOPPED, message="stopped on request")
    alerts_evaluate(now + timedelta(seconds=1), deliver=lambda *_: None)
    alerts_evaluate(now + timedelta(seconds=30), deliver=lambda *_: None)  # clear for 29 s: all clear
    alert = job.alerts.get()
    pushed = [json.loads(f[b"data"]) for _, f in redis.xrange(django_settings.LIVE_STREAM)]
    assert [p["incident"]["key"] for p in pushed] == [
        f"run-{run.id}-start",
        f"alert-{alert.id}-open",
        f"run-{run.id}-end",
        f"alert-{alert.id}-end",
    ]
    assert all(p["job"] == job.id for p in pushed)


def test_a_first_batch_that_began_before_the_run_was_marked_started_is_the_runs(make_job):
    """Spark stamps a batch with its trigger time: a slow first batch can start a moment before the driver marks the
    run started. It is still this run's checkpoint, not 'no checkpoint since the run started'."""
    job = make_job(trigger_interval_seconds=1)
    run = running(job, started_seconds_ago=40)
    Checkpoint.objects.create(
        job=job, run=run, batch_id=0, committed_at=run.started_at - timedelta(seconds=1), duration_ms=38_000,
        lag_records=0, end_offset={"id": "x", "n": 10},
    )  # fmt: skip
    stall, _ = job_conditions(job, timezone.now())[AlertKind.CHECKPOINT_STALL]
    assert stall is not None and "since batch 0" in stall


def test_a_jump_in_rows_dropped_by_the_watermark_raises_an_alert(make_job):
    job = make_job(trigger_interval_seconds=1)
    run = running(job)
    now = timezone.now()
    for i, dropped in enumerate([0, 1, 0, 0, 90]):
        Checkpoint.objects.create(
            job=job, run=run, batch_id=i, committed_at=now - timedelta(seconds=5 - i), duration_ms=100, input_rows=300,
            rows_dropped_by_watermark=dropped, lag_records=0, end_offset={"id": "x", "n": 100 * (i + 1)},
        )  # fmt: skip
    changes = alerts_evaluate(now, deliver=lambda *_: None)
    assert [(a.kind, e) for a, e in changes] == [(AlertKind.WATERMARK_DROPS, "firing")]
    assert changes[0][0].message.startswith("90 rows dropped by the watermark in batch 4 (30% of its input;")
