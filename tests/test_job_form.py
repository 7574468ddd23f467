"""Creating and editing jobs in the console: every bad input gets a field error and nothing is saved."""

from __future__ import annotations

import pytest

from dashboard import pipelines
from dashboard.models import Checkpoint, Job
from tests.conftest import grant
from tests.support import VALID

pytestmark = pytest.mark.django_db


@pytest.fixture
def client(client, django_user_model):
    client.force_login(grant(django_user_model.objects.create_user("operator", password="x"), "admin"))
    return client


def post_new(client, **changes):
    return client.post("/jobs/new", {**VALID, **changes})


def test_a_valid_job_is_created_with_its_checkpoint_under_the_root(client, checkpoint_root):
    response = post_new(client)
    assert response.status_code == 302
    job = Job.objects.get(name="clicks")
    assert job.checkpoint_location == checkpoint_root / "clicks" / "checkpoint"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("name", "../../etc", "lower-case letters, digits and hyphens"),
        ("name", "Has Spaces", "lower-case letters, digits and hyphens"),
        ("name", "", "This field is required"),
        ("pipeline", "no-such-pipeline", "Select a valid choice"),
        ("source_stream", "events clicks", "letters, digits and : . _ - only"),
        ("state_backend", "filesystem", "Select a valid choice"),
        ("trigger_interval_seconds", "0", "greater than or equal to 0.1"),
        ("trigger_interval_seconds", "soon", "Enter a number"),
        ("state_partitions", "0", "greater than or equal to 1"),
        ("parallelism", "65", "less than or equal to 64"),
        ("batches_retained", "1", "greater than or equal to 2"),
        ("max_records_per_batch", "-5", "greater than or equal to"),
    ],
)
def test_bad_input_gets_a_field_error(client, field, value, message):
    response = post_new(client, **{field: value})
    assert response.status_code == 400
    assert message in " ".join(response.context["form"].errors[field])
    assert not Job.objects.exists()


def test_a_pipeline_that_needs_rocksdb_is_refused_on_the_memory_backend(client):
    response = post_new(client, pipeline="order-state-machine")
    assert response.status_code == 400
    assert "needs RocksDB" in response.context["form"].errors["state_backend"][0]


def test_a_duplicate_name_is_refused(client):
    post_new(client)
    response = post_new(client, source_stream="events:other")
    assert response.status_code == 400
    assert "already exists" in response.context["form"].errors["name"][0]


def test_settings_frozen_in_the_checkpoint_cannot_change_once_the_job_has_state(client):
    post_new(client)
    job = Job.objects.get(name="clicks")
    Checkpoint.objects.create(job=job, batch_id=0, committed_at="2026-11-21T00:00:00Z", duration_ms=10)
    job.latest_checkpoint = job.checkpoints.get()
    job.save()

    response = client.post(f"/jobs/{job.name}/edit", {**VALID, "state_partitions": "8", "state_backend": "rocksdb"})
    assert response.status_code == 400
    errors = response.context["form"].errors
    assert "frozen in the checkpoint" in errors["state_partitions"][0]
    assert "frozen in the checkpoint" in errors["state_backend"][0]
    job.refresh_from_db()
    assert (job.state_partitions, job.state_backend) == (4, "memory")

    response = client.post(f"/jobs/{job.name}/edit", {**VALID, "parallelism": "1", "max_records_per_batch": "900"})
    assert response.status_code == 302, "compute settings may change: they apply at the next start"
    job.refresh_from_db()
    assert (job.parallelism, job.max_records_per_batch) == (1, 900)


def test_a_job_without_state_may_change_anything(client):
    post_new(client)
    response = client.post("/jobs/clicks/edit", {**VALID, "state_partitions": "8", "state_backend": "rocksdb"})
    assert response.status_code == 302
    assert Job.objects.get(name="clicks").state_partitions == 8


def test_pages_need_a_login(db):
    from django.test import Client

    response = Client().get("/jobs/new")
    assert response.status_code == 302
    assert "/login/" in response["Location"]


def test_an_edit_never_writes_back_the_lease_or_fork_it_read(client):
    """The form reads the job, a driver takes the lease and a restore switches the fork, then the form saves: the
    driver keeps its lease (a stale token written back would fence it) and the job stays on the new fork."""
    from dashboard.forms import JobForm

    post_new(client)
    job = Job.objects.get(name="clicks")
    form = JobForm({**VALID, "max_records_per_batch": "900"}, instance=job)
    assert form.is_valid()
    Job.objects.filter(id=job.id).update(lease_token=7, checkpoint_dir="checkpoint-restore-3")
    form.save()
    job.refresh_from_db()
    assert (job.lease_token, job.checkpoint_dir, job.max_records_per_batch) == (7, "checkpoint-restore-3", 900)


def test_a_jobs_parameters_are_checked_against_its_pipeline_and_a_change_with_state_is_an_upgrade(client):
    spend = {**VALID, "name": "spend", "pipeline": "customer-spend", "state_backend": "rocksdb"}
    refused = client.post("/jobs/new", {**spend, "parameters": "window_minutes = 0\ncolour = red"})
    assert refused.status_code == 400
    assert (
        "window_minutes: must be at least 1, got 0" in refused.text
        and "colour: the pipeline has no such parameter" in refused.text
    )
    assert client.post("/jobs/new", {**spend, "parameters": "window minutes 5"}).status_code == 400
    assert not Job.objects.filter(name="spend").exists()

    assert client.post("/jobs/new", {**spend, "parameters": "window_minutes = 15\nthreshold = 49.5"}).status_code == 302
    job = Job.objects.get(name="spend")
    assert job.parameters == {"window_minutes": 15, "threshold": 49.5}, "kept as the pipeline reads them"
    form = client.get("/jobs/spend/edit").text
    assert "window_minutes = 15\nthreshold = 49.5" in form and 'data-parameters-of="customer-spend"' in form

    job.latest_checkpoint = Checkpoint.objects.create(
        job=job, batch_id=0, committed_at="2026-11-24T00:00:00Z", duration_ms=10
    )
    job.save()
    changed = client.post("/jobs/spend/edit", {**spend, "parameters": "window_minutes = 30"})
    assert changed.status_code == 400 and "a parameter change is an upgrade" in changed.text
    assert Job.objects.get(name="spend").parameters == {"window_minutes": 15, "threshold": 49.5}


def test_a_pipeline_whose_sink_cannot_be_written_here_is_refused_with_the_reason(
    client, settings, tmp_path, monkeypatch
):
    """A Kafka sink without Spark's Kafka connector, a file sink's relative directory: refused in the form, naming the
    sink, instead of a job that fails at its first batch. A sink left empty by its parameter is off, and fine."""
    monkeypatch.delenv("STATEKEEPER_SPARK_JARS", raising=False)  # a console whose set-up did not fetch the connector
    settings.PIPELINES = [*settings.BUILTIN_PIPELINES, "tests.user_pipelines:SPEND_TO_KAFKA"]
    pipelines.registry.cache_clear()
    try:
        spend = {**VALID, "name": "spend", "state_backend": "rocksdb"}
        refused = client.post("/jobs/new", {**spend, "pipeline": "spend-to-kafka"})
        assert refused.status_code == 400
        assert "sink spend-topic: Spark&#x27;s Kafka connector is not on the class path" in refused.text
        relative = client.post("/jobs/new", {**spend, "pipeline": "customer-spend", "parameters": "lake_dir = lake"})
        assert relative.status_code == 400 and "sink lake: its directory must be an absolute path" in relative.text
        # outside STATEKEEPER_FILE_SINK_ROOTS (the suite's is the temporary directory), also by way of ..
        for elsewhere in ("/srv/lake", f"{tmp_path}/{'../' * 12}etc/lake"):
            outside = client.post(
                "/jobs/new", {**spend, "pipeline": "customer-spend", "parameters": f"lake_dir = {elsewhere}"}
            )
            assert outside.status_code == 400, elsewhere
            assert (
                "sink lake: files are written only under" in outside.text
                and "STATEKEEPER_FILE_SINK_ROOTS" in outside.text
            )
        assert not Job.objects.filter(name="spend").exists()
        lake = f"lake_dir = {tmp_path / 'lake'}"
        assert client.post("/jobs/new", {**spend, "pipeline": "customer-spend", "parameters": lake}).status_code == 302
    finally:
        pipelines.registry.cache_clear()
