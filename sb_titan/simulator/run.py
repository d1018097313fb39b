"""A simulated run: every variant over the same documents for a number of steps."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import numpy as np

from sb_titan.data.longtail import longtail_v1
from sb_titan.simulator.cluster import Cluster, Scenario
from sb_titan.simulator.heldout import RecallCurves
from sb_titan.simulator.report import report
from sb_titan.simulator.stages import build_cost_models
from sb_titan.simulator.step import Simulator, StepResult, make_balancer, variants


def draw_lengths(cluster: Cluster, steps: int, seed: int, spare: bool = True) -> np.ndarray:
    """Enough longtail-v1 documents for every step to see fresh ones (the planner
    would start a new epoch otherwise, which is harmless); `spare` False: about `steps`
    full steps' worth, one epoch after which they recur."""
    pilot = longtail_v1(4096, cluster.seq_len, seed + 1).mean()
    tokens = steps * cluster.dp * cluster.microbatches * cluster.rows * cluster.seq_len
    count = int(1.2 * tokens / pilot) + 1024 if spare else int(tokens / pilot)
    return longtail_v1(count, cluster.seq_len, seed)


def build_simulator(cluster: Cluster, sc: Scenario) -> Simulator:
    dims = sc.model
    models = build_cost_models(
        dims,
        cluster,
        device=sc.device if sc.profile is None else None,
        profile=sc.profile,
        block_size=sc.block_size,
        beta0=sc.dst.beta0,
        policy=sc.selection,
        density_exponent=sc.density_exponent,
        first_less=sc.first_less,
        last_less=sc.last_less,
    )
    curves = None
    if sc.recall_curves is not None:
        curves = RecallCurves.load(sc.recall_curves)
        # DST learns the fit half as a trainer learns what it trained
        models.planning.recall_model = curves.fitted_model(sc.dst, sc.block_size)
    return Simulator(
        cluster, dims, models, sc.dst, sc.selection, sc.network, sc.bwd_over_fwd, curves
    )


def simulate(
    cluster: Cluster, sc: Scenario, progress: bool = False
) -> tuple[dict[str, Any], dict[str, StepResult]]:
    """Run every variant for sc.steps steps; (report, step-0 results with timelines).
    Each variant is a run of its own: one balancer (the trainer's) plans and budgets it."""
    sim = build_simulator(cluster, sc)
    lengths = sc.lengths if sc.lengths is not None else draw_lengths(cluster, sc.steps, sc.seed)
    sab = dataclasses.replace(sc.sab, seed=sc.seed)
    names = variants(sc.dst)
    balancers = {
        v: make_balancer(
            lengths,
            cluster,
            sab,
            "sab" if v.startswith("sab") else sc.baseline_policy,
            sim.models.planning,
            sim.dst_config(v),
            sc.selection,
        )
        for v in names
    }
    results: dict[str, list[StepResult]] = {v: [] for v in names}
    first: dict[str, StepResult] = {}
    t0 = time.perf_counter()
    for step in range(sc.steps):
        for v in names:
            r = sim.run_step(balancers[v].next_step(), v, step == 0)
            if step == 0:
                first[v] = r
            results[v].append(r)
        if progress:
            line = "  ".join(f"{v} {results[v][-1].step_s:.2f}s" for v in names)
            elapsed = time.perf_counter() - t0
            print(
                f"[sb-simulate] step {step + 1}/{sc.steps}  {line}  ({elapsed:.0f}s)",
                file=sys.stderr,
            )
    return report(cluster, sc, sim, results), first
