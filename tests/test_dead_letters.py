"""Dead letters can be browsed, exported and re-driven into the source; they stay within each job's bounds."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone
from statekeeper_sdk import Rejected

from dashboard.models import Action, ActionKind
from dashboard.services.actions import action_execute
from dashboard.services.dead_letters import dead_letters_trim
from tests.conftest import grant
from workers.spark.sources.redis_streams import dead_letter

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def operator(client, django_user_model):
    user = django_user_model.objects.create_user("oncall", password="x")
    grant(user, "operator")
    client.force_login(user)
    return client


def reject(redis, job, n: int, stage: str = "parse", first_ms: int = 1_000) -> None:
    dead_letter(
        redis,
        job.dead_letter_stream,
        [Rejected(f"{first_ms + i}-0", stage, f"reason {i}", b'{"bad": %d}' % i) for i in range(n)],
    )


def test_browse_export_and_re_drive_the_dead_letters(operator, make_job, redis, stream_name):
    job = make_job(name="orders")
    reject(redis, job, 60)
    dead_letter(redis, job.dead_letter_stream, [Rejected("1-0", "decode", "not valid UTF-8", b"\xff\xfe")])
    dead_letter(redis, job.dead_letter_stream, [Rejected("batch-3:url:ab", "sink", "the key is too long", b"x")])

    page = operator.get("/jobs/orders/dead-letters")
    assert page.context["page"].total == 62 and len(page.context["page"].letters) == 50
    assert "the key is too long" in page.content.decode(), "newest first"
    older = operator.get(f"/jobs/orders/dead-letters?before={page.context['page'].older}").context["page"]
    assert len(older.letters) == 12
    bad = operator.get("/jobs/orders/dead-letters?before=zzz")
    assert bad.status_code == 200 and len(bad.context["page"].letters) == 50, "a bad cursor shows the newest page"

    exported = operator.get("/jobs/orders/dead-letters?format=jsonl")
    assert exported.is_async, "streamed as it is read under ASGI, never whole in memory"
    with pytest.warns(Warning, match="consume asynchronous iterators"):  # the sync test client reads it whole
        lines = [json.loads(line) for line in b"".join(exported).splitlines()]
    assert len(lines) == 62 and lines[0]["payload"] == '{"bad": 0}'
    assert lines[60]["payload_base64"] == "//4=", "invalid UTF-8 is exported as it was sent"

    chosen = [d.id for d in page.context["page"].letters[:3]]  # the sink's refusal and two others
    operator.post("/jobs/orders/dead-letters", {"id": chosen})
    action = Action.objects.get(job=job, kind=ActionKind.REDRIVE_DEAD_LETTERS)
    done = action_execute(action_id=action.id)
    assert done.outcome.startswith("2 dead letters re-driven into") and "1 stayed" in done.outcome
    assert redis.xlen(stream_name) == 2 and redis.xlen(job.dead_letter_stream) == 60
    assert action_execute(action_id=action.id).status == "succeeded", "a redelivered task does nothing twice"

    operator.post("/jobs/orders/dead-letters", {"all": "1"})
    everything = Action.objects.filter(job=job, kind=ActionKind.REDRIVE_DEAD_LETTERS).order_by("-id").first()
    assert action_execute(action_id=everything.id).outcome.startswith("59 dead letters re-driven")
    assert redis.xlen(stream_name) == 61 and redis.xlen(job.dead_letter_stream) == 1, "the sink's refusal stays"
    assert b"\xff\xfe" in [e[b"v"] for _, e in redis.xrange(stream_name)], "the payload goes back as it was sent"


def test_a_viewer_browses_but_cannot_re_drive(client, django_user_model, make_job, redis):
    job = make_job(name="orders")
    reject(redis, job, 2)
    client.force_login(django_user_model.objects.create_user("watcher", password="x"))
    assert "reason 1" in client.get("/jobs/orders/dead-letters").content.decode()
    assert client.post("/jobs/orders/dead-letters", {"all": "1"}).status_code == 403
    assert not Action.objects.exists()


def test_dead_letters_stay_within_the_jobs_count_and_age(make_job, redis):
    now = timezone.now()
    recent_ms = int((now - timedelta(hours=1)).timestamp() * 1000)
    job = make_job(name="orders", dead_letter_max_entries=100, dead_letter_max_age_hours=24)
    reject(redis, job, 50, first_ms=int((now - timedelta(days=3)).timestamp() * 1000))  # too old
    redis.delete(job.dead_letter_stream)  # their stream entries carry today's ids: age them by their markers only
    reject(redis, job, 300, first_ms=recent_ms)
    dead_letters_trim(now)
    assert 100 <= redis.xlen(job.dead_letter_stream) < 300, "trimmed to about the max count"
    assert redis.zcard(f"{job.dead_letter_stream}:seen") == 300, "markers of entries younger than the max age stay"
