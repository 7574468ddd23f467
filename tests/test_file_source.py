"""Spark's file source: a job reads a directory of JSON-lines files as they arrive, every bad row goes to the dead
letters with its reason, and the backlog is counted in files and bytes while the job is down."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dashboard.models import Job, ResultRow, SourceLag
from dashboard.selectors import jobs
from dashboard.services.checkpoints import progress_stream_ingest
from dashboard.services.source_lag import source_lag_sample
from dashboard.templatetags import console
from tests.conftest import wait_for
from tests.support import VALID


@pytest.fixture
def inbox(settings, tmp_path) -> Path:
    settings.FILE_SOURCE_ROOTS = [tmp_path.resolve()]
    folder = tmp_path / "inbox"
    folder.mkdir()
    return folder


@pytest.mark.django_db
def test_the_job_form_takes_a_directory_under_the_allowed_roots_only(as_role, inbox):
    client = as_role("admin")
    files = {**VALID, "pipeline": "dedup", "source_kind": "files", "source_stream": "", "source_format": "json"}
    outside = client.post("/jobs/new", {**files, "source_path": "/etc"})
    assert "File sources are read only under" in outside.content.decode()
    missing = client.post("/jobs/new", {**files, "source_path": str(inbox / "nope")})
    assert "is not a directory" in missing.content.decode()
    regex = client.post("/jobs/new", {**files, "pipeline": "url-counts", "source_path": str(inbox)})
    assert "parses its events as regex" in regex.content.decode()
    assert not Job.objects.exists(), "nothing saved"
    client.post("/jobs/new", {**files, "source_path": str(inbox / ".." / "inbox")})
    job = Job.objects.get(name="clicks")
    assert (job.source_path, job.source_stream, job.lag_unit) == (str(inbox), "files:clicks", "files")


def events(ids: range, now_ms: int) -> list[str]:
    return [json.dumps({"event_id": f"e{i}", "ts": now_ms, "user": f"u{i % 5}"}) for i in ids]


def dead_letters(redis, job: Job) -> list[dict[str, str]]:
    return [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in redis.xrange(job.dead_letter_stream)]


@pytest.mark.spark
@pytest.mark.django_db(transaction=True)
def test_a_job_reads_new_files_dead_letters_bad_rows_and_counts_its_backlog_in_files(
    make_job, start_driver, redis, inbox
):
    job = make_job(
        pipeline="dedup", source_kind="files", source_path=str(inbox), source_format="json", source_stream="files:t"
    )
    now = int(time.time() * 1000)
    lines = events(range(40), now) + events(range(10), now)  # ten repeated upstream
    lines += ["not json", json.dumps({"event_id": "late", "ts": now + 10 * 86_400_000, "user": "u1"}), ""]
    (inbox / "a.json").write_text("\n".join(lines) + "\n")
    driver = start_driver(job)
    wait_for(lambda: ResultRow.objects.filter(job=job).count() == 40, 180, 0.5, "the 40 distinct events")
    wait_for(lambda: len(dead_letters(redis, job)) == 3, 60, 0.5, "the three bad rows in the dead letters")
    assert driver.stop() == "stopped"
    reasons = {d["payload"][:12]: d["reason"] for d in dead_letters(redis, job)}
    assert "it would move the watermark" in reasons['{"event_id":'], reasons
    assert reasons["not json"].startswith("not valid JSON") and reasons["not json"].endswith("(in a.json)"), reasons
    assert reasons[""], reasons
    progress_stream_ingest(client=redis)

    second = inbox / "b.json"
    second.write_text("\n".join(events(range(40, 50), now)) + "\n")
    (inbox / "_ignored.json").write_text("{}\n")  # Spark skips files starting with _ or .
    source_lag_sample()
    sample = SourceLag.objects.filter(job=job).latest("sampled_at")
    assert (sample.source_n, sample.committed_n, sample.lag_records) == (2, 1, 1)
    assert sample.lag_bytes == second.stat().st_size
    assert jobs.job_lag_status(job)["reason"] == "not running: 1 file waiting", "counted in files, not records"
    assert console.lag_count(job, sample.lag_records) == "1 file", "the overview's lag says it as the header does"

    driver = start_driver(Job.objects.get(id=job.id))
    wait_for(lambda: ResultRow.objects.filter(job=job).count() == 50, 180, 0.5, "the new file's events")
    assert driver.stop() == "stopped"
    source_lag_sample()
    assert SourceLag.objects.filter(job=job).latest("sampled_at").lag_records == 0
