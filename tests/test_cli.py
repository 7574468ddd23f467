"""The ``statekeeper`` command against a real console (Django's live server on the test database): a malformed token,
``--json`` after the command, and a rollback request as the API receives it."""

from __future__ import annotations

import json

import pytest

from dashboard.api.tokens import token_create
from statekeeper.cli import FAILED, main
from tests.conftest import grant

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def operator_token(django_user_model) -> str:
    return token_create(user=grant(django_user_model.objects.create_user("deployer"), "operator"), name="ci")[1]


def test_a_malformed_token_is_refused_with_the_reason_before_any_request(capsys, live_server):
    sentence = "token ci for deployer: sk_abc. Keep it: it is not stored"
    assert main(["--url", live_server.url, "--token", sentence, "status"]) == FAILED
    said = capsys.readouterr()
    assert "the token is malformed" in said.err and "Traceback" not in said.err and said.out == ""


def test_json_after_the_command_and_a_rollback_reach_the_api(capsys, live_server, operator_token, make_job):
    job = make_job(name="orders")
    assert main(["--url", live_server.url, "--token", operator_token, "status", "orders", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["jobs"][0]["name"] == "orders" and shown["jobs"][0]["driver"] is None

    # the job has no committed batch: the console refuses the rollback with its reason (a 409, not a bad body)
    assert main(["--url", live_server.url, "--token", operator_token, "rollback", "orders", "3", "--json"]) == FAILED
    said = capsys.readouterr()
    refused = json.loads(said.out)
    assert refused["status"] == 409 and "batch 3" in refused["error"], refused
    assert job.actions.count() == 0, "nothing was requested"
