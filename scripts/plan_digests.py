"""Digests of the plans and DST budgets the recipe computes for fixed seeds.

    python scripts/plan_digests.py [--check FILE] [--out FILE]

Covers bench/packing.py's setup (every policy, with and without observed densities)
and sb-simulate (SAB+DST under DP and PP, mean and recall anchors). A refactoring that
must not change behaviour records this before and checks it after
(tests/fixtures/plan_digests.json; tests/test_plan_digests.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKING_STEPS = 10
SIM_STEPS = 3


def _load_bench(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan_digest(plans) -> str:
    pieces = [
        (plan.step, r, m, i, p.sample_id, p.start, p.length)
        for plan in plans
        for r, rank in enumerate(plan.microbatches)
        for m, mb in enumerate(rank)
        for i, row in enumerate(mb.rows)
        for p in row
    ]
    return hashlib.sha1(repr(pieces).encode()).hexdigest()


def packing_digests() -> dict[str, str]:
    from sb_titan.balance.balancer import Balancer
    from sb_titan.balance.sab import AnalyticCost, SABConfig
    from sb_titan.data.longtail import longtail_v1

    bench = _load_bench("packing")
    lengths = longtail_v1(bench.DOCS, bench.R, bench.SEED)
    out = {}
    for policy in ("sequential", "tokens", "sab"):
        for observed in (False, True):
            sab = SABConfig(policy=policy, seed=bench.SEED)
            cost = AnalyticCost(bench.R, bench.ATTENTION_SHARE)
            balancer = Balancer(lengths, bench.SHAPE, sab, cost_fn=cost)  # as sb-plan plans
            if observed:
                bench.observed_densities(balancer.planner)
            plans = [balancer.next_step().plan for _ in range(PACKING_STEPS)]
            out[f"packing/{policy}{'+densities' if observed else ''}"] = plan_digest(plans)
    return out


#: report fields measured on the host (DST's in-step time), not part of the behaviour
WALL_CLOCK = ("planning_s", "dst_s", "control_s", "speedup_with_control_vs_baseline")


def simulate_digests() -> dict[str, str]:
    from sb_titan.simulator import simulate
    from sb_titan.tools.simulate import _parser, _resolve

    cases = {
        "dp8_3b_64k_mean": ["--dp", "8", "--flavor", "3b", "--seq-len", "65536"],
        "dp4_pp4_3b_64k_recall": ["--dp", "4", "--pp", "4", "--flavor", "3b", "--anchor", "recall"],
        "e2e_cpu_dp2": ["--config", str(REPO / "train_configs" / "e2e_cpu.toml"), "--dp", "2"],
    }
    out = {}
    for name, argv in cases.items():
        args = _parser().parse_args([*argv, "--steps", str(SIM_STEPS), "--quiet"])
        cluster, scenario = _resolve(args)
        report, _ = simulate(cluster, scenario)
        variants = {  # without the measured (wall-clock) control-plane fields
            v: {k: x for k, x in r.items() if k not in WALL_CLOCK}
            for v, r in report["variants"].items()
        }
        blob = json.dumps(
            {"cluster": dataclasses.asdict(cluster), "variants": variants}, sort_keys=True
        )
        out[f"simulate/{name}"] = hashlib.sha1(blob.encode()).hexdigest()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the digests here (JSON)")
    ap.add_argument("--check", type=Path, help="compare with digests recorded earlier")
    args = ap.parse_args(argv)
    digests = {**packing_digests(), **simulate_digests()}
    for key, value in digests.items():
        print(f"{value}  {key}")
    if args.out:
        args.out.write_text(json.dumps(digests, indent=2, sort_keys=True) + "\n")
    if args.check:
        recorded = json.loads(args.check.read_text())
        changed = sorted(k for k in recorded if recorded[k] != digests.get(k))
        if changed:
            print(f"changed since {args.check}: {', '.join(changed)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
