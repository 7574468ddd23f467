"""Stateful upgrades of a pipeline from an installed package (examples/user_sessions): a compatible upgrade keeps the
state and every total, an incompatible one is refused before anything stops, a failed one rolls itself back, and an
upgrade can be rolled back on request."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import Error as PlaywrightError
from statekeeper_sdk._runtime.compatibility import COMPATIBLE, EVOLVES, INCOMPATIBLE, compare

from dashboard import pipelines
from dashboard.models import Action, ActionKind, ActionStatus, Job, ResultRow, RunStatus
from dashboard.services import state_reader_client, upgrades
from dashboard.services.action_steps import Next, Wait
from dashboard.services.actions import action_request
from dashboard.services.runs import job_request_start, job_request_stop
from dashboard.services.upgrades import PLAN_KEPT_SECONDS, fresh_preview, plan_code
from tests.conftest import wait_for
from tests.support import events_counted, finished, running_with_progress, send, switched_to


def schema(**fields: str) -> dict:
    return {
        "type": "struct",
        "fields": [{"name": n, "type": t, "nullable": True, "metadata": {}} for n, t in fields.items()],
    }


def operator(key: dict, value: dict, variables: str = "totals", op_id: int = 0) -> dict:
    return {"id": op_id, "name": "transformWithStateInPySparkExec", "output_mode": "Update",
            "variables": {variables: {"key": key, "value": value}}}  # fmt: skip


V1 = schema(events="long", amount="double")


def verdicts(after: list[dict], new: str = "user-sessions-v2") -> list[tuple[str, str]]:
    plan = {"before": [operator(schema(user="string"), V1)], "after": after}
    found = compare(plan, pipelines.get("user-sessions"), pipelines.get(new))
    return [(v.verdict, v.reason) for v in found]


def test_the_example_package_registers_through_its_entry_points_only():
    assert {"user-sessions", "user-sessions-v2", "user-sessions-by-region"} <= set(pipelines.names())
    assert pipelines.reference("user-sessions") == "user_sessions.pipelines:SESSIONS"
    code = pipelines.code_version("user-sessions")
    assert code.package == "statekeeper-example-user-sessions 1.1.0" and len(code.code_hash) == 64


def test_verdicts_per_state_variable():
    same = verdicts([operator(schema(user="string"), V1)])
    assert same == [(COMPATIBLE, "same key and value schema")]
    added = verdicts([operator(schema(user="string"), schema(events="long", amount="double", largest="double"))])
    assert added[0][0] == EVOLVES and "added largest" in added[0][1]
    renamed_key = verdicts([operator(schema(region="string"), V1)])
    assert renamed_key[0][0] == INCOMPATIBLE
    assert "key schema changed (added region string; removed user)" in renamed_key[0][1]
    window = {
        "type": "struct",
        "fields": [{"name": "start", "type": "timestamp"}, {"name": "end", "type": "timestamp"}],
    }
    items = {"type": "array", "elementType": schema(sku="string", qty="integer"), "containsNull": True}
    nested_before = operator(schema(window=window, customer="string"), schema(items=items))
    wider = {**items, "elementType": schema(sku="string", qty="long")}
    nested_after = operator(
        schema(window={**window, "fields": window["fields"][:1]}, customer="string"), schema(items=wider)
    )
    plan = {"before": [nested_before], "after": [nested_after]}
    nested = compare(plan, pipelines.get("user-sessions"), pipelines.get("user-sessions"))
    assert nested[0].verdict == INCOMPATIBLE and "key schema changed (removed window.end)" in nested[0].reason
    plan = {
        "before": [nested_before],
        "after": [operator(schema(window=window, customer="string"), schema(items=wider))],
    }
    nested = compare(plan, pipelines.get("user-sessions"), pipelines.get("user-sessions"))
    assert nested[0].verdict == EVOLVES and "items[].qty integer → long" in nested[0].reason
    new_operator = verdicts([operator(schema(user="string"), V1), operator(schema(user="string"), V1, op_id=1)])
    assert (INCOMPATIBLE, "operator added: it has no state to start from") in new_operator
    removed_variable = verdicts([operator(schema(user="string"), V1, variables="other")])
    assert (INCOMPATIBLE, "state variable removed: its state would be lost") in removed_variable
    refused = compare({"replay_error": "STATE_STORE_VALUE_SCHEMA_NOT_COMPATIBLE"}, None, pipelines.get("user-sessions"))
    assert refused[0].verdict == INCOMPATIBLE and "STATE_STORE_VALUE_SCHEMA_NOT_COMPATIBLE" in refused[0].reason


@pytest.mark.spark
def test_the_test_kit_checks_an_upgrade_offline_with_the_consoles_verdict_and_words(kit_spark, tmp_path):
    """A team's pull request meets the verdicts the browser test above meets on a live job: the key renamed is
    refused with the same reason, the value widened evolves."""
    from statekeeper_sdk.testing import check_upgrade, run_batches
    from user_sessions.pipelines import SESSIONS, SESSIONS_BY_REGION, SESSIONS_V2

    events = [{"user": f"u{i % 3}", "region": "eu", "amount": i} for i in range(12)]
    run_batches(SESSIONS, [events[:6], events[6:]], spark=kit_spark, workdir=tmp_path)
    by_region = check_upgrade(SESSIONS, tmp_path, SESSIONS_BY_REGION, spark=kit_spark)
    assert by_region.incompatible and by_region.summary.startswith("Incompatible with user-sessions-by-region: ")
    assert "key schema changed (added region string; removed user)" in by_region.summary
    v2 = check_upgrade(SESSIONS, tmp_path, SESSIONS_V2, spark=kit_spark)
    assert [v.verdict for v in v2.verdicts] == [EVOLVES] and not v2.incompatible
    assert v2.summary.startswith(f"Compatible with user-sessions-v2 at batch {v2.batch} (1 state variable(s) ")
    assert v2.migration is None and by_region.migration is None


def caught_up(job: Job, sent: int) -> bool:
    return events_counted(job) == sent


@pytest.fixture
def broken_version_installed(monkeypatch):
    """The processes the test starts (worker, drivers) also register the buggy version 2."""
    monkeypatch.setenv("STATEKEEPER_PIPELINES", "tests.user_pipelines:BROKEN_SESSIONS_V2")


@pytest.mark.spark
@pytest.mark.browser
@pytest.mark.django_db(transaction=True)
def test_an_operator_is_refused_an_incompatible_upgrade_shadow_runs_upgrades_and_rolls_back_in_the_browser(
    live_server, browser_login, make_job, redis, stream_name, celery_worker, tmp_path
):
    job = make_job(pipeline="user-sessions", state_backend="rocksdb", parallelism=1, trigger_interval_seconds=1)
    sent = send(redis, stream_name, 300, seed=1)
    job_request_start(job=job)
    first = wait_for(lambda: running_with_progress(job), 180, 0.5, "version 1 to commit")
    wait_for(lambda: caught_up(job, sent), 120, 0.5, "version 1 to count every event")
    page = browser_login(live_server.url, "oncall")
    deploys = f"{live_server.url}/jobs/{job.name}/deploys"

    def settled() -> None:
        """The tab, loaded while its action ran, follows the action and shows itself again as it goes (a preview's
        verdict) and once it ends."""

        def still_following() -> bool:
            try:
                page.wait_for_load_state()
                return page.locator("[data-action-wait]").count() > 0
            except PlaywrightError:  # it is showing itself again just now
                return True

        wait_for(lambda: not still_following(), 120, 0.3, "the tab to show its action's end")

    def show_deploys() -> None:
        """Open the tab. Its script may be showing it again just then (an action it followed has ended, and the
        server's answer is still on its way): the browser drops one of the two navigations, and the tab is asked for
        again."""
        for _ in range(5):
            try:
                page.goto(deploys)
                return
            except PlaywrightError as exc:
                if "interrupted by another navigation" not in str(exc):
                    raise
                settled()  # the tab's script shows it again until its action has ended
        page.goto(deploys)

    def verdict_shown(text: str) -> bool:
        settled()
        return text in page.content() and page.locator("[data-verdict]").count() == 1

    # Upgrade to an incompatible version: refused before anything stopped, with the preview's verdict on the tab.
    show_deploys()
    page.select_option("select[name=pipeline]", "user-sessions-by-region")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Upgrade", exact=True).click()
    refused = finished(Action.objects.filter(job=job, kind=ActionKind.UPGRADE).latest("id"))
    assert refused.status == ActionStatus.FAILED and "Refused before anything stopped" in refused.outcome
    assert verdict_shown("key schema changed (added region string; removed user)")
    assert page.locator("[data-verdict]").get_attribute("data-verdict") == "incompatible"
    page.screenshot(path=str(tmp_path / "refused-incompatible.png"), full_page=True)
    first.refresh_from_db()
    assert first.status == RunStatus.RUNNING and switched_to(job, "user-sessions")

    # A shadow run: version 2 and version 1 from the newest savepoint over the same 200 records, beside the live job.
    assert finished(action_request(job=job, kind=ActionKind.SAVEPOINT)).status == ActionStatus.SUCCEEDED
    shadow_users = ["u1", "u2", "u3"]
    sent += send(redis, stream_name, 200, seed=5, users=shadow_users)
    wait_for(lambda: caught_up(job, sent), 120, 0.5, "version 1 to count the shadow run's input")
    show_deploys()
    page.select_option("select[name=pipeline]", "user-sessions-v2")
    page.fill("input[name=records]", "200")
    page.get_by_role("button", name="Shadow run").click()
    shadow = finished(Action.objects.filter(job=job, kind=ActionKind.UPGRADE_SHADOW).latest("id"))
    assert shadow.status == ActionStatus.SUCCEEDED, shadow.outcome
    settled()
    # each user's row gains "largest" and keeps every other figure; nothing appears or disappears
    assert page.locator("[data-shadow]").get_attribute("data-shadow") == "0/0/3"
    changed = shadow.params["shadow"]["rows"]["changed"]
    assert sorted(row["key"] for row in changed) == shadow_users
    for row in changed:
        assert {k: v for k, v in row["after"].items() if k != "largest"} == row["before"]
    page.screenshot(path=str(tmp_path / "shadow.png"), full_page=True)
    first.refresh_from_db()
    assert first.status == RunStatus.RUNNING, "the live job ran through the shadow run"

    # Preview a compatible version (a field added to the state's value), then upgrade to it while events arrive:
    # the upgrade takes the preview's plan rather than re-running a batch, and every total is kept.
    page.select_option("select[name=pipeline]", "user-sessions-v2")
    page.get_by_role("button", name="Preview", exact=True).click()
    preview = finished(Action.objects.filter(job=job, kind=ActionKind.UPGRADE_PREVIEW).latest("id"))
    assert preview.status == ActionStatus.SUCCEEDED, preview.outcome
    settled()
    assert page.locator("[data-plan-proof]").get_attribute("data-plan-proof") == "proven", "and its batch's proof"
    page.select_option("select[name=pipeline]", "user-sessions-v2")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Upgrade", exact=True).click()
    wait_for(lambda: switched_to(job, "user-sessions-v2"), 300, 0.5, "the switch to version 2")
    sent += send(redis, stream_name, 200, seed=2)
    upgrade = finished(Action.objects.filter(job=job, kind=ActionKind.UPGRADE).latest("id"))
    assert upgrade.status == ActionStatus.SUCCEEDED, upgrade.outcome
    assert [v["verdict"] for v in upgrade.params["plan"]["verdicts"]] == [EVOLVES]
    assert upgrade.params["plan_from"] == preview.id and upgrade.params["plan"] == preview.params["plan"]
    assert "plan" not in [p["step"] for p in upgrade.phases], "no batch re-run: the preview's plan stood"
    wait_for(lambda: caught_up(job, sent), 180, 0.5, "version 2 to count every event")
    assert ResultRow.objects.filter(job=job, kind="totals", value__has_key="largest").exists(), "the new field"
    history = list(job.deploys.order_by("id"))
    assert [d.pipeline for d in history] == ["user-sessions", "user-sessions-v2"]
    assert history[1].upgrade_id == upgrade.id
    way_back = job.savepoints.get(id=upgrade.params["savepoint"])
    assert way_back.deploy_id == history[0].id, "the savepoint says which code wrote it"
    assert way_back.status == "verified", "Spark read its state after the first batch; the upgrade returned after it"
    phases = [p["step"] for p in upgrade.phases]
    assert phases.index("verify") < phases.index("switch") < phases.index("first-batch")
    settled()
    show_deploys()
    assert page.locator(f"#deploy-{history[1].id}").count() == 1 and "evolves" in page.content()
    page.screenshot(path=str(tmp_path / "upgraded.png"), full_page=True)

    # Roll the upgrade back: version 1 from the savepoint replays what version 2 read.
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Roll back the upgrade").click()
    back = finished(Action.objects.filter(job=job, kind=ActionKind.UPGRADE_ROLLBACK).latest("id"))
    assert back.status == ActionStatus.SUCCEEDED, back.outcome
    assert switched_to(job, "user-sessions")
    settled()
    assert page.get_by_role("button", name="Roll back the upgrade").count() == 0, "nothing left to roll back"

    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, 0.5, "the stop")
    assert events_counted(job) == sent, "every event counted exactly once across every switch"


def user_events(job: Job) -> int:
    rows = ResultRow.objects.filter(job=job, kind="totals")
    return sum(int(r.value["events"]) for r in rows if r.key == "boom" or r.key[1:].isdigit())


def region_events(job: Job) -> int:
    return sum(int(r.value["events"]) for r in ResultRow.objects.filter(job=job, kind="totals", key__in=["eu", "us"]))


@pytest.mark.spark
@pytest.mark.chaos  # a broken version and four switches: about five minutes, beyond the default suite's budget
@pytest.mark.django_db(transaction=True)
def test_a_failed_upgrade_rolls_itself_back_and_an_incompatible_one_can_start_with_empty_state(
    broken_version_installed, make_job, redis, stream_name, celery_worker
):
    job = make_job(pipeline="user-sessions", state_backend="rocksdb", parallelism=1, trigger_interval_seconds=1)
    sent = send(redis, stream_name, 100, seed=1)
    job_request_start(job=job)
    wait_for(lambda: user_events(job) == sent, 180, 0.5, "version 1 to count every event")

    # A quiet job: the upgrade to a version with a bug returns once its run is up, "not yet proven"; its first batch
    # then fails, and the watch rolls it back by itself and says why.
    failing = finished(action_request(job=job, kind=ActionKind.UPGRADE, params={"pipeline": "user-sessions-v2-broken"}))
    assert failing.status == ActionStatus.SUCCEEDED and failing.proof["state"] == "unproven", failing.outcome
    assert "running, not yet proven" in failing.outcome
    sent += send(redis, stream_name, 20, seed=4, users=["boom", "u1"])
    rollback = wait_for(
        lambda: Action.objects.filter(job=job, kind=ActionKind.UPGRADE_ROLLBACK).first(),
        180,
        0.5,
        "the watch's rollback",
    )
    rollback = finished(rollback)
    assert rollback.status == ActionStatus.SUCCEEDED and rollback.origin == "upgrade-watch", rollback.outcome
    assert "failed after it returned" in rollback.outcome and "a bug in version 2" in rollback.outcome
    failing.refresh_from_db()
    assert failing.proof["state"] == "failed" and failing.proof["rollback"] == rollback.id
    assert switched_to(job, "user-sessions")
    wait_for(lambda: user_events(job) == sent, 180, 0.5, "version 1 to count every event after the automatic rollback")

    # Input already waiting: the upgrade waits for the first batch, which fails, and rolls back within the action.
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, 0.5, "the stop")
    sent += send(redis, stream_name, 20, seed=5, users=["boom", "u2"])
    failing = finished(
        action_request(job=job, kind=ActionKind.UPGRADE, params={"pipeline": "user-sessions-v2-broken", "start": 1})
    )
    assert failing.status == ActionStatus.FAILED
    assert "rolled back by itself" in failing.outcome and "a bug in version 2" in failing.outcome, failing.outcome
    assert [p["step"] for p in failing.phases][-4:] == [
        "roll-back",
        "roll-back-exit",
        "roll-back-fork",
        "roll-back-start",
    ]
    assert switched_to(job, "user-sessions")
    wait_for(lambda: user_events(job) == sent, 180, 0.5, "version 1 to count every event after the rollback")

    # An incompatible version, chosen with empty state: it reads on from where version 1 stopped, from nothing.
    regional = action_request(
        job=job, kind=ActionKind.UPGRADE, params={"pipeline": "user-sessions-by-region", "empty_state": 1}
    )
    wait_for(lambda: switched_to(job, "user-sessions-by-region"), 300, 0.5, "the switch with empty state")
    after = send(redis, stream_name, 30, seed=6)
    regional = finished(regional)
    assert regional.status == ActionStatus.SUCCEEDED, regional.outcome
    assert "started with empty state (0 transformWithStateInPySparkExec)" in regional.outcome
    wait_for(lambda: region_events(job) == after, 180, 0.5, "the regions to count only what came after the switch")
    assert user_events(job) == sent, "version 1's results stay as they were"
    sent += after

    # Its way back: version 1 from the savepoint, which replays what the regional version read.
    back = finished(action_request(job=job, kind=ActionKind.UPGRADE_ROLLBACK, params={"upgrade": regional.id}))
    assert back.status == ActionStatus.SUCCEEDED, back.outcome
    assert Job.objects.get(id=job.id).start_offset is None
    wait_for(lambda: user_events(job) == sent, 180, 0.5, "version 1 to count every event again")
    job_request_stop(job=job)
    wait_for(lambda: not job.runs.filter(status__in=["running", "stopping"]).exists(), 120, 0.5, "the stop")
    assert user_events(job) == sent, "every event counted exactly once by version 1 across every switch"


@pytest.mark.django_db
def test_each_upgrade_button_requests_its_action(as_role, make_job):
    job = make_job(name="sessions", pipeline="user-sessions", state_backend="rocksdb")
    client = as_role("operator")
    for step, kind, extra in (
        ("preview", ActionKind.UPGRADE_PREVIEW, {}),
        ("shadow", ActionKind.UPGRADE_SHADOW, {"records": 300}),
        ("upgrade", ActionKind.UPGRADE, {"empty_state": 1}),
    ):
        client.post(f"/jobs/{job.name}/upgrade", {"pipeline": "user-sessions-v2", "step": step, **extra})
        action = Action.objects.get(job=job, kind=kind)
        assert action.params == {"pipeline": "user-sessions-v2", "parameters": {}, **extra}
        Action.objects.filter(id=action.id).update(status=ActionStatus.FAILED)  # one action at a time per job
    refused = client.post(f"/jobs/{job.name}/upgrade", {"pipeline": "no-such", "step": "preview"}, follow=True)
    assert "There is no registered pipeline &#x27;no-such&#x27;" in refused.content.decode()
    assert not Action.objects.filter(params__pipeline="no-such").exists()


@pytest.mark.django_db
def test_an_upgrade_takes_a_fresh_preview_of_the_same_change_as_its_plan_and_nothing_else(make_job):
    job = make_job(name="sessions", pipeline="user-sessions", state_backend="rocksdb")
    asked = {"pipeline": "user-sessions-v2", "parameters": {}, "from_parameters": {}}
    plan = {"target": "user-sessions-v2", "batch": 4, "verdicts": [], "incompatible": False, "summary": "fine",
            "code": plan_code("user-sessions", "user-sessions-v2")}  # fmt: skip
    preview = Action.objects.create(job=job, kind=ActionKind.UPGRADE_PREVIEW, status=ActionStatus.SUCCEEDED,
                                    finished_at=timezone.now(), params=asked | {"plan": plan})  # fmt: skip

    def upgrade(**changed) -> Action:  # the one action in flight on the job
        Action.objects.filter(job=job, kind=ActionKind.UPGRADE).delete()
        return Action.objects.create(job=job, kind=ActionKind.UPGRADE, params=asked | changed)

    assert fresh_preview(upgrade(), "user-sessions-v2") == preview
    assert fresh_preview(upgrade(), "user-sessions-by-region") is None, "another target"
    assert fresh_preview(upgrade(parameters={"x": 1}), "user-sessions-v2") is None, "other parameter values"
    assert fresh_preview(upgrade(migrate=1), "user-sessions-v2") is None, "a migration plans its own run"

    stale = plan | {"code": {**plan["code"], "to_code": "an older hash"}}
    Action.objects.filter(id=preview.id).update(params=asked | {"plan": stale})
    assert fresh_preview(upgrade(), "user-sessions-v2") is None, "the target's code changed on disk since"
    Action.objects.filter(id=preview.id).update(params=asked | {"plan": plan})

    Action.objects.create(job=job, kind=ActionKind.RESCALE, status=ActionStatus.SUCCEEDED)
    assert fresh_preview(upgrade(), "user-sessions-v2") is None, "the state was repartitioned since"
    Action.objects.filter(job=job, kind=ActionKind.RESCALE).update(status=ActionStatus.FAILED)
    assert fresh_preview(upgrade(), "user-sessions-v2") == preview, "a failed rescale changed nothing"

    Action.objects.filter(id=preview.id).update(finished_at=timezone.now() - timedelta(seconds=PLAN_KEPT_SECONDS + 1))
    assert fresh_preview(upgrade(), "user-sessions-v2") is None, "too old"


@pytest.mark.django_db
def test_a_preview_shows_sparks_verdict_as_it_plans_then_the_batchs_proof(make_job, monkeypatch, as_role):
    """The reader writes a plan's verdict as Spark plans the re-run batch (its schemas are final then), before the
    batch runs: the preview shows it at once, and the sentence with the batch's rows once its answer comes."""
    job = make_job(name="sessions", pipeline="user-sessions", state_backend="rocksdb")
    action = Action.objects.create(
        job=job, kind=ActionKind.UPGRADE_PREVIEW, status=ActionStatus.RUNNING, step="plan",
        params={"pipeline": "user-sessions-v2", "parameters": {}, "from_parameters": {}},
        memo={"plan_batch": 7, "plan": {"spool": True, "restarts": 0}},
        phases=[{"step": "plan", "label": "re-run a batch with the new version", "started": timezone.now().isoformat()}],
    )  # fmt: skip
    monkeypatch.setattr(state_reader_client, "state_reader_pid", lambda: 4242)  # a reader has the request in hand
    wider = schema(events="long", amount="double", largest="double")
    schemas = {"before": [operator(schema(user="string"), V1)], "after": [operator(schema(user="string"), wider)]}
    spool = state_reader_client._spool_file("plan", action, "verdict")
    spool.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    spool.write_text(json.dumps(schemas | {"seconds": {"before": 0.3, "planned": 1.1, "read": 0.2}}))

    assert isinstance(upgrades._plan(action), Wait), "the batch still runs: the step waits for its answer"
    early = Action.objects.get(id=action.id).params["plan"]
    assert early["proven"] is False and [v["verdict"] for v in early["verdicts"]] == [EVOLVES]
    assert early["summary"].endswith("as Spark planned the replayed batch; its run on the copy is not over yet.")
    page = as_role("viewer").get(f"/jobs/{job.name}/deploys").content.decode()
    assert "its run on the copy is not over yet" in page and "added largest" in page, "shown while it runs"

    spool.with_suffix(".answer").write_text(json.dumps(schemas | {"output_rows": 12, "seconds": {"ran": 2.4}}))
    action.refresh_from_db()
    assert upgrades._plan(action) == Next("gate")
    plan = Action.objects.get(id=action.id).params["plan"]
    assert plan["proven"] is True and plan["summary"].endswith("the replayed batch produced 12 result rows.")
    assert plan["verdict_at"] == early["verdict_at"] <= plan["proven_at"], "the verdict's time is its first showing"
    assert not list(spool.parent.glob(f"action-{action.id}-*")), "both answers are gone once read"


def unproven_upgrade(job, run, savepoint_batch: int = 3) -> Action:
    """An upgrade that returned before its new run committed a batch (a quiet job), as the upgrade leaves it."""
    from dashboard.models import Savepoint

    savepoint = Savepoint.objects.create(job=job, status="verified", batch_id=savepoint_batch)
    return Action.objects.create(
        job=job, kind=ActionKind.UPGRADE, status=ActionStatus.SUCCEEDED, finished_at=timezone.now(),
        params={"pipeline": "user-sessions-v2", "from_pipeline": "user-sessions", "run": run.id,
                "savepoint": savepoint.id, "proof": {"state": "unproven"}},
    )  # fmt: skip


@pytest.mark.django_db
def test_a_returned_upgrade_is_proven_by_its_first_batch_and_rolled_back_when_its_run_fails_before_it(make_job):
    from dashboard.models import Checkpoint, Run
    from dashboard.services.upgrade_watch import upgrades_watch

    job = make_job(pipeline="user-sessions-v2", state_backend="rocksdb")
    run = Run.objects.create(job=job, status=RunStatus.RUNNING)
    upgrade = unproven_upgrade(job, run)
    assert upgrades_watch() == [], "running, nothing committed yet: still unproven"
    replayed = Checkpoint.objects.create(job=job, run=run, batch_id=3, committed_at=timezone.now(), duration_ms=1)
    assert upgrades_watch() == [], "the savepoint's own batch proves nothing"
    replayed.batch_id = 4
    replayed.save()
    assert upgrades_watch() == [f"upgrade {upgrade.id} proven at batch 4"]
    upgrade.refresh_from_db()
    assert upgrade.proof["state"] == "proven" and upgrade.proof_text == "proven: its first batch (4) committed"

    # the next one fails before its first batch: an automatic "Roll back the upgrade", once
    Run.objects.filter(id=run.id).update(status=RunStatus.STOPPED)
    failing = Run.objects.create(job=job, status=RunStatus.FAILED, message="ValueError: a bug in version 2")
    upgrade = unproven_upgrade(job, failing)
    notes = upgrades_watch()
    back = Action.objects.get(job=job, kind=ActionKind.UPGRADE_ROLLBACK)
    assert notes == [f"upgrade {upgrade.id} failed before its first batch: rollback #{back.id}"]
    assert back.origin == "upgrade-watch" and back.params == {
        "upgrade": upgrade.id, "automatic": True, "cause": "ValueError: a bug in version 2"
    }  # fmt: skip
    upgrade.refresh_from_db()
    assert upgrade.proof_text == f"failed after it returned (ValueError: a bug in version 2); rolled back by #{back.id}"
    assert upgrades_watch() == [], "rolled back once"

    # stopped by its operator before any batch: the watch ends without a rollback
    Action.objects.filter(id=back.id).update(status=ActionStatus.SUCCEEDED)
    stopped = Run.objects.create(job=job, status=RunStatus.STOPPED, stop_requested_at=timezone.now())
    upgrade = unproven_upgrade(job, stopped)
    upgrades_watch()
    upgrade.refresh_from_db()
    assert upgrade.proof["state"] == "stopped"
    assert Action.objects.filter(kind=ActionKind.UPGRADE_ROLLBACK).count() == 1


@pytest.mark.django_db
def test_the_rollback_of_a_failed_new_version_waits_while_another_action_holds_the_job(make_job):
    from dashboard.models import Run
    from dashboard.services.upgrade_watch import upgrades_watch

    job = make_job(pipeline="user-sessions-v2", state_backend="rocksdb")
    failing = Run.objects.create(job=job, status=RunStatus.LOST, message="The driver process exited without reporting.")
    upgrade = unproven_upgrade(job, failing)
    busy = action_request(job=job, kind=ActionKind.SAVEPOINT)
    notes = upgrades_watch()
    assert len(notes) == 1 and notes[0].startswith(f"upgrade {upgrade.id} failed; its rollback waits")
    Action.objects.filter(id=busy.id).update(status=ActionStatus.FAILED)
    assert upgrades_watch()[0].startswith(f"upgrade {upgrade.id} failed before its first batch: rollback #")


@pytest.mark.django_db
def test_a_transform_with_state_version_needs_rocksdb_of_either_kind(make_job):
    from dashboard.services.upgrade_parts import upgrade_refusal

    memory = make_job(pipeline="order-state-machine-v2", state_backend="memory")
    assert "needs the RocksDB backend" in upgrade_refusal(memory, "order-state-machine")
    for backend in ("rocksdb", "rocksdb-incremental"):
        assert (
            upgrade_refusal(make_job(pipeline="order-state-machine-v2", state_backend=backend), "order-state-machine")
            == ""
        )


@pytest.mark.django_db
def test_the_deploys_page_and_the_api_refuse_the_same_upgrade_requests_and_request_nothing(
    client, make_job, as_role, django_user_model
):
    """One set of rules for an upgrade request (``upgrade_parts.upgrade_request``): what the API refuses, the Deploys
    tab refuses too, with a sentence, and neither requests an action."""
    from django.contrib.messages import get_messages

    from dashboard.api.tokens import token_create

    make_job(name="spend", pipeline="customer-spend")
    as_role("operator", "op")
    bearer = "Bearer " + token_create(user=django_user_model.objects.get(username="op"), name="ci")[1]
    cases = [  # (the form's step, its fields; the API's verb, its body)
        ("upgrade", {"pipeline": "customer-spend-daily", "migrate": "1", "empty_state": "1"},
         "upgrade", {"pipeline": "customer-spend-daily", "migrate": 1, "empty_state": 1}),
        ("blue-green", {"pipeline": "customer-spend", "max_changed_percent": "150", "parameters": "threshold=5"},
         "blue-green", {"pipeline": "customer-spend", "max_changed_percent": 150, "parameters": {"threshold": 5}}),
        ("shadow", {"pipeline": "customer-spend-v2", "records": "200001"},
         "upgrade-shadow", {"pipeline": "customer-spend-v2", "records": 200_001}),
        ("preview", {"pipeline": "no-such-pipeline"}, "upgrade-preview", {"pipeline": "no-such-pipeline"}),
        ("upgrade", {"pipeline": "customer-spend"}, "upgrade", {"pipeline": "customer-spend"}),
    ]  # fmt: skip
    for step, form, verb, body in cases:
        answer = client.post("/jobs/spend/upgrade", form | {"step": step}, follow=True)
        shown = [str(m) for m in get_messages(answer.wsgi_request)]
        assert answer.redirect_chain[-1][0] == "/jobs/spend/deploys" and len(shown) == 1, (step, form, shown)
        api = client.post(f"/api/v1/jobs/spend/{verb}", json.dumps(body), content_type="application/json",
                          HTTP_AUTHORIZATION=bearer)  # fmt: skip
        assert api.status_code in (400, 409), (verb, body, api.status_code, api.content[:300])
        assert api.json()["error"], (verb, body)
    assert not Action.objects.filter(job__name="spend").exists(), "nothing was requested"
