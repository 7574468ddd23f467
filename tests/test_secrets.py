"""Secrets and roles for a job's own sinks: no viewer reads a password, no operator redirects a job's output.

A password lives in a secret the console keeps encrypted; a job's parameters name it (``${secret:NAME}``), and only
the job's driver reveals it, for the sinks. An operator upgrades a job within its own pipeline's versions and changes
the parameters it marks operational; where the output goes is the admin's to change."""

from __future__ import annotations

import base64
import hashlib
import importlib
import io
import json
import logging

import pytest
from django.apps import apps as django_apps
from django.db import connection
from statekeeper_sdk import FileSink, Parameter, PayloadFormat, Pipeline

from dashboard.api.tokens import token_create
from dashboard.models import Action, AuditEntry, Deploy, IdempotentRequest, Job, Run, RunStatus, Secret
from dashboard.selectors.deploys import deploy_history
from dashboard.services.runs import run_finish
from dashboard.services.secrets import RedactingFilter, SecretError, into_secret, reveal, secret_set
from tests.conftest import grant, run_through
from tests.support import Orders

PASSWORD = "S3cretPassw0rd"
DSN = f"postgres://team:{PASSWORD}@db.internal:5432/team_orders"
REFERENCED = "postgres://team:${secret:team-db-password}@db.internal:5432/team_orders"


@pytest.fixture
def token(django_user_model):
    def make(role: str) -> str:
        user = django_user_model.objects.create_user(f"{role}-bot", password="x")
        if role != "viewer":
            grant(user, role)
        return "Bearer " + token_create(user=user, name="ci")[1]

    return make


def api(client, method: str, path: str, auth: str, body: dict | None = None, **headers):
    data = json.dumps(body) if body is not None else None
    return client.generic(method, path, data or "", content_type="application/json", HTTP_AUTHORIZATION=auth, **headers)


def spend_job(make_job, **parameters):
    return make_job(pipeline="customer-spend", state_backend="rocksdb", parameters=parameters)


def test_a_secret_is_encrypted_at_rest_and_its_value_is_never_shown_again(client, token, make_job):
    admin, viewer = token("admin"), token("viewer")
    created = api(client, "PUT", "/api/v1/secrets/team-db-password", admin, {"value": PASSWORD})
    assert created.status_code == 201, created.json()
    stored = Secret.objects.get(name="team-db-password")
    assert PASSWORD not in stored.ciphertext and stored.version == 1
    job = spend_job(make_job, orders_dsn=REFERENCED)
    for path in ("/api/v1/secrets", "/api/v1/secrets/team-db-password", f"/api/v1/jobs/{job.name}"):
        answer = api(client, "GET", path, viewer)
        assert answer.status_code == 200 and PASSWORD not in answer.content.decode(), path
    listed = api(client, "GET", "/api/v1/secrets", viewer).json()["secrets"]
    assert listed[0]["name"] == "team-db-password" and listed[0]["jobs"] == [job.name]
    assert api(client, "GET", f"/api/v1/jobs/{job.name}", viewer).json()["parameters"]["orders_dsn"] == REFERENCED
    assert all(PASSWORD not in json.dumps([e.params, e.message, e.target]) for e in AuditEntry.objects.all())
    assert reveal({"orders_dsn": REFERENCED})["orders_dsn"] == DSN, "the driver gets the value back"


def test_only_an_admin_sets_rotates_or_deletes_a_secret(client, token, make_job, as_role):
    for role in ("viewer", "operator"):
        refused = api(client, "PUT", "/api/v1/secrets/team-db-password", token(role), {"value": PASSWORD})
        assert refused.status_code == 403 and "needs the admin role" in refused.json()["error"], role
    assert not Secret.objects.exists()
    admin = token("admin")
    assert api(client, "PUT", "/api/v1/secrets/team-db-password", admin, {"value": PASSWORD}).status_code == 201
    rotated = api(client, "PUT", "/api/v1/secrets/team-db-password", admin, {"value": "N3wPassw0rd"})
    assert rotated.status_code == 200 and rotated.json()["secret"]["version"] == 2
    assert reveal({"dsn": "${secret:team-db-password}"}) == {"dsn": "N3wPassw0rd"}
    for bad in ({"value": ""}, {"value": 7}, {"value": "x", "more": 1}, {}):
        assert api(client, "PUT", "/api/v1/secrets/team-db-password", admin, bad).status_code == 400, bad
    assert api(client, "PUT", "/api/v1/secrets/Not%20A%20Name", admin, {"value": "x"}).status_code == 400
    spend_job(make_job, orders_dsn=REFERENCED)
    in_use = api(client, "DELETE", "/api/v1/secrets/team-db-password", admin)
    assert in_use.status_code == 409 and "still name the secret" in in_use.json()["error"]
    assert {e.verb for e in AuditEntry.objects.filter(outcome="succeeded")} == {"secret-set", "secret-rotate"}

    page = as_role("operator").post("/secrets/", {"name": "other", "value": "x"})
    assert page.status_code == 403 and not Secret.objects.filter(name="other").exists()
    viewer_page = as_role("viewer", "reader").get("/secrets/")
    assert viewer_page.status_code == 200 and b"team-db-password" in viewer_page.content
    assert PASSWORD.encode() not in viewer_page.content and b"N3wPassw0rd" not in viewer_page.content


def test_a_password_written_into_a_parameter_is_refused_and_kept_out_of_the_audit_trail(client, token, make_job):
    admin = token("admin")
    spec = {"name": "spend", "pipeline": "customer-spend", "state_backend": "rocksdb", "source_stream": "events:x",
            "parameters": {"orders_dsn": DSN}, "state": "suspended"}  # fmt: skip
    refused = api(client, "POST", "/api/v1/jobs", admin, spec)
    assert refused.status_code == 400
    assert "orders_dsn: holds a password; keep it in a secret" in refused.json()["error"]
    unknown = api(client, "POST", "/api/v1/jobs", admin, spec | {"parameters": {"orders_dsn": REFERENCED}})
    assert unknown.status_code == 400 and "no secret named 'team-db-password'" in unknown.json()["error"]
    secret_set(name="team-db-password", value=PASSWORD, username="admin")
    created = api(client, "POST", "/api/v1/jobs", admin, spec | {"parameters": {"orders_dsn": REFERENCED}})
    assert created.status_code == 201, created.json()
    trail = json.dumps([[e.params, e.message, e.target] for e in AuditEntry.objects.all()])
    assert PASSWORD not in trail and "team:***@db.internal" in trail, "the refused create is audited, masked"
    upgrade = api(client, "POST", "/api/v1/jobs/spend/upgrade", admin,
                  {"pipeline": "customer-spend", "parameters": {"orders_dsn": DSN}})  # fmt: skip
    assert upgrade.status_code == 409 and "holds a password" in upgrade.json()["error"]
    assert PASSWORD not in json.dumps([e.params for e in AuditEntry.objects.all()])


def test_an_operator_changes_operational_parameters_and_versions_but_not_where_the_output_goes(
    client, token, make_job, as_role
):
    secret_set(name="team-db-password", value=PASSWORD, username="admin")
    job = spend_job(make_job, orders_dsn=REFERENCED, lake_dir="/tmp/sk-lake")
    operator, admin = token("operator"), token("admin")
    url = f"/api/v1/jobs/{job.name}/upgrade"
    for body, needs in [
        ({"pipeline": "customer-spend", "parameters": {"lake_dir": "/tmp/elsewhere"}}, "lake_dir is not among"),
        ({"pipeline": "customer-spend", "parameters": {"orders_dsn": "postgres://x@other/postgres"}}, "orders_dsn"),
        ({"pipeline": "url-counts"}, "to url-counts, another pipeline"),
    ]:
        refused = api(client, "POST", url, operator, body)
        assert refused.status_code == 403, (body, refused.json())
        assert needs in refused.json()["error"] and "needs the admin role" in refused.json()["error"], refused.json()
    assert not Action.objects.filter(kind="upgrade").exists(), "nothing was requested"
    assert AuditEntry.objects.filter(verb="denied", job=job.name).count() == 3

    threshold = api(client, "POST", url, operator, {"pipeline": "customer-spend", "parameters": {"threshold": 50}})
    assert threshold.status_code == 202, threshold.json()
    Action.objects.all().delete()
    version = api(client, "POST", url, operator, {"pipeline": "customer-spend-v2"})
    assert version.status_code == 202, "customer-spend-v2 declares version_of customer-spend"
    Action.objects.all().delete()
    moved = api(client, "POST", url, admin, {"pipeline": "customer-spend", "parameters": {"lake_dir": "/tmp/sk-lake2"}})
    assert moved.status_code == 202, moved.json()
    Action.objects.all().delete()

    page = as_role("operator", "op-page").post(
        f"/jobs/{job.name}/upgrade",
        {"pipeline": "customer-spend", "step": "upgrade", "parameters": "lake_dir = /tmp/elsewhere"},
    )
    assert page.status_code == 403 and b"lake_dir" in page.content and b"admin role" in page.content
    assert not Action.objects.exists()


def test_a_pipeline_cannot_call_where_its_output_goes_operational():
    payload = PayloadFormat("json", schema="a string")
    with pytest.raises(ValueError, match="'lake' names where a sink writes, so it cannot be operational"):
        Pipeline(name="p", title="p", description="", payload=payload, transform=lambda e, p: e, output_mode="update",
                 results=lambda rows: [], views=(), sinks=(FileSink("lake", path="{lake}"),),
                 parameters=(Parameter("lake", "str", "", operational=True),))  # fmt: skip
    with pytest.raises(ValueError, match="a secret cannot be operational"):
        Parameter("key", "str", "", secret=True, operational=True)
    with pytest.raises(ValueError, match="a secret is text"):
        Parameter("key", "int", 0, secret=True)


def test_a_rotation_shows_in_the_deploys_as_changed_and_never_as_a_value(make_job):
    job = spend_job(make_job, orders_dsn=REFERENCED)
    common = {"pipeline": "customer-spend", "reference": "r", "code_hash": "h", "parameters": job.parameters}
    Deploy.objects.create(job=job, secret_versions={"team-db-password": 1}, **common)
    Deploy.objects.create(job=job, secret_versions={"team-db-password": 2}, **common)
    newest = deploy_history(job)[0]
    assert newest.parameter_changes == ["secret team-db-password: changed"]


def test_the_demo_keeps_a_password_of_its_team_database_in_a_secret(db):
    moved = into_secret(DSN, name="demo-team-db-password", username="seed_demo")
    assert moved == "postgres://team:${secret:demo-team-db-password}@db.internal:5432/team_orders"
    assert reveal({"dsn": moved}) == {"dsn": DSN}
    assert into_secret("postgres://postgres@127.0.0.1/team_orders", name="x", username="s").endswith("/team_orders")
    assert not Secret.objects.filter(name="x").exists(), "an address without a password needs no secret"


def test_what_a_driver_writes_back_is_masked(make_job, caplog):
    secret_set(name="api-key", value="k-8f3a9c2e", username="admin")
    revealed = reveal({"orders_dsn": "postgres://team:${secret:api-key}@h/db"})
    job = make_job()
    run = Run.objects.create(job=job, status=RunStatus.RUNNING)
    run_finish(run_id=run.id, status=RunStatus.FAILED, message=f"sink team-db: invalid dsn {revealed['orders_dsn']}")
    assert Run.objects.get(id=run.id).message == "sink team-db: invalid dsn postgres://team:***@h/db"
    record = logging.LogRecord("x", logging.ERROR, "f", 1, "connecting with %s", ("k-8f3a9c2e",), None)
    RedactingFilter().filter(record)
    assert record.getMessage() == "connecting with ***"
    with pytest.raises(SecretError, match="no secret named 'gone'"):
        reveal({"dsn": "${secret:gone}"})


def test_the_migration_moves_inline_passwords_into_secrets_and_masks_their_history(make_job):
    job = spend_job(make_job, orders_dsn=DSN)
    Job.objects.filter(id=job.id).update(applied_spec={"parameters": {"orders_dsn": DSN}})
    deploy = Deploy.objects.create(job=job, pipeline="customer-spend", reference="r", code_hash="h",
                                   parameters={"orders_dsn": DSN})  # fmt: skip
    upgrade = Action.objects.create(job=job, kind="upgrade", params={"parameters": {"orders_dsn": DSN},
                                                                     "from_parameters": {"orders_dsn": DSN}})  # fmt: skip
    entry = AuditEntry.objects.create(verb="job-create", job=job.name, params={"parameters": {"orders_dsn": DSN}})
    IdempotentRequest.objects.create(key="k", user_id=1, method="POST", path="/x", body_hash="h", status=202,
                                     response={"action": {"params": {"orders_dsn": DSN}}})  # fmt: skip
    migration = importlib.import_module("dashboard.migrations.0030_move_inline_passwords_to_secrets")
    with connection.schema_editor() as editor:
        migration.forward(django_apps, editor)

    job.refresh_from_db()
    name = f"{job.name}-orders_dsn"
    reference = "postgres://team:${secret:" + name + "}@db.internal:5432/team_orders"
    assert job.parameters == {"orders_dsn": reference} and job.applied_spec["parameters"]["orders_dsn"] == reference
    assert reveal(job.parameters)["orders_dsn"] == DSN, "the job still writes where it did"
    assert Deploy.objects.get(id=deploy.id).parameters == {"orders_dsn": reference}
    assert Action.objects.get(id=upgrade.id).params["from_parameters"] == {"orders_dsn": reference}
    masked = "postgres://team:***@db.internal:5432/team_orders"
    assert AuditEntry.objects.get(id=entry.id).params == {"parameters": {"orders_dsn": masked}}
    assert IdempotentRequest.objects.get(key="k").response == {"action": {"params": {"orders_dsn": masked}}}
    note = AuditEntry.objects.get(verb="secrets-masked")
    assert PASSWORD not in json.dumps([note.params, note.message]) and note.params["secrets_created"] == [name]
    with connection.schema_editor() as editor:
        migration.forward(django_apps, editor)  # a second run changes nothing
    assert Secret.objects.count() == 1 and AuditEntry.objects.filter(verb="secrets-masked").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_job_writes_to_the_sink_a_secret_names_and_its_run_never_holds_the_value(
    make_job, start_driver, redis, stream_name, tmp_path
):
    """The lake's directory is the secret here: with trust authentication a password is not checked, so only a path
    shows that the driver really revealed the reference for the sink."""
    lake = tmp_path / "lake"
    secret_set(name="team-lake", value=str(lake), username="admin")
    orders = Orders(redis, stream_name)
    orders.send(30, seed=3)
    job = make_job(pipeline="customer-spend", parameters={"lake_dir": "${secret:team-lake}"}, parallelism=1)
    assert run_through(start_driver(job), redis, redis.xlen(stream_name)) == RunStatus.STOPPED
    assert list(lake.rglob("*.parquet")), "the Parquet files are where the secret says"
    assert not (tmp_path / "${secret:team-lake}").exists()
    deploy = Deploy.objects.get(job=job)
    assert deploy.parameters["lake_dir"] == "${secret:team-lake}" and deploy.secret_versions == {"team-lake": 1}
    assert str(lake) not in json.dumps(deploy.spark_conf)


# every form a password takes in a connection string (statekeeper_sdk._passwords): the value, and how it is masked
PASSWORD_FORMS = [
    ("host=127.0.0.1 user=team password='hunter2' dbname=team_orders", "password='***'"),
    ("host=127.0.0.1 user=team password='hunt\\'er 2' dbname=team_orders", "password='***'"),
    ('host=127.0.0.1 user=team password="hunter2" dbname=team_orders', 'password="***"'),
    ("host=127.0.0.1 user=team sslpassword=hunter2 dbname=team_orders", "sslpassword=***"),
    ("host=127.0.0.1 user=team PASSWORD = hunter2", "PASSWORD = ***"),
    ("jdbc:postgresql://db.internal/team?user=team&password=hunter2&ssl=true", "password=***&ssl=true"),
    ("jdbc:sqlserver://db.internal;user=team;password=hunter2;database=orders", "password=***;database"),
    ("jdbc:postgresql://team:hunter2@db.internal/team", "team:***@db.internal"),
    ("Driver={PostgreSQL};Server=db;Uid=team;Pwd=hunter2;", "Pwd=***;"),
    ("PGPASSWORD=hunter2 psql", "PGPASSWORD=***"),
    ('org.apache.kafka.common.security.plain.PlainLoginModule required username="team" password="hunter2";',
     'password="***";'),
]  # fmt: skip


@pytest.mark.parametrize(("value", "shown"), PASSWORD_FORMS)
def test_every_form_of_a_written_password_is_refused_in_a_job_and_masked_in_history(client, token, value, shown):
    from dashboard.services.secrets import mask_passwords

    assert mask_passwords(value).count("hunter2") == 0 and shown in mask_passwords(value), mask_passwords(value)
    assert "hunt" not in mask_passwords(value)
    spec = {"name": "spend", "pipeline": "customer-spend", "state_backend": "rocksdb", "source_stream": "events:x",
            "parameters": {"orders_dsn": value}, "state": "suspended"}  # fmt: skip
    refused = api(client, "POST", "/api/v1/jobs", token("admin"), spec)
    assert refused.status_code == 400 and "holds a password" in refused.json()["error"], refused.json()
    assert "hunt" not in json.dumps([[e.params, e.message, e.target] for e in AuditEntry.objects.all()])
    assert not Job.objects.filter(name="spend").exists()


def test_a_reference_and_a_masked_password_are_not_passwords():
    from dashboard.services.secrets import has_literal_password

    for value in ("password='${secret:db}'", 'password="***"', "password=${secret:db}", "postgres://u:***@h/d",
                  "mypassword=x", "password=''"):  # fmt: skip
        assert not has_literal_password(value), value


def test_the_second_masking_migration_moves_quoted_passwords_keeping_their_quotes(make_job):
    quoted = "host=db.internal user=team password='hunt\\'er 2' dbname=team_orders"
    jaas = 'PlainLoginModule required username="team" password="s3cr\\"et";'
    job = spend_job(make_job, orders_dsn=quoted)
    Job.objects.filter(id=job.id).update(parameters={"orders_dsn": quoted, "sasl": jaas})
    entry = AuditEntry.objects.create(verb="job-create", job=job.name, params={"parameters": {"orders_dsn": quoted}})
    migration = importlib.import_module("dashboard.migrations.0039_mask_quoted_and_other_password_forms")
    with connection.schema_editor() as editor:
        migration.forward(django_apps, editor)
    job.refresh_from_db()
    assert (
        job.parameters["orders_dsn"]
        == "host=db.internal user=team password='${secret:" + job.name + "-orders_dsn}' dbname=team_orders"
    )
    assert reveal(job.parameters) == {"orders_dsn": quoted, "sasl": jaas}, "the job runs with the text it was given"
    assert AuditEntry.objects.get(id=entry.id).params["parameters"]["orders_dsn"].count("***") == 1
    with connection.schema_editor() as editor:
        migration.forward(django_apps, editor)  # a second run changes nothing
    assert Secret.objects.count() == 2


def test_a_key_rotation_re_encrypts_every_secret_and_a_secret_no_key_reads_is_shown(client, token, settings, as_role):
    from cryptography.fernet import Fernet
    from django.core.management import CommandError, call_command

    from dashboard.services.secrets import decrypt

    settings.SECRETS_KEYS = []  # the development key, derived from the secret key
    secret_set(name="team-db-password", value=PASSWORD, username="admin")
    secret_set(name="lake-key", value="k3y", username="admin")
    old_development = Secret.objects.get(name="lake-key").ciphertext

    first = Fernet.generate_key().decode()
    settings.SECRETS_KEYS = [first]  # a production key set without the development one: neither secret reads
    viewer = token("viewer")
    listed = {s["name"]: s["readable"] for s in api(client, "GET", "/api/v1/secrets", viewer).json()["secrets"]}
    assert listed == {"team-db-password": False, "lake-key": False}
    page = as_role("viewer", "page-viewer").get("/secrets/").content.decode()
    assert page.count("data-unreadable") == 2 and "cannot be read" in page
    with pytest.raises(CommandError, match="2 secret\\(s\\) cannot be read with any current key"):
        call_command("reencrypt_secrets", stdout=io.StringIO())

    # the rotation as docs say: the old key stays, after the new one; re-encrypt; the old key leaves
    development = base64.urlsafe_b64encode(
        hashlib.sha256(b"statekeeper-secrets:" + settings.SECRET_KEY.encode()).digest()
    )
    settings.SECRETS_KEYS = [first, development.decode()]
    out = io.StringIO()
    call_command("reencrypt_secrets", stdout=out)
    assert "2 secret(s) re-encrypted" in out.getvalue() and PASSWORD not in out.getvalue()
    assert Secret.objects.get(name="lake-key").ciphertext != old_development
    settings.SECRETS_KEYS = [first]
    assert decrypt(Secret.objects.get(name="team-db-password")) == PASSWORD and decrypt(
        Secret.objects.get(name="lake-key")) == "k3y"  # fmt: skip
    listed = {s["name"]: s["readable"] for s in api(client, "GET", "/api/v1/secrets", viewer).json()["secrets"]}
    assert listed == {"team-db-password": True, "lake-key": True}
    assert AuditEntry.objects.filter(verb="secrets-reencrypt", outcome="succeeded").count() == 1
