"""The console's database connections as a site sizes max_connections by them: the web process (uvicorn) keeps none
once its requests end, each process names itself in pg_stat_activity, and a database that does not answer gets a
503 with Retry-After, never a traceback."""

from __future__ import annotations

import http.cookiejar
import json
import os
import re
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from django.db import connection

from dashboard.api.tokens import token_create
from statekeeper.processes import web_command
from tests.conftest import stop_process_group, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def web_connections() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT state FROM pg_stat_activity WHERE application_name = 'statekeeper-web' AND datname = %s",
            [connection.settings_dict["NAME"]],
        )
        return [row[0] for row in cursor.fetchall()]


def test_the_web_process_keeps_no_connection_past_its_requests(asgi_server: str, django_user_model, make_job) -> None:
    make_job(name="orders")
    user = django_user_model.objects.create_user("viewer-bot", password="x")
    bearer = "Bearer " + token_create(user=user, name="ci")[1]

    def read(path: str) -> int:
        request = urllib.request.Request(asgi_server + path, headers={"Authorization": bearer})
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status

    with ThreadPoolExecutor(16) as pool:  # as many requests at once as uvicorn's threads would take
        statuses = list(pool.map(read, ["/api/v1/jobs", "/api/v1/jobs/orders", "/api/v1/jobs/orders/runs"] * 20))
    assert set(statuses) == {200}
    # each request's connection is closed as it ends: none stays open, idle, in the web process
    wait_for(lambda: not web_connections(), 10, 0.2, "the web process's connections to close")


def refused_with_503(call) -> str:
    """The body of the 503 ``call`` gets; it says why in a sentence, with Retry-After and no traceback."""
    with pytest.raises(urllib.error.HTTPError) as refused:
        call()
    body = refused.value.read().decode()
    assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "5", body[:300]
    assert "Traceback" not in body and "not answering" in body, body[:300]
    return body


def test_a_database_that_does_not_answer_gets_a_503_with_retry_after(tmp_path: Path, settings) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with socket.socket() as closed:  # a port where no server listens: the database is down
        closed.bind(("127.0.0.1", 0))
        nothing = closed.getsockname()[1]
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "statekeeper.settings_test", "STATEKEEPER_TEST_PROCESS": "1",
           "DATABASE_URL": f"postgres://statekeeper@127.0.0.1:{nothing}/statekeeper", "REDIS_URL": settings.REDIS_URL}  # fmt: skip
    with open(tmp_path / "web.log", "ab") as log:
        server = subprocess.Popen(web_command(port), env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
    try:

        def answers() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return True
            except OSError:
                return False

        wait_for(answers, 30, 0.2, "uvicorn to listen")
        base = f"http://127.0.0.1:{port}"
        api = urllib.request.Request(base + "/api/v1/jobs", headers={"Authorization": "Bearer sk_x"})
        body = refused_with_503(lambda: urllib.request.urlopen(api, timeout=30))
        assert json.loads(body)["error"].startswith("The database is not answering"), body
        # a login (the page itself needs no database; checking the password does)
        browser = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        page = browser.open(base + "/login/", timeout=30).read().decode()
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        assert token, page[:300]
        form = urllib.parse.urlencode({"username": "admin", "password": "x", "csrfmiddlewaretoken": token[1]})
        refused_with_503(lambda: browser.open(base + "/login/", form.encode(), timeout=30))
    finally:
        stop_process_group(server, 10)
    assert "Traceback" not in (tmp_path / "web.log").read_text(errors="replace")
