"""SparseBalance's own per-step cost (the control plane) beside the step it steers.

    python bench/control_plane.py [--units 8,64,256,1024,2048,4096] [--repeats 3]
                                  [--exchange-ranks 2,4]

Per scale (DST units = DP x 8 micro-batches at PP 4, so 2048 units = 1024 GPUs): CPU
seconds of SAB planning (`sab.Planner.next_step`, the planner the loader runs), of
`dst.tune_budgets` for every anchor, of per-document budgets after the `recall` anchor
(`doc_dst.step_doc_budgets`, `[dst] per_document`), and of the cost-model refit with its density and
recall model updates (what every rank runs after the step's all-gather), beside the
simulated step time of that setting (`sb_titan.simulator`: the analytic H200 model of
Qwen2.5-3B, longtail-v1 documents in 64K rows, SAB+DST). Planning and DST run ahead in
the loader's thread (cost_model.plan_lag = 2), overlapped with the previous step: the
step waits for them only where planning + DST exceed it (`ahead_overlapped`). What stays
on the step's critical path is the refit, the snapshot the trainer publishes for the
planning thread (`publish_s`, a deep copy of the model) and the exchange. The target per
anchor: DST <= 1% of the step, or fully overlapped.
The measurement exchange (encode, one all-gather of the fixed-size float64 buffer,
decode: `sb_titan.runtime.measurements`) is timed on 2 and 4 real gloo ranks under
torchrun (`exchange`, bench/measurement_exchange.py); its cost grows with the world
size, which a CPU host cannot reach, so it is reported beside the table, not per scale.

Timings are medians over `--repeats` calls on this CPU (planning: steps after the
first, whose piece-cost cache is cold). Writes bench/results/control_plane.json.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from measurement_exchange import measure_exchange

from sb_titan.balance.balancer import ScheduledStep, step_budgets, step_units
from sb_titan.balance.cost_model import LatencyObservation
from sb_titan.balance.doc_dst import step_doc_budgets
from sb_titan.balance.dst import ANCHORS, DSTConfig, sensitive_recall, tune_budgets
from sb_titan.balance.snapshots import CostModelSnapshots
from sb_titan.simulator import Cluster, Scenario, build_simulator, draw_lengths, make_balancer

OUT = Path(__file__).resolve().parents[1] / "bench" / "results" / "control_plane.json"
PP, MICROBATCHES = 4, 8
TARGET = 0.01  # DST's share of the step


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _refit_inputs(cm, plan, dst: DSTConfig, selection: str):
    """What the trainer feeds the models after a step: one latency observation per
    (DP rank, micro-batch), and density/recall triples of its longest document. The
    figures are the model's own predictions made 10% slower (a drifted clock)."""
    latency, density, recall = [], [], []
    for rank in plan.microbatches:
        for mb in rank:
            lens = list(mb.doc_lens)
            rho = cm.density_for_budget(dst.beta0, max(lens), selection)
            latency.append(LatencyObservation(lens, [rho] * len(lens), 1.1 * cm.predict(lens, rho)))
            density.append((dst.beta0, max(lens), rho))
            kept = sensitive_recall(lens, 0.95, cm.block_size)
            if kept is not None:
                recall.append((dst.beta0, kept[0], kept[1]))
    return latency, density, recall


def measure(units: int, repeats: int, seed: int = 0) -> dict:
    dp = max(1, units // MICROBATCHES)
    cluster = Cluster(dp=dp, pp=PP, microbatches=MICROBATCHES)
    sc = Scenario(steps=repeats + 1, seed=seed)
    sim = build_simulator(cluster, sc)
    cm = sim.models.planning
    lengths = draw_lengths(cluster, repeats + 2, seed)
    sab = dataclasses.replace(sc.sab, seed=seed)
    balancer = make_balancer(lengths, cluster, sab, "sab", cm, sc.dst, sc.selection)
    plan_times = []
    for _ in range(repeats + 1):
        scheduled = balancer.next_step()
        plan_times.append(scheduled.planning_s)
    plan = scheduled.plan
    work = step_units(plan, pipelined=True)
    dst_s, step_s = {}, {}
    for anchor in ANCHORS:
        cfg = dataclasses.replace(sc.dst, anchor=anchor)
        solve = lambda cfg=cfg: tune_budgets(work, cm, cfg, sc.selection)  # noqa: E731
        dst_s[anchor] = _median_s(solve, repeats)
        sim.dst = cfg
        scheduled = ScheduledStep(plan, *step_budgets(plan, cm, cfg, sc.selection, True))
        step_s[anchor] = sim.run_step(scheduled, "sab_dst").step_s
    # per-document budgets within the recall anchor's micro-batch budgets ([dst]
    # per_document), the balancer's step_doc_budgets on the same plan
    doc_cfg = dataclasses.replace(sc.dst, anchor="recall", per_document=True)
    budgets, decision = step_budgets(plan, cm, doc_cfg, sc.selection, True)
    per_doc = lambda: step_doc_budgets(plan, budgets, decision, cm, doc_cfg, sc.selection)  # noqa: E731
    doc_dst_s = _median_s(per_doc, repeats)
    latency, density, recall = _refit_inputs(cm, plan, sc.dst, sc.selection)

    def refit() -> None:
        model = copy.deepcopy(cm)  # every call starts from the same state
        t0 = time.perf_counter()
        model.refit(latency)
        model.density_model.update(density)
        model.recall_model.update(recall)
        refit.seconds.append(time.perf_counter() - t0)

    refit.seconds = []
    for _ in range(repeats):
        refit()
    publish_s = _median_s(lambda: CostModelSnapshots(cm, lag=2).publish(0, cm), repeats)
    ratio = {a: dst_s[a] / step_s[a] for a in ANCHORS}
    plan_s = statistics.median(plan_times[1:])
    overlapped = {a: plan_s + dst_s[a] <= step_s[a] for a in ANCHORS}
    return {
        "units": len(work),
        "gpus": cluster.gpus,
        "dp": dp,
        "pp": PP,
        "microbatches": MICROBATCHES,
        "step_s": step_s,
        "sab_plan_s": plan_s,
        "sab_plan_first_s": plan_times[0],
        "dst_s": dst_s,
        "dst_over_step": ratio,
        "ahead_overlapped": overlapped,
        # after the recall anchor's DST; overlapped when planning + both fit in the step
        "doc_dst_s": doc_dst_s,
        "doc_dst_overlapped": plan_s + dst_s["recall"] + doc_dst_s <= step_s["recall"],
        "dst_within_target": {a: ratio[a] <= TARGET or overlapped[a] for a in ANCHORS},
        "refit_s": statistics.median(refit.seconds),
        "publish_s": publish_s,
    }


def table(rows: list[dict]) -> str:
    head = "| units | GPUs | step s (mean) | SAB plan ms | " + " | ".join(
        f"DST {a} ms" for a in ANCHORS
    )
    head += " | per-document DST ms (overlapped) | worst DST/step | plan+DST overlapped"
    head += " | refit + publish ms | on target |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        worst = max(r["dst_over_step"].values())
        dst = " | ".join(f"{r['dst_s'][a] * 1e3:.1f}" for a in ANCHORS)
        ok = "yes" if all(r["dst_within_target"].values()) else "no"
        ahead = "yes" if all(r["ahead_overlapped"].values()) else "no"
        critical = (r["refit_s"] + r["publish_s"]) * 1e3
        doc = f"{r['doc_dst_s'] * 1e3:.0f} ({'yes' if r['doc_dst_overlapped'] else 'no'})"
        lines.append(
            f"| {r['units']} | {r['gpus']} | {r['step_s']['mean']:.2f} | "
            f"{r['sab_plan_s'] * 1e3:.0f} | {dst} | {doc} | {worst:.2%} | {ahead} | "
            f"{critical:.1f} | {ok} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", default="8,64,256,1024,2048,4096", help="comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(OUT), help="JSON path ('' for none)")
    ap.add_argument("--exchange-ranks", default="2,4", help="gloo ranks ('' to skip)")
    args = ap.parse_args(argv)
    try:
        scales = [int(u) for u in args.units.split(",")]
    except ValueError:
        ap.error(f"--units: expected comma-separated integers, got {args.units!r}")
    if args.repeats < 1 or any(u < 1 for u in scales):
        ap.error("--units and --repeats must be >= 1")
    rows = []
    for units in scales:
        rows.append(measure(units, args.repeats))
        print(f"[control_plane] {units} units done", file=sys.stderr)
    print(table(rows))
    ranks = [int(r) for r in args.exchange_ranks.split(",") if r]
    exchange = [measure_exchange(r, MICROBATCHES) for r in ranks]
    for e in exchange:
        print(f"measurement exchange, {e['ranks']} gloo ranks: {e['median_s'] * 1e3:.3f} ms")
    if args.out:
        result = {
            "scenario": "analytic H200 Qwen2.5-3B (sb_titan.simulator), longtail-v1, 64K rows, "
            f"PP {PP} x {MICROBATCHES} micro-batches, SAB+DST; CPU timings of the control plane",
            "target_dst_over_step": TARGET,
            "repeats": args.repeats,
            "host": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "rows": rows,
            "exchange": exchange,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
