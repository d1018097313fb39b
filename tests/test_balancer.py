"""The balance loop's one owner: `Balancer.next_step` / `observe` against the loop
written out with its parts (sab.Planner, dst.tune_budgets, the lagged snapshots) as
the trainer ran them before they had an owner, and the loader packing exactly what the
balancer decided."""

from __future__ import annotations

import copy
import dataclasses
import functools

import numpy as np
import pytest

from sb_titan.balance.balancer import Balancer
from sb_titan.balance.dst import DSTConfig, tune_budgets
from sb_titan.balance.measurements import StepMeasurements
from sb_titan.balance.sab import Planner, SABConfig, StepPlan
from sb_titan.balance.snapshots import CostModelSnapshots, PlanningCancelled
from sb_titan.balance.step_shape import StepShape
from sb_titan.data.longtail import longtail_v1
from sb_titan.simulator import Cluster, Scenario, build_simulator

SHAPE = StepShape(seq_len=4096, dp=2, microbatches=4, rows=1)
DST = DSTConfig(enabled=True, beta0=0.6)
SAB = SABConfig(policy="sab", seed=0, observe_lag=2)
STEPS, LAG = 5, 1


@functools.cache
def _cost_model():
    """The simulator's analytic H200 model of Qwen2.5-0.5B at 4k rows."""
    cluster = Cluster(dp=SHAPE.dp, pp=1, microbatches=SHAPE.microbatches, seq_len=4096)
    return build_simulator(cluster, Scenario(flavor="0.5b", steps=2)).models.planning


def _lengths() -> np.ndarray:
    return longtail_v1(2000, SHAPE.seq_len, 0)


def _measured(plan: StepPlan, budgets: list[list[float]], step: int) -> StepMeasurements:
    """A step measured 30% slower than the analytic model, density and recall by step."""
    keys = [(dp, mb) for dp, rank in enumerate(plan.microbatches) for mb in range(len(rank))]
    mbs = {k: plan.microbatches[k[0]][k[1]] for k in keys}
    seconds = {k: 1.3 * mbs[k].predicted_s for k in keys}
    density = {k: 0.3 + 0.1 * ((k[1] + step) % 4) for k in keys}
    recall = {k: (0.9 * mbs[k].num_tokens, float(mbs[k].num_tokens)) for k in keys}
    return StepMeasurements(seconds, {}, max(seconds.values()), density, recall, budgets)


def _prior(model):
    return lambda n: model.density_for_budget(DST.beta0, n, "mass")


def _by_hand(steps: int, sab: SABConfig) -> list[tuple[list, list[list[float]], str]]:
    """The loop as the loader and trainer ran it with the parts: plan step t with the
    snapshot after step t - LAG (cost = model.predict, prior at beta0), DST per DP
    rank, then refit, density and recall models, planner.observe, publish."""
    model = copy.deepcopy(_cost_model())
    store = CostModelSnapshots(model, LAG)
    first = store.model_for(0)
    planner = Planner(
        _lengths(),
        seq_len=SHAPE.seq_len,
        dp=SHAPE.dp,
        microbatches=SHAPE.microbatches,
        rows_per_microbatch=SHAPE.rows,
        config=sab,
        cost_fn=first.predict,
        density_prior=_prior(first),
    )
    out = []
    for _ in range(steps):
        snapshot = store.model_for(planner.state.step)
        planner.price_with(snapshot.predict, _prior(snapshot))
        plan = planner.next_step()
        units = [[mb.doc_lens for mb in rank] for rank in plan.microbatches]
        decision = tune_budgets(units, snapshot, DST, "mass")
        budgets = [[b] * len(r) for b, r in zip(decision.budgets, plan.microbatches, strict=True)]
        out.append((plan.microbatches, budgets, snapshot.digest()))
        m = _measured(plan, budgets, plan.step)
        model.refit(m.observations(plan))
        model.density_model.update(m.density_observations(plan))
        recall = model.recall_model
        recall.update(m.recall_observations(plan, recall.block_size, recall.measure))
        planner.observe(*m.sample_densities(plan), step=plan.step)
        store.publish(plan.step, model)
    return out


def _balancer(sab: SABConfig = SAB, **kw) -> Balancer:
    kw = {"plan_lag": LAG, **kw}
    return Balancer(_lengths(), SHAPE, sab, copy.deepcopy(_cost_model()), DST, **kw)


@pytest.mark.parametrize("policy", ["sab", "sequential"])
def test_next_step_and_observe_are_the_loop_written_with_its_parts(policy):
    sab = dataclasses.replace(SAB, policy=policy)
    balancer, fixed = _balancer(sab), _balancer(sab, plan_lag=None)  # `fixed` never learns
    want = _by_hand(STEPS, sab)
    moved, lowered = 0, 0
    for t, (plan_mbs, budgets, digest) in enumerate(want):
        scheduled = balancer.next_step()
        assert scheduled.plan.step == t
        assert scheduled.plan.microbatches == plan_mbs
        assert scheduled.budgets == budgets
        assert scheduled.snapshot == f"{t - LAG}:{digest}"
        unlearnt = fixed.next_step()
        moved += (unlearnt.plan.microbatches, unlearnt.budgets) != (plan_mbs, budgets)
        lowered += scheduled.decision.n_lowered
        before = copy.deepcopy(balancer.cost_model)
        m = _measured(scheduled.plan, scheduled.budgets, t)
        predicted = balancer.observe(scheduled.plan, m)
        mbs = scheduled.plan.microbatches
        assert predicted == {  # the model as it stood before this step's refit
            (dp, mb): before.predict_budget(mbs[dp][mb].doc_lens, budgets[dp][mb], "mass")
            for dp, mb in m.seconds
        }
    assert moved > 0  # what the loop learnt changed its plans or budgets
    assert lowered > 0 or policy == "sab"  # DST acted (SAB's plans may leave it nothing)


def test_a_step_with_one_off_work_is_not_fitted():
    balancer = _balancer()
    scheduled = balancer.next_step()
    scale = balancer.cost_model.attn_scale
    balancer.observe(
        scheduled.plan, _measured(scheduled.plan, scheduled.budgets, 0), fit_latency=False
    )
    assert balancer.cost_model.attn_scale == scale
    scheduled = balancer.next_step()
    balancer.observe(scheduled.plan, _measured(scheduled.plan, scheduled.budgets, 1))
    assert balancer.cost_model.attn_scale != scale


def test_restored_balancer_plans_what_the_original_plans_next():
    """Resume: the trainer's checkpoint (model and snapshots), the loader's plan state
    and density observations give the same next steps."""
    a = _balancer(plan_lag=2)
    for t in range(3):
        s = a.next_step()
        a.observe(s.plan, _measured(s.plan, s.budgets, t))
    b = _balancer(plan_lag=2)
    assert b.load_state_dict(a.state_dict(), trained_step=2)
    b.load_plan_state(a.plan_state())
    b.load_observation_state(a.observation_state())
    for _ in range(2):
        x, y = a.next_step(), b.next_step()
        assert (x.plan, x.budgets, x.snapshot) == (y.plan, y.budgets, y.snapshot)
    b.verify(x)
    with pytest.raises(RuntimeError, match="differ from budgets decided in place"):
        b.verify(x._replace(budgets=[[0.5] * len(r) for r in x.budgets]))


def test_planning_ahead_waits_and_can_be_called_off():
    balancer = _balancer()
    balancer.next_step()  # step 0: the initial model
    with pytest.raises(PlanningCancelled):  # step 1 waits for the model after step 0
        balancer.next_step(cancelled=lambda: True)
    with pytest.raises(RuntimeError, match="fixed cost model"):
        b = _balancer(plan_lag=None)
        s = b.next_step()
        b.observe(s.plan, _measured(s.plan, s.budgets, 0))


def test_without_a_cost_model_budgets_are_beta0_and_pricing_is_given():
    sab = dataclasses.replace(SAB, policy="tokens")
    balancer = Balancer(_lengths(), SHAPE, sab, None, DST, cost_fn=lambda lens: float(sum(lens)))
    s = balancer.next_step()
    assert s.decision is None and s.snapshot == ""
    assert s.budgets == [[DST.beta0] * SHAPE.microbatches] * SHAPE.dp
    mb = s.plan.microbatches[0][0]
    assert mb.predicted_s == float(sum(mb.doc_lens))


def test_loader_packs_what_the_balancer_decided():
    from sb_titan.data.loader import SBDataLoader, build_source, pack_microbatch

    config = SBDataLoader.Config(synthetic_docs=200, prefetch_factor=1)
    source = build_source(config, 512)
    shape = StepShape(seq_len=512, dp=2, microbatches=2, rows=1)
    reference = Balancer(source.lengths, shape, SAB, None, DST).next_step()
    loader = SBDataLoader(
        config,
        dp_world_size=2,
        dp_rank=1,
        tokenizer=None,
        seq_len=512,
        local_batch_size=1,
        balancer=Balancer(source.lengths, shape, SAB, None, DST),
        source=source,
    )
    try:
        items = iter(loader)
        for mb in range(2):
            batch, labels = next(items)
            assert batch["scheduled"].plan == reference.plan and batch["microbatch"] == mb
            tokens, want_labels, positions = pack_microbatch(
                source, reference.plan.microbatches[1][mb], 512, 0
            )
            assert batch["input"].equal(tokens) and labels.equal(want_labels)
            assert batch["positions"].equal(positions)
    finally:
        loader.close()
    with pytest.raises(ValueError, match="the balancer plans steps of 2 DP ranks"):
        SBDataLoader(
            config,
            dp_world_size=4,
            dp_rank=0,
            tokenizer=None,
            seq_len=512,
            local_batch_size=1,
            balancer=Balancer(source.lengths, shape, SAB, None, DST),
        )
