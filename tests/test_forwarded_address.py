"""The login limit per address holds against a forged X-Forwarded-For, with the console under uvicorn as bin/dev runs
it: straight to uvicorn from loopback, and through a real reverse proxy on loopback that the site lists as trusted
(STATEKEEPER_TRUSTED_PROXIES), whose own hop is the only one believed."""

from __future__ import annotations

import http.client
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

import pytest

from dashboard.models import AuditEntry

pytestmark = pytest.mark.django_db(transaction=True)

CLIENT = "127.0.0.2"  # the browser's address: another loopback address, so that it is not the proxy's


def failed_login(base: str, name: str, forged: str, source: str = CLIENT) -> str:
    """A login with a wrong password, from ``source``, claiming to be ``forged``; the page's text."""
    where = urlparse(base)

    def call(method: str, path: str, body: str = "", cookie: str = "") -> tuple[http.client.HTTPResponse, str]:
        connection = http.client.HTTPConnection(where.hostname, where.port, timeout=30, source_address=(source, 0))
        headers = {"X-Forwarded-For": forged, "Content-Type": "application/x-www-form-urlencoded"}
        connection.request(method, path, body=body, headers=headers | ({"Cookie": cookie} if cookie else {}))
        answer = connection.getresponse()
        text = answer.read().decode()
        connection.close()
        return answer, text

    page, text = call("GET", "/login/")
    cookie = re.search(r"csrftoken=([^;]+)", page.getheader("Set-Cookie") or "")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', text)
    assert cookie and token, text[:500]
    _, answer = call("POST", "/login/", f"username={name}&password=wrong&csrfmiddlewaretoken={token[1]}",
                     f"csrftoken={cookie[1]}")  # fmt: skip
    return answer


class Proxy(ThreadingHTTPServer):
    """A reverse proxy as nginx's ``proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for`` is: the client's
    header, then the address the proxy saw."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlparse(upstream)
        super().__init__(("127.0.0.1", 0), ProxyHandler)


class ProxyHandler(BaseHTTPRequestHandler):
    server: Proxy

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "x-forwarded-for")}
        seen = [h for h in (self.headers.get("X-Forwarded-For"), self.client_address[0]) if h]
        headers["X-Forwarded-For"] = ", ".join(seen)
        upstream = http.client.HTTPConnection(self.server.upstream.hostname, self.server.upstream.port, timeout=30)
        upstream.request(self.command, self.path, body=body, headers=headers)
        answer = upstream.getresponse()
        data = answer.read()
        self.send_response(answer.status)
        for name, value in answer.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        upstream.close()

    do_GET = do_POST = _forward

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def trusting_console(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """The console trusting a proxy at 127.0.0.1, and that proxy in front of it: (the console, the proxy)."""
    monkeypatch.setenv("STATEKEEPER_TRUSTED_PROXIES", "127.0.0.1")
    monkeypatch.setenv("STATEKEEPER_LOGIN_FAILURES", "3")
    console = request.getfixturevalue("asgi_server")
    proxy = Proxy(console)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield console, f"http://127.0.0.1:{proxy.server_address[1]}"
    proxy.shutdown()


def test_through_a_trusted_proxy_the_limit_counts_the_address_the_proxy_saw(trusting_console) -> None:
    _, proxy = trusting_console
    answers = [failed_login(proxy, f"nobody-{n}", f"198.51.100.{n}") for n in range(4)]
    assert "Too many failed logins" not in answers[2] and "Too many failed logins" in answers[3], answers[3][:300]
    addresses = set(AuditEntry.objects.filter(verb="login").values_list("address", flat=True))
    assert addresses == {CLIENT}, addresses


def test_straight_to_the_console_a_rotating_forged_address_is_never_read(asgi_server: str, settings: Any) -> None:
    """No proxy listed: the client on 127.0.0.1 (where uvicorn would believe the header by default) writes a new
    X-Forwarded-For each time, and is locked out after the allowed failures all the same."""
    allowed = settings.LOGIN_FAILURES_ALLOWED
    answers = [failed_login(asgi_server, f"someone-{n}", f"203.0.113.{n}", "127.0.0.1") for n in range(allowed + 1)]
    assert "Too many failed logins" in answers[-1], "a rotating forged address does not reset the count"
    addresses = set(AuditEntry.objects.filter(verb="login").values_list("address", flat=True))
    assert addresses == {"127.0.0.1"}, addresses
