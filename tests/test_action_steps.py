"""What an action's steps hand each other is declared: the steps a step may go on to exist in its table, and the
values it leaves (memo, params) have declared names and types."""

from __future__ import annotations

import pytest

from dashboard.models import Action, ActionKind
from dashboard.services.action_keys import memo_save, remember
from dashboard.services.action_steps import Next, branch_targets, check_steps
from dashboard.services.actions import STEPS
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
    with pytest.raises(TypeError, match="memo key 'plan_bacth' is not declared"):
        memo_save(action, plan_bacth=4)
    with pytest.raises(TypeError, match="memo key 'plan_batch' holds str, not int"):
        memo_save(action, plan_batch="4")
    with pytest.raises(TypeError, match="params key 'was_running' holds int, not bool"):
        remember(action, was_running=1)
    with pytest.raises(TypeError, match="params key 'run' holds bool, not int"):
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
