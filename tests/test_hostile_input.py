"""Hostile and careless requests against the console as it runs (uvicorn, over real HTTP): each gets a 4xx with a
sentence (JSON under /api/), changes nothing, and leaves no traceback in the web process's log."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from dashboard.api.tokens import token_create
from dashboard.models import Action, AuditEntry, Job, Secret
from tests.conftest import grant

pytestmark = pytest.mark.django_db(transaction=True)


def send(base: str, method: str, path: str, body: bytes | None = None, **headers: str) -> tuple[int, dict, bytes]:
    """One request with the path sent as given (percent-escapes and all), no client-side checks."""
    where = urlparse(base)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    connection.putrequest(method, path, skip_accept_encoding=True)
    for name, value in headers.items():
        connection.putheader(name.replace("_", "-"), value)
    connection.putheader("Content-Length", str(len(body or b"")))
    connection.endheaders(body or b"")
    answer = connection.getresponse()
    data = answer.read()
    connection.close()
    return answer.status, dict(answer.getheaders()), data


def bearer(django_user_model: Any, role: str) -> str:
    user = django_user_model.objects.create_user(f"{role}-bot", password="x")
    if role != "viewer":
        grant(user, role)
    return "Bearer " + token_create(user=user, name="hostile")[1]


def nested(depth: int) -> str:
    return '{"a":' * depth + "1" + "}" * depth


def test_every_hostile_request_gets_a_sentence_changes_nothing_and_logs_no_traceback(
    asgi_server: str, django_user_model: Any, make_job: Any, tmp_path: Path
) -> None:
    make_job(name="orders", pipeline="url-counts")
    admin, operator, viewer = (bearer(django_user_model, r) for r in ("admin", "operator", "viewer"))
    as_json = {"Content_Type": "application/json"}
    upgrade = "/api/v1/jobs/orders/upgrade-preview"
    cases: list[tuple[str, str, bytes | None, dict[str, str], int]] = [
        ("POST", upgrade, b'{"pipeline": "url-counts", "parameters": {"threshold": NaN}}', {"Authorization": operator}, 400),
        ("POST", upgrade, b'{"pipeline": "url-counts", "parameters": {"top": Infinity}}', {"Authorization": operator}, 400),
        ("POST", upgrade, b'{"pipeline": "url-counts", "parameters": {"top": 1e400}}', {"Authorization": operator}, 400),
        ("POST", upgrade, b'{"pipeline": "url-counts", "parameters": {"top": -Infinity}}', {"Authorization": operator}, 400),
        ("POST", "/api/v1/plan", nested(500).encode(), {"Authorization": viewer}, 400),
        ("POST", "/api/v1/plan", nested(100_000).encode(), {"Authorization": viewer}, 400),
        ("GET", "/api/v1/jobs/a%00b", None, {"Authorization": viewer}, 400),
        ("GET", "/api/v1/jobs?name=%00", None, {"Authorization": viewer}, 400),
        ("DELETE", "/api/v1/secrets/a%00", None, {"Authorization": admin}, 400),
        ("PUT", "/api/v1/secrets/s1", b'{"value": "\\ud800"}', {"Authorization": admin}, 400),
        ("PUT", "/api/v1/secrets/s1", b'{"value": "a\\u0000b"}', {"Authorization": admin}, 400),
        ("PATCH", "/api/v1/jobs/orders", b'{"name": "orders", "pipeline": "url-counts", "x\\u0000": 1}',
         {"Authorization": admin, "If-Match": "*"}, 400),
        ("POST", "/api/v1/jobs/orders/savepoint", b"{" + b'"pad": "' + b"x" * 3_000_000 + b'"}',
         {"Authorization": operator}, 413),
    ]  # fmt: skip
    before = (Action.objects.count(), Secret.objects.count(), Job.objects.count())
    for method, path, body, headers, expected in cases:
        status, answer_headers, data = send(asgi_server, method, path, body, **(as_json | headers))
        assert status == expected, (method, path[:60], status, data[:300])
        assert answer_headers.get("Content-Type", "").startswith("application/json"), (path[:60], data[:200])
        assert json.loads(data)["error"].endswith("."), (path[:60], data[:200])
    assert (Action.objects.count(), Secret.objects.count(), Job.objects.count()) == before, "nothing changed"

    # the pages, the login (unauthenticated) and the audit's filter: a short page, not Django's 500
    pages = [
        ("POST", "/login/", b"username=ad%00min&password=x", {"Content_Type": "application/x-www-form-urlencoded"}),
        ("GET", "/audit/?user=%00", None, {}),
        ("GET", "/jobs/a%00b", None, {}),
        ("GET", "/jobs/%ED%A0%80", None, {}),  # a lone surrogate, percent-encoded
    ]
    logins = AuditEntry.objects.filter(verb="login").count()
    for method, path, body, headers in pages:
        status, _, data = send(asgi_server, method, path, body, **headers)
        assert 300 <= status < 500, (path, status, data[:300])  # a redirect or a refusal, never a 500
        assert b"Traceback" not in data and b"Server Error" not in data, (path, data[:300])
    assert AuditEntry.objects.filter(verb="login").count() == logins, "no login attempt recorded with a NUL"
    log = (tmp_path / "web.log").read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    lines = [line for line in log.splitlines() if not line.startswith("INFO:")]  # uvicorn's access lines aside
    assert len(lines) <= len(cases) + len(pages), "at most one line each:\n" + "\n".join(lines)
