"""The ``statekeeper`` command against a real console (Django's live server on the test database): a malformed token,
``--json`` after the command, and a rollback request as the API receives it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from statekeeper_cli.main import FAILED, main
from statekeeper_sdk import Rejected

from dashboard.api.tokens import token_create
from dashboard.models import Action, ActionKind, Secret
from dashboard.services.actions import action_execute
from tests.conftest import grant
from workers.spark.sources.redis_streams import dead_letter

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


def test_the_command_installs_alone_in_a_bare_venv_and_plans_against_a_console(live_server, operator_token, tmp_path):
    """A team's CI installs the command and nothing of the console: its distribution declares what it needs. The
    distributions are listed outside any checkout, whose egg-info would be found on the path."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    cli = Path(__file__).resolve().parent.parent / "cli"
    installed = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(cli)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    names = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m; print(sorted(d.metadata['Name'].lower() "
         "for d in m.distributions()))"], capture_output=True, text=True, check=True, cwd=tmp_path,
    ).stdout  # fmt: skip
    assert "statekeeper-cli" in names and "pyyaml" in names and "django" not in names and "'statekeeper'" not in names
    specs = tmp_path / "jobs"
    specs.mkdir()
    (specs / "counts.yaml").write_text(
        "name: counts\npipeline: url-counts\nsource_stream: 'events:counts'\nparallelism: 1\nstate: suspended\n"
    )
    env = {"PATH": os.environ.get("PATH", ""), "STATEKEEPER_URL": live_server.url, "STATEKEEPER_TOKEN": operator_token}
    planned = subprocess.run([str(venv / "bin" / "statekeeper"), "plan", str(specs), "--json"], env=env,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert planned.returncode == 2, planned.stderr  # changes to make: the job is new
    assert [j["name"] for j in json.loads(planned.stdout)["jobs"]] == ["counts"], planned.stdout


def test_dead_letters_are_listed_with_their_reason_and_re_driven_by_id(
    capsys, live_server, operator_token, make_job, redis, stream_name
):
    job = make_job(name="orders")
    dead_letter(redis, job.dead_letter_stream,
                [Rejected(f"{1000 + i}-0", "parse", f"items[{i}].price: not a decimal number", b'{"bad": %d}' % i)
                 for i in range(3)])  # fmt: skip
    console = ["--url", live_server.url, "--token", operator_token]
    assert main([*console, "dead-letters", "orders", "--json", "--limit", "2"]) == 0
    page = json.loads(capsys.readouterr().out)
    assert page["total"] == 3 and [d["reason"] for d in page["dead_letters"]] == [
        "items[2].price: not a decimal number", "items[1].price: not a decimal number"
    ], "newest first, with the path that is wrong"  # fmt: skip
    assert main([*console, "dead-letters", "orders", "--before", page["next_before"]]) == 0
    assert "items[0].price" in capsys.readouterr().out

    assert main([*console, "redrive", "orders"]) == FAILED, "neither ids nor --all"
    assert "give the dead letters' ids, or --all" in capsys.readouterr().err

    def worker() -> None:  # the Celery worker's part: the requested action runs
        for _ in range(200):
            if action := Action.objects.filter(job=job, kind=ActionKind.REDRIVE_DEAD_LETTERS).first():
                action_execute(action_id=action.id)
                return
            time.sleep(0.05)

    running = threading.Thread(target=worker)
    running.start()
    assert main([*console, "redrive", "orders", page["dead_letters"][0]["id"], "--timeout", "30"]) == 0
    running.join()
    assert "1 dead letters re-driven into" in capsys.readouterr().out
    assert redis.xlen(stream_name) == 1 and redis.xlen(job.dead_letter_stream) == 2
    assert main([*console, "redrive", "orders", "not-an-id"]) == FAILED
    assert "a list of 1 to 10000 entry ids" in capsys.readouterr().err


def test_bad_spec_files_and_names_get_one_sentence_and_no_traceback(
    capsys, live_server, tmp_path, django_user_model, monkeypatch
):
    """Careless input: each gets one line on stderr naming the file (or the console's answer) and exit 1, never a
    traceback; a secret's name is quoted, so that 'tmpx?y=1' is that name, not 'tmpx' with a query."""
    admin = django_user_model.objects.create_user("admin-bot", password="x")
    grant(admin, "admin")
    token = token_create(user=admin, name="ci")[1]
    files = {
        "latin1.yaml": "name: caf\xe9\n".encode("latin-1"),
        "date.yaml": b"name: a\nstarted: 2026-12-07\n",
        "when.toml": b'name = "a"\nstarted = 2026-12-07T10:00:00Z\n',
        "binary.yaml": b"name: a\nblob: !!binary aGVsbG8=\n",
        "deep.yaml": b"a: " + b"[" * 2000 + b"]" * 2000 + b"\n",
        "list.yaml": b"- a\n- b\n",
        "broken.toml": b"name = \n",
    }
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
        code = main(["--url", live_server.url, "--token", token, "plan", str(tmp_path / name)])
        err = capsys.readouterr().err
        assert code == FAILED and err.startswith(f"statekeeper: {tmp_path / name}: "), (name, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, (name, err)
    code = main(["--url", live_server.url, "--token", token, "plan", str(tmp_path / "missing.yaml")])
    assert code == FAILED and "No such file or directory" in capsys.readouterr().err

    monkeypatch.setattr(sys, "stdin", io.StringIO("s3cret\n"))
    code = main(["--url", live_server.url, "--token", token, "secret", "set", "tmpx?y=1"])
    err = capsys.readouterr().err
    assert code == FAILED and "Traceback" not in err and "tmpx?y=1" in err, err
    assert not Secret.objects.filter(name="tmpx").exists(), "not cut at the '?'"
    monkeypatch.setattr(sys, "stdin", io.StringIO("s3cret\n"))
    code = main(["--url", live_server.url, "--token", token, "secret", "set", "a b"])
    err = capsys.readouterr().err
    assert code == FAILED and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
