"""Context parallelism at cluster scale: DP x CP groups, one long row per micro-batch.

A CP group of N GPUs trains each row together: every rank owns NB / N query blocks of
it (the split), all-gathers K/V per layer, attends its blocks against the whole row,
and reduce-scatters dK/dV (sb_titan.context_parallel). Per micro-batch the group waits
for its slowest rank at every layer, so its time is

    max_r attention_r + linear(L / N) + K/V communication

attention_r = the kept block pairs of rank r's query blocks x the cost model's seconds
per block pair (the same model prices every layer, so the per-layer maxima add up to
one maximum), linear = the cost model's token-linear part of L / N tokens (the same on
every rank). A DP rank runs its micro-batches in turn; the step waits for the slowest
DP rank, then reduces gradients over all DP x CP ranks.

Variants (each on the same rows, packed by the trainer's planner, policy `sequential`):
dense attention on the zigzag split and on the balanced split (the trainer's sparse-aware
split, `document_split`); sparse attention (the
cost model's density at the budget) on zigzag and on the balanced split. The kept pairs
a variant is timed with are the predicted ones, `predicted_block_pairs` under the cost
model's density model: the balanced split is timed on the numbers it was built from.
How far real tables stray from that prediction is measured on CPU by
bench/context_parallel.py.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from sb_titan.attention.layout import doc_ids_from_lengths
from sb_titan.balance.cost_model import (
    CostModel,
    DensityModel,
    analytic_stage_spec,
    block_pairs,
)
from sb_titan.balance.dst import DSTConfig
from sb_titan.balance.sab import SABConfig, StepPlan
from sb_titan.context_parallel.split import (
    allowed_blocks,
    check_divisible,
    document_split,
    imbalance,
    predicted_block_pairs,
    rank_loads,
    zigzag_split,
)
from sb_titan.models.dims import ModelDims
from sb_titan.simulator.cluster import Cluster, Network, model_dims_of
from sb_titan.simulator.run import draw_lengths
from sb_titan.simulator.stages import stage_param_count
from sb_titan.simulator.step import make_balancer

CP_VARIANTS = ("dense_zigzag", "dense_balanced", "sparse_zigzag", "sparse_balanced")


@dataclass(frozen=True, slots=True)
class CPCluster:
    cp: int  # GPUs per CP group (one row at a time)
    dp: int  # CP groups
    microbatches: int  # rows per CP group and step
    seq_len: int

    @property
    def gpus(self) -> int:
        return self.cp * self.dp


@dataclass(frozen=True, slots=True)
class CPScenario:
    family: str = "qwen2_5"
    flavor: str = "3b"
    dims: ModelDims | None = None  # a train config's (Scenario.dims); None: the flavor's
    device: str = "h200"
    budget: float = 0.9  # sparse variants' `mass` budget (DST's beta0)
    block_size: int = 64
    density_exponent: float = 1.0  # the density model's prior rho = beta**k
    steps: int = 2
    seed: int = 0
    network: Network = dataclasses.field(default_factory=Network)


class CPPricing:
    """The cost model's prices for one GPU holding the whole model (no PP)."""

    def __init__(self, sc: CPScenario) -> None:
        self.dims = sc.dims if sc.dims is not None else model_dims_of(sc.family, sc.flavor)
        spec = analytic_stage_spec(self.dims, self.dims.n_layers, True, sc.device, sc.block_size)
        density = DensityModel(prior_exponent=sc.density_exponent)
        self.cost_model = CostModel.analytic(spec, density_model=density)
        prof = self.cost_model.profile
        last = len(prof.lengths) - 1
        pairs = float(block_pairs(np.array([prof.lengths[last]]), sc.block_size)[0])
        # analytic attention is linear in pairs x density: any entry gives the price
        self.pair_s = prof.attn_seconds[last][-1] / (pairs * prof.densities[-1])
        self.block_size = sc.block_size

    def linear_s(self, tokens: float) -> float:
        """Overhead + token-linear seconds (projections, MLP, head) of `tokens`."""
        prof = self.cost_model.profile
        return prof.overhead_seconds + float(
            np.interp(tokens, prof.linear_tokens, prof.linear_seconds)
        )

    def density(self, beta: float):
        """lengths -> the cost model's density of `mass` documents at beta."""
        return functools.partial(self.cost_model.densities, beta, policy="mass")


def row_costs(doc_lens: list[int], seq_len: int, pricing: CPPricing, beta: float):
    """([NB] dense pairs, [NB] predicted sparse pairs, [NB] document) per query block
    of one row."""
    doc_id = doc_ids_from_lengths([doc_lens], seq_len)
    allowed = allowed_blocks(doc_id, pricing.block_size)
    sparse = predicted_block_pairs(allowed, pricing.density(beta), pricing.block_size)
    documents = doc_id[0, :: pricing.block_size].numpy()
    return allowed[0].astype(np.float64), sparse[0], documents


def microbatch_seconds(
    cost: np.ndarray,
    documents: np.ndarray,
    split_name: str,
    cluster: CPCluster,
    pricing: CPPricing,
) -> tuple[float, float, float]:
    """(attention of the slowest rank, CP imbalance, predicted pairs of that rank)."""
    bs = pricing.block_size
    if split_name == "zigzag":
        split = zigzag_split(1, cluster.seq_len, cluster.cp, bs)
    else:  # the trainer's sparse-aware split
        split = document_split(cost[None], documents[None], cluster.cp, bs)
    loads = rank_loads(cost[None], split)[0]
    return float(loads.max() * pricing.pair_s), imbalance(loads), float(loads.max())


def step_variants(
    plan: StepPlan, cluster: CPCluster, pricing: CPPricing, budget: float, row_rest_s: float
) -> dict[str, dict[str, float]]:
    """One step of every variant: per DP rank the sum over its rows of the slowest CP
    rank's attention + `row_rest_s` (linear + communication), the slowest DP rank."""
    per_rank: dict[str, list[float]] = {v: [] for v in CP_VARIANTS}
    stats: dict[str, list[tuple[float, float]]] = {v: [] for v in CP_VARIANTS}
    tokens = 0
    for rank in plan.microbatches:
        totals = dict.fromkeys(CP_VARIANTS, 0.0)
        for mb in rank:
            tokens += mb.num_tokens
            dense, sparse, documents = row_costs(mb.doc_lens, cluster.seq_len, pricing, budget)
            for v in CP_VARIANTS:
                kind, split = v.split("_")
                cost = dense if kind == "dense" else sparse
                attn, imb, _ = microbatch_seconds(cost, documents, split, cluster, pricing)
                totals[v] += attn + row_rest_s
                stats[v].append((attn, imb))
        for v in CP_VARIANTS:
            per_rank[v].append(totals[v])
    out = {}
    for v in CP_VARIANTS:
        attn, imb = np.asarray(stats[v]).T
        out[v] = {
            "step_s": max(per_rank[v]),
            "attention_s": float(attn.mean()),
            "cp_imbalance": float(imb.mean()),
            "cp_imbalance_worst": float(imb.max()),
            "tokens": tokens,
        }
    return out


def summarise(steps: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Means over steps per variant; speedups are step-time ratios (same rows)."""
    base = np.mean([s["step_s"] for s in steps["dense_zigzag"]])
    variants = {}
    for v, rs in steps.items():
        step = float(np.mean([r["step_s"] for r in rs]))
        variants[v] = {
            "step_time_s": step,
            "speedup_vs_dense_zigzag": float(base / step),
            "attention_s_per_microbatch": float(np.mean([r["attention_s"] for r in rs])),
            "cp_imbalance_max_over_mean": float(np.mean([r["cp_imbalance"] for r in rs])),
            "cp_imbalance_worst": float(max(r["cp_imbalance_worst"] for r in rs)),
            "tokens_per_s": float(sum(r["tokens"] for r in rs) / sum(r["step_s"] for r in rs)),
        }
    return variants


def simulate_cp(cluster: CPCluster, sc: CPScenario) -> dict[str, Any]:
    """Mean step time per variant over sc.steps steps, and the assumptions behind it."""
    check_divisible(cluster.seq_len, cluster.cp, sc.block_size)
    pricing = CPPricing(sc)
    dims, net = pricing.dims, sc.network
    packing = Cluster(dp=cluster.dp, pp=1, microbatches=cluster.microbatches,
                      seq_len=cluster.seq_len)  # fmt: skip
    lengths = draw_lengths(packing, sc.steps, sc.seed)
    dst = DSTConfig(beta0=sc.budget, enabled=False)
    balancer = make_balancer(
        lengths, packing, SABConfig(seed=sc.seed), "sequential", pricing.cost_model, dst
    )
    linear = pricing.linear_s(cluster.seq_len / cluster.cp)
    kv = (cluster.seq_len, dims.n_kv_heads, dims.head_dim, dims.n_layers, cluster.cp)
    comm = net.cp_seconds(*kv)
    params = stage_param_count(dims, dims.n_layers, True, True)
    reduce_s = net.allreduce_seconds(params, cluster.gpus)
    steps: dict[str, list[dict[str, float]]] = {v: [] for v in CP_VARIANTS}
    for _ in range(sc.steps):
        step = step_variants(balancer.next_step().plan, cluster, pricing, sc.budget, linear + comm)
        for v, r in step.items():
            steps[v].append({**r, "step_s": r["step_s"] + reduce_s})
    full_row = np.array([float(cluster.seq_len)])
    return {
        "format": "sb_titan.simulate_cp",
        "setup": {
            **dataclasses.asdict(cluster),
            "gpus": cluster.gpus,
            "family": pricing.dims.family,
            "flavor": sc.flavor,
            "budget": sc.budget,
            "steps": sc.steps,
            "seed": sc.seed,
            "block_size": sc.block_size,
        },
        "assumptions": {
            "device": sc.device,
            "pair_seconds": pricing.pair_s,
            "linear_seconds_per_microbatch": linear,
            "cp_comm_bytes_per_microbatch": net.cp_bytes(*kv),
            "cp_comm_seconds_per_microbatch": comm,
            "cp_comm_overlapped": False,
            "gradient_reduce_seconds": reduce_s,
            "density_prior_exponent": sc.density_exponent,
            "density_at_budget_full_row": float(pricing.density(sc.budget)(full_row)[0]),
            "network": dataclasses.asdict(net),
            "packing": "sab.Planner policy sequential (the trainer's loader)",
            "data": f"longtail-v1 (R={cluster.seq_len}, seed={sc.seed})",
        },
        "variants": summarise(steps),
    }


def format_cp_table(rep: dict[str, Any]) -> str:
    lines = [
        "| variant | step s | speedup vs dense zigzag | attention s / row (slowest rank) "
        "| CP imbalance (mean / worst row) | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for v, r in rep["variants"].items():
        lines.append(
            f"| {v} | {r['step_time_s']:.2f} | {r['speedup_vs_dense_zigzag']:.2f}x | "
            f"{r['attention_s_per_microbatch']:.2f} | {r['cp_imbalance_max_over_mean']:.3f} / "
            f"{r['cp_imbalance_worst']:.3f} | {r['tokens_per_s']:,.0f} |"
        )
    return "\n".join(lines)
