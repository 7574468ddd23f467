"""Safe by default on a shared network: unsafe settings refuse to start outside development, every page carries the
security headers, and no template runs a script of its own (the policy allows only the console's files)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from statekeeper.settings import DEV_SECRET, deployment_problems

SETUP = "import django; django.setup(); print('started')"
FERNET_KEY = "7Gq3cT1mYx0m0wS9k2b8YbQ2bq3yVQ0d2fQ8l5m3pKE="


def start(**env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("STATEKEEPER_")}
    clean |= {"DJANGO_SETTINGS_MODULE": "statekeeper.settings", **env}
    return subprocess.run([sys.executable, "-c", SETUP], env=clean, capture_output=True, text=True, timeout=60)


def test_a_deployment_with_the_embedded_defaults_refuses_to_start():
    refused = start()
    assert refused.returncode != 0 and "Refusing to start with unsafe settings" in refused.stderr
    assert "STATEKEEPER_SECRET_KEY is unset" in refused.stderr
    assert "STATEKEEPER_SECRETS_KEY is unset" in refused.stderr
    debug = start(STATEKEEPER_SECRET_KEY="k" * 40, STATEKEEPER_SECRETS_KEY=FERNET_KEY, STATEKEEPER_DEBUG="1")
    assert "STATEKEEPER_DEBUG is on" in debug.stderr
    no_secrets_key = start(STATEKEEPER_SECRET_KEY="k" * 40)
    assert no_secrets_key.returncode != 0 and "STATEKEEPER_SECRETS_KEY is unset" in no_secrets_key.stderr
    assert start(STATEKEEPER_SECRET_KEY="k" * 40, STATEKEEPER_SECRETS_KEY=FERNET_KEY).stdout.strip() == "started"
    assert start(STATEKEEPER_ENV="development").stdout.strip() == "started", "bin/dev's local run"


def test_what_counts_as_unsafe():
    assert deployment_problems("k" * 40, False, ["console.example"], [FERNET_KEY]) == []
    assert len(deployment_problems(DEV_SECRET, True, ["*"], [FERNET_KEY])) == 3
    assert deployment_problems("short", False, []) == [
        "STATEKEEPER_SECRET_KEY is unset or shorter than 32 characters",
        "STATEKEEPER_SECRETS_KEY is unset (it encrypts the secrets of the jobs' sinks)",
        "STATEKEEPER_ALLOWED_HOSTS is empty or '*'",
    ]


@pytest.mark.django_db
def test_every_page_carries_the_security_headers(client):
    page = client.get("/login/")
    policy = page.headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy and "unsafe-eval" not in policy
    assert page.headers["X-Content-Type-Options"] == "nosniff"
    assert page.headers["Referrer-Policy"] == "same-origin"
    assert page.headers["X-Frame-Options"] == "DENY"


def test_no_template_runs_a_script_of_its_own():
    inline = re.compile(r"<script(?![^>]*\b(src|type=\"application/json\")=?)[^>]*>|\son[a-z]+=", re.IGNORECASE)
    found = [
        f"{path.relative_to(settings.BASE_DIR)}: {match.group(0)}"
        for path in Path(settings.BASE_DIR, "templates").rglob("*.html")
        for match in inline.finditer(path.read_text())
    ]
    assert found == [], "the policy allows only the console's own script files"
