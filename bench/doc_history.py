"""What each document's own measured recall buys per-document DST, simulated.

Documents of one length differ in how much true attention mass a budget costs them;
the recall model by length cannot see that, a document's own history can
([dst] doc_history, docs/cost_model.md). The measured curves of bench/recall_curves.py
differ by <= 0.003 between documents of one length, so they cannot show it. This bench
assumes a spread instead, and says so: each sample gets a fixed sensitivity
m = exp(sigma * z), z standard normal, and at budget beta its budget-sensitive tokens
keep 1 - m (1 - k) of their mass, k what the held-out curve of its length keeps
(bench/results/recall_curves.json, true recall).

A fixed set of documents is trained for several epochs by the trainer's own balancer
(SAB, DST with the `mean` anchor, per-document budgets; the recall model learnt by
budget from the curves' fit half, as `sb-simulate --recall-curves` does). The `mean`
anchor gives every micro-batch the attention time its micro-batch budget costs, so the
variants spend the same time and differ only in how they split it. After each step
every trained document reports what it kept (exactly, without the trainer's sampling
noise) to the planner, as the trainer does (`Planner.observe_recalls`). Variants:
- `length`: history off, each document's curve from its length alone;
- `history`: on, each report weighted b / (b + doc_history_blocks) for its b sampled
  query blocks, as the trainer weighs it;
- `oracle`: on, every report at full weight (its sensitivity known exactly once seen).

Scored per epoch by the documents' true kept mass (token-weighted), with the step
time from the simulator's analytic H200 model.

    python bench/doc_history.py [--quick] [--sigma 0.5]  ->  bench/results/doc_history.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from sb_titan.balance.dst import DSTConfig, sensitive_recall, sensitive_tokens
from sb_titan.balance.sab import SABConfig
from sb_titan.simulator import Cluster, Scenario, build_simulator, draw_lengths, make_balancer
from sb_titan.simulator.step import DOC_VARIANT

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "doc_history.json"
CURVES = REPO / "bench" / "results" / "recall_curves.json"
VARIANTS = ("length", "history", "oracle")


SIGMAS = (0.5, 1.0, 2.0)


@dataclasses.dataclass(frozen=True)
class Setting:
    cluster: Cluster
    epoch_steps: int  # steps of documents in the fixed set (one epoch)
    epochs: int
    sigma: float
    seed: int = 0


PAPER_LIKE = Setting(Cluster(dp=8, pp=4, microbatches=8), epoch_steps=2, epochs=4, sigma=0.5)
QUICK = Setting(
    Cluster(dp=2, pp=1, microbatches=2, seq_len=8192), epoch_steps=2, epochs=3, sigma=2.0
)


def truth(curves, lengths: np.ndarray, betas: np.ndarray, m: np.ndarray, bs: int):
    """(each document's true recall, its sensitive tokens' kept mass or NaN where it
    has none) at `betas` with sensitivities `m`."""
    recall = curves.per_document(lengths, betas, "true")
    kept = np.full(lengths.size, np.nan)
    out = recall.copy()
    sensitive = sensitive_tokens(lengths, bs)
    for i, (n, r) in enumerate(zip(lengths.tolist(), recall.tolist(), strict=True)):
        got = sensitive_recall([n], r, bs)
        if got is not None:
            kept[i] = min(1.0, max(1e-6, 1.0 - m[i] * (1.0 - got[1])))
            out[i] = (n - sensitive[i] + sensitive[i] * kept[i]) / n
    return out, kept


def run(setting: Setting, curves_path: Path, progress: bool = True) -> dict:
    c = setting.cluster
    dst = DSTConfig(anchor="mean", per_document=True, recall_measure="true", recall_by_budget=True)
    sc = Scenario(steps=1, seed=setting.seed, dst=dst, recall_curves=str(curves_path))
    sim = build_simulator(c, sc)
    model, curves, bs = sim.models.planning, sim.curves, sc.block_size
    lengths = draw_lengths(c, setting.epoch_steps, setting.seed, spare=False)
    rng = np.random.default_rng(setting.seed + 7)
    sensitivity = np.exp(setting.sigma * rng.standard_normal(lengths.size))
    sab = SABConfig(policy="sab", seed=setting.seed, observe_lag=1)
    configs = {
        "length": dataclasses.replace(dst, doc_history=False),
        "history": dst,
        "oracle": dst,
    }
    balancers = {
        v: make_balancer(lengths, c, sab, "sab", model, cfg, sc.selection)
        for v, cfg in configs.items()
    }
    steps = setting.epoch_steps * setting.epochs
    rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    t0 = time.perf_counter()
    for step in range(steps):
        for v in VARIANTS:
            scheduled = balancers[v].next_step()
            plan = scheduled.plan
            pieces = [
                p for rank in plan.microbatches for mb in rank for row in mb.rows for p in row
            ]
            ids = np.array([p.sample_id for p in pieces])
            n = np.array([p.length for p in pieces])
            betas = np.array(
                [b for rank in scheduled.doc_budgets.budgets for mb in rank for b in mb]
            )
            recall, kept = truth(curves, n, betas, sensitivity[ids], bs)
            weight = np.where(n >= 2, n, 0)
            seen = ~np.isnan(kept)
            blocks = sensitive_tokens(n, bs) / bs
            w = np.ones(n.size) if v == "oracle" else blocks / (blocks + dst.doc_history_blocks)
            report = np.stack([betas, kept, w], axis=1)[seen]
            balancers[v].planner.observe_recalls(ids[seen], report, step=plan.step)
            carried = [r for rank in plan.microbatches for mb in rank for r in (mb.recalls or [])]
            rows[v].append(
                {
                    "step": step,
                    "epoch": step // setting.epoch_steps,
                    "true_recall": float((weight * recall).sum() / weight.sum()),
                    "predicted_recall": scheduled.doc_budgets.predicted_recall,
                    "step_s": sim.run_step(scheduled, DOC_VARIANT).step_s,
                    "with_history": int(sum(not np.isnan(r[0]) for r in carried)),
                    "documents": int(n.size),
                    "budgets": [list(rank) for rank in scheduled.budgets],
                }
            )
        if progress:
            line = "  ".join(f"{v} {rows[v][-1]['true_recall']:.4f}" for v in VARIANTS)
            elapsed = time.perf_counter() - t0
            print(
                f"[doc-history] step {step + 1}/{steps}  {line}  ({elapsed:.0f}s)", file=sys.stderr
            )
    return report_of(setting, rows)


def report_of(setting: Setting, rows: dict[str, list[dict]]) -> dict:
    epochs = []
    for e in range(setting.epochs):
        entry: dict = {"epoch": e}
        for v in VARIANTS:
            sel = [r for r in rows[v] if r["epoch"] == e]
            entry[v] = {
                "true_recall": float(np.mean([r["true_recall"] for r in sel])),
                "predicted_recall": float(np.mean([r["predicted_recall"] for r in sel])),
                "step_s": float(np.mean([r["step_s"] for r in sel])),
                "with_history": sum(r["with_history"] for r in sel),
                "documents": sum(r["documents"] for r in sel),
            }
        epochs.append(entry)
    c = setting.cluster
    return {
        "scenario": (
            f"analytic H200 Qwen2.5-3B, {c.dp} x {c.pp} GPUs, {c.microbatches} micro-batches, "
            f"{c.seq_len}-token rows, longtail-v1; SAB + DST (mean anchor, recall by budget) "
            "+ per-document budgets; held-out true-recall curves scaled by a per-sample "
            f"sensitivity exp(sigma z), sigma {setting.sigma}"
        ),
        "sigma": setting.sigma,
        "epoch_steps": setting.epoch_steps,
        "epochs": epochs,
        "steps": {
            v: [{k: x for k, x in r.items() if k != "budgets"} for r in rows[v]] for v in VARIANTS
        },
        "same_microbatch_budgets": all(
            rows["length"][i]["budgets"] == rows[v][i]["budgets"]
            for v in VARIANTS
            for i in range(len(rows[v]))
        ),
    }


def format_table(reps: list[dict]) -> str:
    lines = [
        reps[0]["scenario"].rsplit(";", 1)[0],
        "| sigma | epoch | documents with history | true recall: length / history / oracle "
        "| step s: length / history / oracle |",
        "|---|---|---|---|---|",
    ]
    for rep in reps:
        for e in rep["epochs"]:
            recall = " / ".join(f"{e[v]['true_recall']:.4f}" for v in VARIANTS)
            step = " / ".join(f"{e[v]['step_s']:.3f}" for v in VARIANTS)
            seen = f"{e['history']['with_history']} of {e['history']['documents']}"
            lines.append(f"| {rep['sigma']} | {e['epoch']} | {seen} | {recall} | {step} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4 GPUs, 8K rows, 3 epochs, sigma 2")
    p.add_argument(
        "--sigma", help=f"spreads of log sensitivity, comma-separated (default {SIGMAS})"
    )
    p.add_argument("--curves", default=str(CURVES), help="bench/recall_curves.py's JSON")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    setting = QUICK if args.quick else PAPER_LIKE
    sigmas = [setting.sigma] if args.quick else list(SIGMAS)
    if args.sigma is not None:
        sigmas = [float(x) for x in args.sigma.split(",")]
    reps = [run(dataclasses.replace(setting, sigma=s), Path(args.curves)) for s in sigmas]
    print(format_table(reps))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": reps}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
