"""Packing benchmark: predicted balance of each planner policy on the reference mix.

Setup (fixed, stated in the output): longtail-v1 (shared/REFERENCE_MIX.md) at R = 65536,
rows of R tokens, DP = 8 ranks x 8 micro-batches x 1 row, 50 steps, seed 0 (the mix
and the sample order). Cost model (analytic, sb_titan.balance.sab.AnalyticCost): micro-batch
latency = tokens + a·Σ len² with a = 1.5 / R, i.e. attention is 60% of the cost of a row
holding one R-token document; densities 1.0 (no observations).

Reported per policy, each a mean over steps: rank_imbalance (max/mean of the ranks'
summed micro-batch latency), microbatch_imbalance (max/mean over the step's 64
micro-batches), microbatch_bound (max(heaviest single piece, mean)/mean: no placement
of whole pieces can beat it), padding, and planning samples/s (best of 3 runs).
`concat-chunk` is not a policy: documents concatenated in data order and cut at row
boundaries (no padding), the model behind DESIGN.md's "sequential" figures.

A second table repeats the run with per-document densities (log-uniform in [0.1, 1],
seed 1) fed to the planners as observations made before step 0: with densities 1.0 cost
is a function of length alone, so this is where sparsity awareness can matter.

    python bench/packing.py   →  bench/results/packing.json
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import numpy as np

from sb_titan.balance.sab import POLICIES, AnalyticCost, Planner, SABConfig
from sb_titan.balance.step_shape import StepShape
from sb_titan.data.longtail import longtail_v1
from sb_titan.tools.plan import TIMING_REPEATS, evaluate, print_table

R = 65536
SHAPE = StepShape(seq_len=R, dp=8, microbatches=8, rows=1)
STEPS = 50
SEED = 0
DOCS = 50_000  # about 650 documents per step: one epoch covers all 50 steps
ATTENTION_SHARE = 0.6
OUT = Path(__file__).resolve().parent / "results" / "packing.json"
DENSITY_SEED, DENSITY_MIN = 1, 0.1


def observed_densities(planner: Planner) -> None:
    """Every document's density, as if measured in earlier training (visible at step 0)."""
    n = len(planner.lengths)
    rng = np.random.default_rng(DENSITY_SEED)
    rho = np.exp(rng.uniform(np.log(DENSITY_MIN), 0.0, n))
    planner.observe(np.arange(n), rho, step=-planner.config.observe_lag)


def concat_chunk(lengths: np.ndarray, order: np.ndarray, steps: int) -> dict[str, float]:
    """Stream documents in `order`, cut into rows of exactly R tokens (a document may
    straddle rows; each part attends only to itself)."""
    cost = AnalyticCost(R, ATTENTION_SHARE)
    n_mbs = SHAPE.dp * SHAPE.microbatches
    docs = iter(order.tolist())
    left = 0
    ranks, mbs, bounds = [], [], []
    for _ in range(steps):
        loads, heaviest = [], 0.0
        for _ in range(n_mbs):
            parts, used = [], 0
            while used < R:
                if left == 0:
                    left = int(lengths[next(docs)])
                take = min(left, R - used)
                parts.append(take)
                used, left = used + take, left - take
            loads.append(cost(parts, [1.0] * len(parts)))
            heaviest = max(heaviest, max(cost([n], [1.0]) for n in parts))
        loads = np.array(loads).reshape(SHAPE.dp, SHAPE.microbatches)
        ranks.append(loads.sum(1).max() / loads.sum(1).mean())
        mbs.append(loads.max() / loads.mean())
        bounds.append(max(heaviest, loads.mean()) / loads.mean())
    return {
        "rank_imbalance": float(np.mean(ranks)),
        "microbatch_imbalance": float(np.mean(mbs)),
        "microbatch_bound": float(np.mean(bounds)),
        "padding": 0.0,
        "samples_per_s": None,  # not a planner: nothing to time
    }


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    lengths = longtail_v1(DOCS, R, SEED)
    results, with_densities = {}, {}
    for policy in ("sequential", "tokens", "sab"):
        assert policy in POLICIES
        config = SABConfig(policy=policy, seed=SEED)
        results[policy] = evaluate(lengths, SHAPE, config, STEPS, ATTENTION_SHARE)
        with_densities[policy] = evaluate(
            lengths,
            SHAPE,
            config,
            STEPS,
            ATTENTION_SHARE,
            setup=lambda balancer: observed_densities(balancer.planner),
        )
    order = np.random.default_rng([SEED, 0]).permutation(DOCS)  # the planner's epoch 0
    reference = concat_chunk(lengths, order, STEPS)

    sab = results["sab"]
    checks = {
        "rank_imbalance <= 1.02": sab["rank_imbalance"] <= 1.02,
        "microbatch_imbalance within 5% of bound": sab["microbatch_imbalance"]
        <= 1.05 * sab["microbatch_bound"],
        "samples_per_s >= 50000": sab["samples_per_s"] >= 50_000,
    }
    payload = {
        "mix": "longtail-v1",
        "row_len": R,
        "shape": {"dp": SHAPE.dp, "microbatches": SHAPE.microbatches, "rows": SHAPE.rows},
        "steps": STEPS,
        "seed": SEED,
        "documents": DOCS,
        "cost_model": (
            f"latency = tokens + a * sum(len^2), "
            f"a = {ATTENTION_SHARE / (1 - ATTENTION_SHARE):g}/R: "
            f"attention is {ATTENTION_SHARE:.0%} of a full one-document row; densities 1.0"
        ),
        "timing": f"best of {TIMING_REPEATS} runs of {STEPS} steps, one thread",
        "machine": {
            "cpu_count": os.cpu_count(),
            "load_average_1min": os.getloadavg()[0],
            "python": platform.python_version(),
        },
        "policies": results,
        "reference_concat_chunk": reference,
        "with_densities": {
            "densities": f"log-uniform in [{DENSITY_MIN}, 1] per document, seed {DENSITY_SEED}",
            "policies": with_densities,
        },
        "sab_targets": checks,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(payload, indent=2) + "\n")

    print(
        f"longtail-v1, R={R}, DP={SHAPE.dp} x {SHAPE.microbatches} micro-batches x "
        f"{SHAPE.rows} row, {STEPS} steps, seed {SEED}, {DOCS} documents"
    )
    print(f"cost model: {payload['cost_model']}")
    print_table({**results, "concat-chunk": reference})
    print("(concat-chunk: reference model of DESIGN.md's 'sequential', not a planner policy)")
    print(f"\nwith per-document densities {payload['with_densities']['densities']}:")
    print_table(with_densities)
    for name, ok in checks.items():
        print(f"sab target {name}: {'met' if ok else 'NOT met'}")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
