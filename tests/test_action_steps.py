"""What an action's steps hand each other is declared: the steps a step may go on to exist in its table, and the
values it leaves (memo, params) have names and types its kind declares."""

from __future__ import annotations

import pytest

from dashboard.models import Action, ActionKind, ActionStatus
from dashboard.services.action_keys import memo_save, remember
from dashboard.services.action_steps import Next, branch_targets, check_steps
from dashboard.services.actions import KEYS, STEPS
from dashboard.services.run_waits import stop_step


def _gate(action):
    return Next("savepoint" if action.params.get("state") else "swtich")


def test_a_step_that_may_go_on_to_a_step_its_table_lacks_is_refused_naming_both():
    assert branch_targets(_gate) == {"savepoint", "swtich"}, "both branches of the conditional"
    assert branch_targets(stop_step(then="savepoint")[1]) == {"savepoint"}, "a factory's bound target"
    table = {"gate": ("verdict", _gate), "savepoint": ("savepoint", _gate), "switch": ("switch", _gate)}
    with pytest.raises(ValueError, match="upgrade: step 'gate' may go on to 'swtich', which it lacks"):
        check_steps("upgrade", table)
    upgrade = STEPS[ActionKind.UPGRADE]
    assert branch_targets(upgrade["stop"][1]) == {"savepoint", "switch"}
    for kind, steps in STEPS.items():
        check_steps(kind, steps)  # what the engine checks as it starts


@pytest.mark.django_db
def test_a_value_a_step_leaves_is_refused_unless_declared_with_its_type(make_job):
    action = Action.objects.create(job=make_job(), kind=ActionKind.UPGRADE, params={"pipeline": "url-counts"})
    with pytest.raises(TypeError, match="memo key 'plan_bacth' is not declared for a upgrade"):
        memo_save(action, plan_bacth=4)
    with pytest.raises(TypeError, match="memo key 'plan_batch' of a upgrade holds str, not int"):
        memo_save(action, plan_batch="4")
    with pytest.raises(TypeError, match="params key 'was_running' of a upgrade holds int, not bool"):
        remember(action, was_running=1)
    with pytest.raises(TypeError, match="params key 'run' of a upgrade holds bool, not int"):
        remember(action, run=True)
    action.refresh_from_db()
    assert action.memo == {} and action.params == {"pipeline": "url-counts"}, "nothing kept from a refused call"
    with pytest.raises(TypeError, match="memo key 'verify-12-proc' is not declared"):
        memo_save(action, **{"verify-12-proc": {}})
    memo_save(action, plan_batch=4, **{"plan-process": {"pid": 1}, "verify-12-process": {"pid": 2}})
    remember(action, savepoint=None, was_running=True)
    action.refresh_from_db()
    assert action.memo == {"plan_batch": 4, "plan-process": {"pid": 1}, "verify-12-process": {"pid": 2}}
    assert action.params == {"pipeline": "url-counts", "savepoint": None, "was_running": True}


@pytest.mark.django_db
def test_a_key_is_declared_for_the_kinds_that_keep_it_and_no_other(make_job):
    """Each kind declares its own keys: a rescale's keys are no savepoint's, and a blue/green's green run is not an
    upgrade's."""
    job = make_job()
    savepoint = Action.objects.create(job=job, kind=ActionKind.SAVEPOINT, status=ActionStatus.SUCCEEDED)
    with pytest.raises(TypeError, match="memo key 'stopped_batch' is not declared for a savepoint"):
        memo_save(savepoint, stopped_batch=3)
    remember(savepoint, savepoint=4)
    upgrade = Action.objects.create(job=job, kind=ActionKind.UPGRADE, status=ActionStatus.SUCCEEDED)
    with pytest.raises(TypeError, match="params key 'green_run' is not declared for a upgrade"):
        remember(upgrade, green_run=7)
    green = Action.objects.create(job=job, kind=ActionKind.BLUE_GREEN, status=ActionStatus.SUCCEEDED)
    remember(green, green_run=7)
    with pytest.raises(TypeError, match="params key 'green_run' of a blue-green holds str, not int"):
        remember(green, green_run="7")
    with pytest.raises(TypeError, match="keys declared twice with two types: run"):
        _ = KEYS[ActionKind.BLUE_GREEN] + type(KEYS[ActionKind.BLUE_GREEN])(params={"run": str})


def test_every_key_a_kinds_steps_write_is_declared_for_that_kind():
    """Read from the code: the keys each kind's steps (and what they call in dashboard/services) write with
    ``memo_save``, ``remember`` and ``start_once`` are declared for that kind, and every memo key a kind declares is
    written by one of its steps (a declaration is not left behind when its step goes)."""
    from dashboard.services.action_keys import TOOL_KEYS
    from tests.written_keys import written

    for kind, steps in STEPS.items():
        found = written([step for _, step in steps.values()])
        declared = KEYS[kind]
        assert not found.reads or set(TOOL_KEYS) <= declared.memo.keys(), f"{kind} reads with Spark: SPARK_READS"
        assert found.memo <= declared.memo.keys(), f"{kind}: memo keys written, undeclared"
        assert found.params <= declared.params.keys(), f"{kind}: params keys written, undeclared"
        kept = declared.memo.keys() - set(TOOL_KEYS)
        assert kept <= found.memo, f"{kind}: memo keys declared that no step writes: {sorted(kept - found.memo)}"
