"""What a simulated run reports: JSON, a markdown table and a Gantt chart."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from sb_titan.balance.cost_model import (
    ANALYTIC_DEVICES,
)
from sb_titan.simulator.cluster import Cluster, Scenario
from sb_titan.simulator.step import Simulator, StepResult

JSON_FORMAT = "sb_titan.simulate"


JSON_VERSION = 1
_DST_KEYS = ("anchor", "p", "beta0", "beta_min", "beta_max", "recall_by_budget")  # reported
_METHOD = {  # how the figures are made, reported beside them
    "reduction": "ring all-reduce of each pipeline rank's gradients after the last "
    "backward of the slowest DP rank, not overlapped",
    "recall_proxy": "dst.DSTDecision.predicted_recall (per document: DocDecision's), the "
    "allocator's own view by DST's recall model (setup.recall_measure): a document's "
    "first two blocks keep everything, later tokens what the model predicts",
    "heldout": "with recall_curves: DST's recall model learnt the curves' fit half; "
    "heldout_true / heldout_top_key score every document at its budget with the "
    "held-out half's mean curve of its length (simulator/heldout.py)",
}


def report(
    cluster: Cluster, sc: Scenario, sim: Simulator, results: dict[str, list[StepResult]]
) -> dict[str, Any]:
    """Means over steps per variant, and everything needed to reproduce them.

    Speedup is a throughput ratio (tokens per second): the sequential baseline pads
    rows where a document does not fit, so its steps hold fewer tokens than SAB's.
    """

    def throughput(rs: list[StepResult], control: bool = False) -> float:
        return sum(r.tokens for r in rs) / sum(r.step_s + control * r.control_s for r in rs)

    base = throughput(results["baseline"])
    base_control = throughput(results["baseline"], control=True)
    base_step = float(np.mean([r.step_s for r in results["baseline"]]))
    variants = {}
    for v, rs in results.items():
        step = float(np.mean([r.step_s for r in rs]))
        ideal = float(np.mean([r.ideal_s for r in rs]))
        budget = float(np.mean([r.mean_budget for r in rs]))
        n_units = cluster.dp * cluster.microbatches if cluster.pp > 1 else cluster.dp
        variants[v] = {
            "step_time_s": step,
            "speedup_vs_baseline": throughput(rs) / base,
            # planning and DST run ahead, overlapped with the previous step: their
            # measured CPU time (this host, not deterministic), and what of it the step
            # waits for (control_s), which the speedup "with control" adds to the step
            "planning_s": float(np.mean([r.planning_s for r in rs])),
            "dst_s": float(np.mean([r.dst_s for r in rs])),
            "control_s": float(np.mean([r.control_s for r in rs])),
            "speedup_with_control_vs_baseline": throughput(rs, control=True) / base_control,
            "step_time_ratio_vs_baseline": base_step / step,
            "tokens_per_step": float(np.mean([r.tokens for r in rs])),
            "tokens_per_s": throughput(rs),
            "padding_share": float(np.mean([r.padding for r in rs])),
            "bubble_share": float(np.mean([r.bubble_share for r in rs])),
            "imbalance_max_over_mean": float(np.mean([r.rank_imbalance for r in rs])),
            "microbatch_imbalance_max_over_mean": float(
                np.mean([r.microbatch_imbalance for r in rs])
            ),
            "ideal_bound_s": ideal,
            "step_over_ideal": step / ideal,
            "reduction_s": float(np.mean([r.reduction_s for r in rs])),
            "mean_budget": budget,
            "mean_recall_proxy": float(np.mean([r.recall_proxy for r in rs])),
            "dst_clamped_share": float(np.mean([r.clamped for r in rs])) / n_units,
            **_heldout_means(rs),
        }
    base_ideal = variants["baseline"]["ideal_bound_s"]
    return {
        "format": JSON_FORMAT,
        "version": JSON_VERSION,
        "setup": {
            "family": sim.dims.family,
            "flavor": sc.flavor,
            "gpus": cluster.gpus,
            **dataclasses.asdict(cluster),
            "data": sc.data_name,
            "seed": sc.seed,
            "steps": sc.steps,
            "baseline_policy": sc.baseline_policy,
            "block_size": sc.block_size,
            "policy": sc.selection,
            "dst": {k: getattr(sc.dst, k) for k in _DST_KEYS},
            "density_prior_exponent": sc.density_exponent,
            "recall_curves": sc.recall_curves,
            "recall_measure": sim.models.planning.recall_model.measure,
        },
        "assumptions": {
            "cost_model": sim.models.description,
            "device": None if sc.profile else {"name": sc.device, **ANALYTIC_DEVICES[sc.device]},
            "network": dataclasses.asdict(sc.network),
            "bwd_over_fwd": sc.bwd_over_fwd,
            **_METHOD,
        },
        "balance_bound_speedup": base_step / base_ideal,
        "variants": variants,
    }


def _heldout_means(rs: list[StepResult]) -> dict[str, float]:
    """Held-out recall per scored measure, the mean over steps (none without curves)."""
    return {f"heldout_{m}": float(np.mean([r.heldout[m] for r in rs])) for m in rs[0].heldout or {}}


def format_table(rep: dict[str, Any]) -> str:
    w = max(9, *(len(v) + 1 for v in rep["variants"]))
    head = (
        f"{'variant':<{w}}{'step s':>8}{'Mtok':>7}{'speedup':>9}{'bubble':>8}{'rank m/m':>9}"
        f"{'mb m/m':>8}{'ideal s':>9}{'budget':>8}{'recall':>8}"
        f"{'plan ms':>8}{'wait ms':>8}{'w/ wait':>8}"
    )
    heldout = "heldout_true" in next(iter(rep["variants"].values()))
    if heldout:
        head += f"{'held true':>10}{'held top':>9}"
    lines = [head]
    for v, r in rep["variants"].items():
        cells = f"{r['heldout_true']:>10.4f}{r['heldout_top_key']:>9.4f}" if heldout else ""
        lines.append(
            f"{v:<{w}}{r['step_time_s']:>8.3f}{r['tokens_per_step'] / 1e6:>7.2f}"
            f"{r['speedup_vs_baseline']:>8.3f}x{r['bubble_share']:>8.1%}"
            f"{r['imbalance_max_over_mean']:>9.3f}{r['microbatch_imbalance_max_over_mean']:>8.3f}"
            f"{r['ideal_bound_s']:>9.3f}{r['mean_budget']:>8.3f}{r['mean_recall_proxy']:>8.3f}"
            f"{(r['planning_s'] + r['dst_s']) * 1e3:>8.1f}{r['control_s'] * 1e3:>8.1f}"
            f"{r['speedup_with_control_vs_baseline']:>7.3f}x{cells}"
        )
    lines.append(
        "speedup: tokens/s over the baseline's; ideal: every micro-batch at the step's mean "
        f"work. Balance bound (baseline step / its ideal): {rep['balance_bound_speedup']:.3f}x\n"
        "plan ms: measured CPU time of SAB planning + DST budgets (in the loader's thread, "
        "overlapped with the previous step); wait ms: what of it exceeds the step; "
        "w/ wait: the speedup with that added to each step"
        + (
            "\nheld true / held top: true recall and top-key hit scored by measured "
            "curves held out from those DST's recall model learnt"
            if heldout
            else ""
        )
    )
    return "\n".join(lines)


def plot_timelines(first: dict[str, StepResult], cluster: Cluster, path: str, title: str) -> None:
    """Gantt of step 0 per variant: the slowest DP rank's pipeline (DP ranks if pp=1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(first), 1, figsize=(12, 1.2 + 0.9 * len(first) * max(cluster.pp, 2))
    )
    colors = plt.get_cmap("tab20").colors
    end = max(r.step_s for r in first.values())
    for ax, (v, r) in zip(np.atleast_1d(axes), first.items(), strict=True):
        tl = r.timeline
        if cluster.pp > 1:
            d = int(np.argmax(tl.makespan))
            rows = [(e[0], e[1], e[2][d], e[3][d]) for e in tl.events]
            labels = [f"stage {p}" for p in range(cluster.pp)]
        else:
            shown = min(cluster.dp, 16)
            rows = [(d, e[1], e[2][d], e[3][d]) for e in tl.events for d in range(shown)]
            labels = [f"dp {d}" for d in range(shown)]
        for y, a, s, e in rows:
            ax.barh(
                y,
                e - s,
                left=s,
                height=0.8,
                color=colors[a.mb % len(colors)],
                edgecolor="black",
                linewidth=0.3,
                alpha=0.55 if a.kind == "F" else 1.0,
                hatch="" if a.kind == "F" else "//",
            )
        ax.axvline(r.step_s, color="red", linewidth=1.2, label=f"step {r.step_s:.2f}s")
        ax.axvline(
            r.ideal_s, color="green", linestyle="--", linewidth=1.2, label=f"ideal {r.ideal_s:.2f}s"
        )
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_xlim(0, end * 1.02)
        ax.set_title(
            f"{v}: bubble {r.bubble_share:.1%}, mean budget {r.mean_budget:.3f}",
            fontsize=9,
            loc="left",
        )
        ax.legend(loc="lower right", fontsize=7)
    np.atleast_1d(axes)[-1].set_xlabel("seconds (F light, B hatched; colour = micro-batch)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
