"""sb-simulate: the schedule replay against closed forms, and the simulator's decisions
against the planner, DST and cost model called directly (no second implementation)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from conftest import REPO

from sb_titan.balance.dst import DSTConfig, tune_budgets
from sb_titan.balance.sab import Planner, SABConfig
from sb_titan.data.longtail import longtail_v1
from sb_titan.simulator import (
    VARIANTS,
    Cluster,
    Network,
    Scenario,
    build_simulator,
    make_balancer,
    simulate,
)
from sb_titan.simulator.replay import replay
from sb_titan.simulator.schedules import closed_form_step_s, schedule_orders
from sb_titan.simulator.stages import stage_split
from sb_titan.tools.simulate import main

NO_COMM = Network(p2p_latency_s=0.0, p2p_gbps=1e30, allreduce_latency_s=0.0, allreduce_gbps=1e30)


def _equal_replay(schedule: str, pp: int, m: int, t: float, virtual: int = 1) -> float:
    """Makespan of m equal micro-batches, fwd+bwd t per rank (B = 2F), zero latency."""
    orders = schedule_orders(schedule, pp, m, virtual)
    n = pp * virtual
    fwd = np.full((n, m, 1), t / 3 / virtual)
    tl = replay(orders, fwd, 2 * fwd, np.zeros((m, 1)))
    return float(tl.makespan[0])


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
@pytest.mark.parametrize(("pp", "m"), [(1, 8), (2, 4), (4, 8), (8, 8), (4, 3)])
def test_replay_matches_closed_form(schedule, pp, m):
    t = 1.5
    assert _equal_replay(schedule, pp, m, t) == pytest.approx((m + pp - 1) * t)
    assert closed_form_step_s(schedule, m, pp, t) == pytest.approx((m + pp - 1) * t)


@pytest.mark.parametrize(("pp", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 8, 3), (8, 8, 2)])
def test_interleaved_bubble_shrinks_by_virtual_stages(pp, m, v):
    t = 1.0
    interleaved = _equal_replay("Interleaved1F1B", pp, m, t, v)
    plain = _equal_replay("1F1B", pp, m, t)
    assert interleaved == pytest.approx((m + (pp - 1) / v) * t)
    assert (interleaved - m * t) == pytest.approx((plain - m * t) / v)  # bubble: (p-1)/v


def test_1f1b_order_warmup_and_dependencies():
    orders = schedule_orders("1F1B", 4, 8)
    for stage, order in enumerate(orders):
        warmup = next(i for i, a in enumerate(order) if a.kind == "B")
        assert warmup == min(8, 4 - stage)  # as torch's Schedule1F1B runs it
        assert [a.mb for a in order if a.kind == "F"] == list(range(8))
        assert [a.mb for a in order if a.kind == "B"] == list(range(8))


def test_replay_waits_for_the_slowest_microbatch_and_sends():
    """One slow micro-batch delays every later stage; a send adds latency per hop."""
    orders = schedule_orders("GPipe", 2, 2)
    fwd = np.ones((2, 2, 1))
    fwd[0, 0, 0] = 5.0
    tl = replay(orders, fwd, 2 * fwd, np.full((2, 1), 0.5))
    # stage 0: F0 [0,5], F1 [5,6]; stage 1: F0 [5.5,6.5], F1 [6.5,7.5], B0 [7.5,9.5],
    # B1 [9.5,11.5]; stage 0: B0 after 9.5 + 0.5 -> [10,20], B1 [20,22].
    assert tl.makespan[0] == pytest.approx(22.0)


def test_stage_split_is_torchtitans():
    split = stage_split(36, 4)
    assert split.layers == (9, 10, 9, 8) and sum(split.layers) == 36
    assert split.embedding == (True, False, False, False)
    assert split.head == (False, False, False, True)


def _small(pp: int, **kw) -> tuple[Cluster, Scenario]:
    cluster = Cluster(dp=2, pp=pp, microbatches=4, seq_len=4096)
    sc = Scenario(flavor="0.5b", steps=2, network=NO_COMM, **kw)
    return cluster, sc


@pytest.mark.parametrize("pp", [1, 2])
def test_decision_is_planner_plus_tune_budgets(pp):
    """The balancer's plans and budgets that the simulator replays are exactly what
    sab.Planner + dst.tune_budgets give when called directly."""
    cluster, sc = _small(pp)
    sim = build_simulator(cluster, sc)
    cm, dst = sim.models.planning, sc.dst
    lengths = longtail_v1(3000, cluster.seq_len, 0)
    lowered = 0
    for policy, variants in (("sequential", ("dst", "baseline")), ("sab", ("sab_dst", "sab"))):
        ours = {  # one balancer per variant, as simulate() runs them
            v: make_balancer(lengths, cluster, sc.sab, policy, cm, sim.dst_config(v), sc.selection)
            for v in variants
        }
        direct = Planner(
            lengths,
            seq_len=cluster.seq_len,
            dp=cluster.dp,
            microbatches=cluster.microbatches,
            rows_per_microbatch=1,
            config=SABConfig(policy=policy),
            cost_fn=cm.predict,
            density_prior=lambda n: cm.density_for_budget(dst.beta0, n, sc.selection),
        )
        for _ in range(2):
            want = direct.next_step()
            scheduled = {v: b.next_step() for v, b in ours.items()}
            for s in scheduled.values():
                assert s.plan.microbatches == want.microbatches
            if pp > 1:
                units = [[mb.doc_lens] for rank in want.microbatches for mb in rank]
            else:
                units = [[mb.doc_lens for mb in rank] for rank in want.microbatches]
            for variant, enabled in zip(variants, (True, False), strict=True):
                decision = tune_budgets(
                    units, cm, dataclasses.replace(dst, enabled=enabled), sc.selection
                )
                assert scheduled[variant].decision.digest() == decision.digest()
                assert sim.run_step(scheduled[variant], variant).budgets_digest == decision.digest()
                lowered += decision.n_lowered
    assert lowered > 0  # DST really acted somewhere


def test_sab_dst_balances_a_skewed_mix():
    cluster = Cluster(dp=4, pp=2, microbatches=4, seq_len=16384)
    rep, _ = simulate(cluster, Scenario(flavor="0.5b", steps=3))
    v = rep["variants"]
    assert v["sab_dst"]["imbalance_max_over_mean"] <= v["baseline"]["imbalance_max_over_mean"]
    assert (
        v["sab_dst"]["microbatch_imbalance_max_over_mean"]
        <= v["baseline"]["microbatch_imbalance_max_over_mean"]
    )
    assert v["baseline"]["microbatch_imbalance_max_over_mean"] > 1.2  # the mix is skewed
    assert v["sab_dst"]["mean_budget"] < DSTConfig().beta0 < v["baseline"]["mean_budget"] + 1e-12
    for r in v.values():
        assert r["step_time_s"] >= r["ideal_bound_s"] * (1 - 1e-9)


def test_recall_anchor_keeps_the_recall_proxy_the_mean_anchor_spends():
    cluster = Cluster(dp=4, pp=2, microbatches=4, seq_len=16384)
    by_anchor = {}
    for anchor in ("mean", "recall"):
        sc = Scenario(flavor="0.5b", steps=3, dst=DSTConfig(anchor=anchor))
        by_anchor[anchor] = simulate(cluster, sc)[0]["variants"]
    for anchor, v in by_anchor.items():  # same plans: dst vs baseline, sab_dst vs sab
        for tuned, static in (("dst", "baseline"), ("sab_dst", "sab")):
            kept = v[tuned]["mean_recall_proxy"] >= v[static]["mean_recall_proxy"] - 1e-9
            assert kept == (anchor == "recall"), (anchor, tuned, v[tuned], v[static])
            assert v[tuned]["step_time_s"] < v[static]["step_time_s"] * 1.01
    # Recall costs speed: the recall-neutral anchor is slower than the mean one, but it
    # still removes much of the padded plan's straggler time.
    mean, recall = by_anchor["mean"], by_anchor["recall"]
    for tuned in ("dst", "sab_dst"):
        assert recall[tuned]["step_time_s"] > mean[tuned]["step_time_s"]
    assert recall["dst"]["step_time_s"] < 0.97 * recall["baseline"]["step_time_s"]


def test_cli_json_keys_and_plot(tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["--flavor", "0.5b", "--dp", "2", "--pp", "2", "--microbatches", "4"]
    argv += ["--seq-len", "4096", "--steps", "1", "--quiet", "--json", str(out)]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(tmp_path / "sim.png")]
    except ImportError:
        pass
    assert main(argv) == 0
    rep = json.loads(out.read_text())
    assert set(rep["variants"]) == set(VARIANTS)
    keys = {
        "step_time_s",
        "speedup_vs_baseline",
        "bubble_share",
        "imbalance_max_over_mean",
        "ideal_bound_s",
        "mean_budget",
        "mean_recall_proxy",
    }
    for r in rep["variants"].values():
        assert keys <= set(r)
    assert rep["variants"]["baseline"]["speedup_vs_baseline"] == pytest.approx(1.0)
    # planning + DST run ahead, overlapped with the step before: only what exceeds the
    # step is added (a toy step of milliseconds on this CPU exceeds nothing, or little)
    base = rep["variants"]["baseline"]
    for r in rep["variants"].values():
        assert r["planning_s"] > 0 and r["dst_s"] > 0
        assert 0 <= r["control_s"] <= r["planning_s"] + r["dst_s"]
        with_control = (r["tokens_per_step"] / (r["step_time_s"] + r["control_s"])) / (
            base["tokens_per_step"] / (base["step_time_s"] + base["control_s"])
        )  # one step: the means are the step's values
        assert r["speedup_with_control_vs_baseline"] == pytest.approx(with_control)
    assert rep["setup"]["gpus"] == 4 and rep["assumptions"]["device"]["name"] == "h200"
    assert "baseline" in capsys.readouterr().out
    if "--plot" in argv:
        assert (tmp_path / "sim.png").stat().st_size > 0


def test_cli_with_a_profile_and_interleaved(tmp_path):
    """A measured profile replaces the analytic model (here: one saved from it)."""
    from sb_titan.balance.cost_model import analytic_profile
    from sb_titan.balance.cost_model import analytic_stage_spec as stage_spec
    from sb_titan.models.qwen2_5 import FLAVORS

    prof = tmp_path / "stage.json"
    analytic_profile(stage_spec(FLAVORS["0.5b"], 12, True, "h100", 64)).save(prof)
    out = tmp_path / "sim.json"
    argv = ["--flavor", "0.5b", "--dp", "2", "--pp", "2", "--microbatches", "4"]
    argv += ["--schedule", "Interleaved1F1B", "--profile", str(prof), "--seq-len", "4096"]
    assert main(argv + ["--steps", "1", "--quiet", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["assumptions"]["device"] is None
    assert str(prof) in rep["assumptions"]["cost_model"]
    assert rep["setup"]["virtual_stages"] == 2


# -- context parallelism (`--cp N`)


def test_cp_comm_volume_by_hand():
    """Qwen2.5-3B (2 kv heads x 128, 36 layers), 512K tokens, CP 8, bf16: per layer
    each rank receives 7/8 of K and of V (all-gather) and of dK and dV
    (reduce-scatter)."""
    from sb_titan.simulator.cluster import Network

    net = Network(cp_gbps=100.0, cp_latency_s=0.0)
    per_tensor = 2 * 128 * 524288 * 2 * 7 / 8  # Hkv x D x L x bytes x (N-1)/N
    assert net.cp_bytes(524288, 2, 128, 36, 8) == pytest.approx(4 * per_tensor * 36)
    assert net.cp_seconds(524288, 2, 128, 36, 8) == pytest.approx(4 * per_tensor * 36 / 100e9)
    assert net.cp_bytes(524288, 2, 128, 36, 1) == 0.0
    lat = Network(cp_latency_s=1e-3).cp_seconds(4096, 2, 128, 36, 4)
    assert lat >= 2 * 36 * 3 * 1e-3  # two ring collectives per layer, N - 1 hops each


def _cp(cp=4, dp=2, mbs=2, seq_len=16384, **kw):
    from sb_titan.simulator.context import CPCluster, CPScenario, simulate_cp

    return simulate_cp(CPCluster(cp, dp, mbs, seq_len), CPScenario(flavor="0.5b", **kw))


def test_cp_balanced_split_beats_zigzag_and_sparse_beats_dense():
    v = _cp(steps=2, budget=0.5, density_exponent=2.0)["variants"]
    for kind in ("dense", "sparse"):
        bal, zig = v[f"{kind}_balanced"], v[f"{kind}_zigzag"]
        assert bal["step_time_s"] <= zig["step_time_s"]
        assert bal["cp_imbalance_max_over_mean"] < zig["cp_imbalance_max_over_mean"]
        assert bal["cp_imbalance_worst"] <= 1.05
    assert v["dense_zigzag"]["cp_imbalance_max_over_mean"] > 1.2  # packed rows are skewed
    for split in ("zigzag", "balanced"):
        assert v[f"dense_{split}"]["step_time_s"] > v[f"sparse_{split}"]["step_time_s"]
    assert v["dense_zigzag"]["speedup_vs_dense_zigzag"] == pytest.approx(1.0)


def test_cp_step_of_single_document_rows_by_hand(monkeypatch):
    """Rows holding one document of R tokens: zigzag gives every rank the same causal
    pairs, c(2Nc + 1) with c = blocks per chunk, so the step is that times the analytic
    price of a block pair (14 b^2 D Hq layers FLOPs at the attention efficiency) plus
    the linear part, the K/V traffic per row, and the gradient reduction."""
    from sb_titan.balance.cost_model import ANALYTIC_DEVICES
    from sb_titan.models.qwen2_5 import FLAVORS
    from sb_titan.simulator import context

    R, N, b = 16384, 4, 64
    dims = FLAVORS["0.5b"]
    monkeypatch.setattr(context, "draw_lengths", lambda cluster, steps, seed: np.full(64, R))
    rep = _cp(cp=N, dp=2, mbs=2, seq_len=R, steps=1)
    h200 = ANALYTIC_DEVICES["h200"]
    pair_s = 14 * b * b * dims.head_dim * dims.n_heads * dims.n_layers
    pair_s /= h200["peak_flops"] * h200["attn_efficiency"]
    assert rep["assumptions"]["pair_seconds"] == pytest.approx(pair_s)
    c = R // b // (2 * N)
    a = rep["assumptions"]
    row = c * (2 * N * c + 1) * pair_s
    row += a["linear_seconds_per_microbatch"] + a["cp_comm_seconds_per_microbatch"]
    want = 2 * row + a["gradient_reduce_seconds"]
    v = rep["variants"]["dense_zigzag"]
    assert v["step_time_s"] == pytest.approx(want)
    assert v["cp_imbalance_worst"] == pytest.approx(1.0)


def test_cli_cp(tmp_path, capsys):
    out = tmp_path / "cp.json"
    argv = ["--flavor", "0.5b", "--cp", "4", "--dp", "2", "--microbatches", "2"]
    argv += ["--seq-len", "16384", "--steps", "1", "--quiet", "--json", str(out)]
    assert main(argv) == 0
    rep = json.loads(out.read_text())
    assert set(rep["variants"]) == {
        "dense_zigzag", "dense_balanced", "sparse_zigzag", "sparse_balanced"
    }  # fmt: skip
    assert rep["setup"]["gpus"] == 8 and rep["assumptions"]["cp_comm_overlapped"] is False
    assert "sparse_balanced" in capsys.readouterr().out
    assert main(argv[:-2] + ["--pp", "2"]) == 2
    assert main(["--flavor", "0.5b", "--cp", "3", "--dp", "1", "--seq-len", "16384"]) == 2


def test_the_simulator_prices_the_model_a_config_builds():
    """sb-simulate --config prices the config's family and size. Qwen3-4B (config.json:
    width 2560, 36 layers, 32 query and 8 KV heads of head_dim 128, SwiGLU 9728, vocabulary
    151936) has attention 4096 wide, not its width: Qwen2.5's rule hidden / heads = 80
    would price its projections and block pairs 37.5% lower. By hand, per stage: FLOPs
    6 x params per token, and 14 b^2 D Hq per block pair and layer."""
    from sb_titan.balance.cost_model import ANALYTIC_DEVICES
    from sb_titan.tools.simulate import _parser, _resolve

    config = REPO / "train_configs" / "qwen3_4b_128k.toml"
    args = ["--config", str(config), "--dp", "2", "--device", "h100", "--steps", "1"]
    cluster, sc = _resolve(_parser().parse_args(args))
    assert (sc.model.family, sc.model.head_dim, sc.model_name) == ("qwen3", 128, "qwen3 4b")
    h100 = ANALYTIC_DEVICES["h100"]
    per_layer = 2560 * 128 * (2 * 32 + 2 * 8) + 3 * 2560 * 9728
    pairs_128k = 1024 * 1025 // 2  # one document of 131072 tokens in blocks of 128
    split = stage_split(36, cluster.n_stages)
    for s, cost_model in enumerate(build_simulator(cluster, sc).models.stages):
        prof = cost_model.profile
        params = split.layers[s] * per_layer + (151936 * 2560 if split.head[s] else 0)
        gemm = h100["peak_flops"] * h100["gemm_efficiency"]
        assert prof.linear_seconds[0] == pytest.approx(6 * params * prof.linear_tokens[0] / gemm)
        pair = 14 * 128 * 128 * 128 * 32 * split.layers[s]
        assert (prof.lengths[-1], prof.densities[-1]) == (131072, 1.0)
        attn = pairs_128k * pair / (h100["peak_flops"] * h100["attn_efficiency"])
        assert prof.attn_seconds[-1][-1] == pytest.approx(attn)
    # a named size of another family: Llama 3.2-3B, not Qwen2.5-3B (24 heads, not 16)
    _, sc = _resolve(_parser().parse_args(["--family", "llama3", "--flavor", "3b", "--dp", "1"]))
    assert (sc.model.family, sc.model.n_heads, sc.model.vocab_size) == ("llama3", 24, 128256)
    with pytest.raises(ValueError, match=r"unknown qwen3 flavor '3b'"):
        _resolve(_parser().parse_args(["--family", "qwen3", "--flavor", "3b", "--dp", "1"]))
