"""Lagged cost-model snapshots: which model plans which step, waiting, pruning, resume."""

from __future__ import annotations

import copy
import functools
import threading

import pytest

from sb_titan.balance.balancer import step_budgets
from sb_titan.balance.cost_model import CostModel, CostModelConfig
from sb_titan.balance.dst import DSTConfig
from sb_titan.balance.snapshots import CostModelSnapshots, PlanningCancelled
from sb_titan.simulator import Cluster, Scenario, build_simulator, draw_lengths, make_balancer


@functools.cache
def _simulator():
    cluster = Cluster(dp=4, pp=2, microbatches=4)
    return cluster, build_simulator(cluster, Scenario(steps=2, seed=0))


def _model(attn_scale: float = 1.0) -> CostModel:
    """The simulator's analytic H200 model of Qwen2.5-3B (one stage), rescaled."""
    model = copy.deepcopy(_simulator()[1].models.planning)
    model.attn_scale = attn_scale
    return model


def test_step_t_is_planned_by_the_model_after_step_t_minus_lag():
    store = CostModelSnapshots(_model(1.0), lag=2)
    assert store.model_for(0).attn_scale == store.model_for(1).attn_scale == 1.0
    for trained in range(4):
        store.publish(trained, _model(2.0 + trained))
    assert [store.model_for(t).attn_scale for t in (4, 5)] == [4.0, 5.0]


def test_publish_copies_the_model():
    live = _model(1.0)
    store = CostModelSnapshots(live, lag=1)
    store.publish(0, live)
    live.attn_scale = 9.0  # the trainer keeps refitting its own model
    assert store.model_for(1).attn_scale == 1.0


def test_a_planner_waits_for_the_snapshot_it_needs():
    store = CostModelSnapshots(_model(), lag=2)
    got = []
    planner = threading.Thread(target=lambda: got.append(store.model_for(3).attn_scale))
    planner.start()
    store.publish(0, _model(7.0))
    planner.join(0.3)
    assert planner.is_alive() and not got  # step 3 needs the model after step 1
    store.publish(1, _model(8.0))
    planner.join(10)
    assert got == [8.0]


@pytest.mark.parametrize("how", ["close", "cancel"])
def test_a_waiting_planner_can_be_called_off(how):
    store = CostModelSnapshots(_model(), lag=1)
    stop = threading.Event()
    errors = []

    def plan() -> None:
        try:
            store.model_for(5, cancelled=stop.is_set)
        except PlanningCancelled as e:
            errors.append(e)

    planner = threading.Thread(target=plan)
    planner.start()
    store.close() if how == "close" else stop.set()
    planner.join(10)
    assert not planner.is_alive() and len(errors) == 1


def test_only_the_snapshots_a_pending_step_needs_are_kept():
    store = CostModelSnapshots(_model(), lag=2)
    for trained in range(6):
        store.publish(trained, _model(float(trained)))
    # the next step to train is 6 (planned by step 4's model), then 7 (step 5's)
    assert sorted(int(s) for s in store.state_dict()["models"]) == [4, 5]
    with pytest.raises(RuntimeError, match="already dropped"):
        store.model_for(5)
    with pytest.raises(RuntimeError, match="once, in order"):
        store.publish(5, _model())


def test_state_round_trip_restores_pending_snapshots():
    store = CostModelSnapshots(_model(), lag=2)
    for trained in range(3):
        store.publish(trained, _model(1.0 + trained))
    restored = CostModelSnapshots(_model(), lag=2)
    restored.load_state_dict(store.state_dict())
    for step in (3, 4):
        assert restored.model_for(step).digest() == store.model_for(step).digest()
        assert store.rebuild(step).digest() == store.model_for(step).digest()
    with pytest.raises(ValueError, match="plan_lag = 2"):
        CostModelSnapshots(_model(), lag=3).load_state_dict(store.state_dict())
    old = CostModelSnapshots(_model(), lag=2)
    old.adopt(_model(5.0), trained_step=2)  # a checkpoint written without snapshots
    assert [old.model_for(t).attn_scale for t in (3, 4)] == [5.0, 5.0]


def test_plan_lag_must_be_positive():
    with pytest.raises(ValueError, match="plan_lag"):
        CostModelConfig(plan_lag=0)
    with pytest.raises(ValueError, match="plan_lag"):
        CostModelSnapshots(_model(), lag=0)


def test_budgets_from_a_rebuilt_snapshot_equal_the_original():
    """What resume relies on: the serialized snapshot decides the same budgets."""
    cluster = _simulator()[0]
    live = _model()
    balancer = make_balancer(
        draw_lengths(cluster, 2, 0), cluster, Scenario().sab, "sab", live, DSTConfig(), "mass"
    )
    plan = balancer.next_step().plan
    store = CostModelSnapshots(live, lag=1)
    mbs = [mb for rank in plan.microbatches for mb in rank]
    live.refit([(mb.doc_lens, mb.densities, 1.7 * mb.predicted_s) for mb in mbs])
    store.publish(0, live)
    ahead, _ = step_budgets(plan, store.model_for(1), DSTConfig(), "mass", True)
    in_place, _ = step_budgets(plan, store.rebuild(1), DSTConfig(), "mass", True)
    first, _ = step_budgets(plan, store.model_for(0), DSTConfig(), "mass", True)
    assert ahead == in_place
    assert ahead != first  # the refit moved them
