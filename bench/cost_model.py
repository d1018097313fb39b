"""Cost-model accuracy on fresh micro-batches: profile the debug model, then predict.

Profiles the debug model of train_configs/e2e_cpu.toml (every layer sparse, rows of 4096
tokens, one row per micro-batch) on this CPU with `sb-profile`'s code, or loads a
profile with --profile (its fingerprint gives the row length, stage and scope), then
times >= 50 micro-batches that played no part in the fit:
rows of the profile's row length packed sequentially with longtail-v1 documents
(a document cut at a row's end continues in the next row), each at a random topk
budget in [0.1, 1.0]. Each is predicted with CostModel.predict_budget (what DST calls;
the headline) and with CostModel.predict at the row's realised density (what `refit`
sees), and measured as the median of --repeats fwd+bwd runs of the same stage, timed
round-robin. Reports median / p90 absolute percentage error, and the error on one half
after online `refit`s on the other half (fed in steps of 4, as training would).

Timings use process CPU time, like the profile on CPU (one thread): on a shared machine
other users' processes inflate wall time far more than CPU time (which still moves with
cache and memory contention). Wall-clock errors are reported next to it.

    python bench/cost_model.py                # profile (~2 min), then 60 micro-batches
    python bench/cost_model.py --profile profiles/e2e_cpu.json
    python bench/cost_model.py --quick        # smoke run: 1024-token rows, 12 batches
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from sb_titan.balance.cost_model import CostModel, LatencyObservation, Profile
from sb_titan.config.toml import checked_model_spec, load_config
from sb_titan.data.longtail import longtail_v1
from sb_titan.profiler import (
    AttentionInputs,
    ProfileSettings,
    TokenLinearAttention,
    attention_kinds,
    attention_swapped,
    build_stage,
    default_lengths,
    load_average,
    make_attention_step,
    make_stage_step,
    microbatch_rows,
    packed_rows,
    run_profile,
    scoped_modules,
    stage_module_names,
    write_profile,
)

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
CONFIG = REPO / "train_configs" / "e2e_cpu.toml"
BUDGET_RANGE = (0.1, 1.0)
REFIT_STEP = 4  # micro-batches per training step fed to one refit


def pack(lengths: np.ndarray, n_mb: int, rows: int, row_len: int) -> list[list[list[int]]]:
    """n_mb micro-batches of `rows` full rows, documents packed in order, cut at row ends."""
    docs = iter(int(x) for x in lengths)
    carry, out = 0, []
    for _ in range(n_mb):
        mb = []
        for _ in range(rows):
            row, left = [], row_len
            while left:
                n = carry or next(docs)
                take = min(n, left)
                row.append(take)
                carry, left = n - take, left - take
            mb.append(row)
        out.append(mb)
    return out


def realised_density(model, inputs: AttentionInputs, rows, budget) -> float:
    """Mean realised density of the sparse layers (what the trainer's refit receives)."""
    sparse = [m for m, _ in attention_kinds(model) if m.config.sparse]
    if not sparse:
        return 1.0
    return make_attention_step(sparse[0], inputs, rows, budget)[1]


def drift_probes(model, config, inputs, rows: int, row_len: int, record: dict | None):
    """Two points of the profile, re-timed among the samples: the stage with the
    stand-in attention at a full micro-batch, and one attention layer on row-length
    documents at density 1.0. now / then says how far the machine's speed moved between
    profiling and this run (the part of the error no profile can know about)."""
    if not record:
        return []
    probes = []
    stand_in = TokenLinearAttention()
    linear = make_stage_step(model, config.training, [[row_len]] * rows, 1.0, torch.device("cpu"))

    def linear_probe() -> None:
        with attention_swapped(model, stand_in):
            linear()

    probes.append(("linear_full_microbatch", linear_probe, record["linear_measured_seconds"][-1]))
    module, _ = attention_kinds(model)[-1]
    kind = "sparse" if module.config.sparse else "dense"
    for point in record["attention_points"]:
        if point["kind"] == kind and point["length"] == row_len:
            then = point["seconds_per_doc_and_layer"][-1] * point["copies"]
            shift = config.sparse_attention.block_size // 2
            step, _ = make_attention_step(
                module, inputs, packed_rows(row_len, rows, row_len, shift), 1.0
            )
            probes.append((f"{kind}_attention_layer_L{row_len}_rho1", step, then))
    return probes


def measure(steps, repeats: int) -> list[tuple[float, float]]:
    """(cpu, wall) median seconds per step; passes round-robin after 2 warm-up calls."""
    for step in steps[:2]:
        step()
    cpu: list[list[float]] = [[] for _ in steps]
    wall: list[list[float]] = [[] for _ in steps]
    for r in range(repeats):
        for i, step in enumerate(steps):
            w, c = time.perf_counter(), time.process_time()
            step()
            cpu[i].append(time.process_time() - c)
            wall[i].append(time.perf_counter() - w)
        print(f"  timing pass {r + 1}/{repeats} done (load {load_average()})", file=sys.stderr)
    return [(statistics.median(c), statistics.median(w)) for c, w in zip(cpu, wall, strict=True)]


def ape_stats(pred, meas) -> dict[str, float]:
    e = np.abs(np.asarray(pred) - np.asarray(meas)) / np.asarray(meas)
    return {
        "median_ape": round(float(np.median(e)), 4),
        "p90_ape": round(float(np.quantile(e, 0.9)), 4),
        "mean_ape": round(float(np.mean(e)), 4),
        "bias": round(float(np.median((np.asarray(pred) - meas) / np.asarray(meas))), 4),
        "n": len(e),
    }


def refit_split(profile: Profile, samples: list[dict], clock: str) -> dict:
    """Refit on the even-indexed half (in steps of REFIT_STEP), evaluate on the odd half."""
    model = CostModel(profile)
    calib, test = samples[0::2], samples[1::2]
    for i in range(0, len(calib), REFIT_STEP):
        model.refit(
            LatencyObservation(s["doc_lens"], [s["density"]] * len(s["doc_lens"]), s[clock])
            for s in calib[i : i + REFIT_STEP]
        )
    before = ape_stats([s["predicted_s"] for s in test], [s[clock] for s in test])
    pred = [model.predict_budget(s["doc_lens"], s["budget"], "topk") for s in test]
    return {
        "calibration_n": len(calib),
        "refits": model.n_refits,
        "attn_scale": round(model.attn_scale, 4),
        "rest_scale": round(model.rest_scale, 4),
        "test_before_refit": before,
        "test_after_refit": ape_stats(pred, [s[clock] for s in test]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run, not a result")
    ap.add_argument("--profile", type=Path, help="use this profile instead of measuring one")
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--row-len", type=int, help="row length when profiling (default: config's)")
    ap.add_argument("--n", type=int, default=60, help="fresh micro-batches (>= 50)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--save-profile", type=Path, help="also write the measured profile here")
    ap.add_argument("--out", type=Path, default=RESULTS / "cost_model.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.row_len, args.n, args.repeats = 1024, 12, 1
    default_row_len = load_config(args.config).training.seq_len
    started, load0 = time.perf_counter(), load_average()

    if args.profile:
        profile = Profile.load(args.profile)
        record = json.loads(args.profile.read_text()).get("measurement")
        fp = profile.fingerprint
        row_len, stage, scope = fp["row_len"], fp["pp_stage"], fp["scope"]
        profile_src, profile_s = str(args.profile), None
    else:
        row_len, stage, scope = args.row_len or default_row_len, 0, "blocks"
    config = load_config(args.config, ["--training.seq_len", str(row_len)])
    model_cfg = checked_model_spec(config, args.config).model
    rows = microbatch_rows(config.parallelism, config.training)
    if not args.profile:
        settings = ProfileSettings(
            lengths=default_lengths(row_len, config.sparse_attention.block_size),
            rows=rows,
            row_len=row_len,
            repeats=1 if args.quick else 5,
            clock="cpu",
            scope=scope,
        )
        run = run_profile(config, model_cfg, settings, stage, torch.device("cpu"))
        profile, record = run.profile, run.measurement
        profile_s = record["elapsed_s"]
        profile_src = "measured by this run"
        if args.save_profile:
            write_profile(run, args.save_profile)
            profile_src = f"measured by this run, saved to {args.save_profile}"
    cost = CostModel(profile)

    modules = scoped_modules(stage_module_names(config.parallelism, model_cfg, stage), scope)
    model = build_stage(config.training, model_cfg, modules, torch.device("cpu"))
    rng = np.random.default_rng(args.seed)
    lengths = longtail_v1(args.n * rows * row_len // 16, row_len, args.seed)
    batches = pack(lengths, args.n, rows, row_len)
    budgets = rng.uniform(*BUDGET_RANGE, size=args.n).round(4)
    inputs = AttentionInputs.random(config.training, model, rows, row_len, torch.device("cpu"))
    samples, steps = [], []
    for i, (mb, beta) in enumerate(zip(batches, budgets, strict=True)):
        doc_lens = [n for row in mb for n in row]
        samples.append(
            {
                "i": i,
                "doc_lens": doc_lens,
                "docs": len(doc_lens),
                "longest": max(doc_lens),
                "budget": float(beta),
                "density": round(realised_density(model, inputs, mb, beta), 4),
                "predicted_s": cost.predict_budget(doc_lens, float(beta), "topk"),
            }
        )
        samples[-1]["predicted_realised_s"] = cost.predict(doc_lens, samples[-1]["density"])
        steps.append(
            make_stage_step(model, config.training, mb, float(beta), torch.device("cpu"), i)
        )
    probes = drift_probes(model, config, inputs, rows, row_len, record)
    print(f"timing {args.n} fresh micro-batches ({rows} x {row_len} tokens)", file=sys.stderr)
    t0, c0 = time.perf_counter(), time.process_time()
    timings = measure(steps + [p[1] for p in probes], args.repeats)
    cpu_share = (time.process_time() - c0) / (time.perf_counter() - t0)
    drift = {
        name: round(now[0] / then, 4)
        for (name, _, then), now in zip(probes, timings[len(steps) :], strict=True)
    }
    timings = timings[: len(steps)]
    for s, (cpu_s, wall_s) in zip(samples, timings, strict=True):
        s["cpu_s"], s["wall_s"] = cpu_s, wall_s
        s["ape"] = abs(s["predicted_s"] - cpu_s) / cpu_s

    pred = [s["predicted_s"] for s in samples]
    headline = ape_stats(pred, [s["cpu_s"] for s in samples])
    result = {
        **{k: headline[k] for k in ("median_ape", "p90_ape", "n")},
        "mean_ape": headline["mean_ape"],
        "bias_median": headline["bias"],
        "target": {"median_ape": 0.05, "p90_ape": 0.12},
        "clock": "process CPU time (one thread), as the profile",
        "quick": args.quick,
        "device": f"cpu: {profile.fingerprint.get('device_name')} ({platform.machine()})",
        "torch": torch.__version__,
        "machine": {
            "cpu_count": os.cpu_count(),
            "load_avg_1min_start": load0,
            "load_avg_1min_end": load_average(),
            "cpu_share_while_timing": round(cpu_share, 3),
        },
        "profile": profile_src,
        "profile_seconds": profile_s,
        "profile_fingerprint": profile.fingerprint,
        "microbatch": {"rows": rows, "row_len": row_len, "scope": scope, "stage": stage},
        "budgets": "uniform [0.1, 1.0], topk",
        "mix": f"longtail-v1, seed {args.seed}",
        "repeats": args.repeats,
        "machine_drift_now_over_profile": drift,
        "with_realised_density": ape_stats(
            [s["predicted_realised_s"] for s in samples], [s["cpu_s"] for s in samples]
        ),
        "refit_half": refit_split(profile, samples, "cpu_s"),
        "wall_clock": {
            "all": ape_stats(pred, [s["wall_s"] for s in samples]),
            "refit_half": refit_split(profile, samples, "wall_s"),
        },
        "elapsed_s": round(time.perf_counter() - started, 1),
        "samples": [
            {
                k: (round(v, 5) if isinstance(v, float) else v)
                for k, v in s.items()
                if k != "doc_lens"
            }
            | {"doc_lens": s["doc_lens"]}
            for s in samples
        ],
    }
    print(
        f"n={result['n']} median APE {result['median_ape']:.1%} p90 {result['p90_ape']:.1%} "
        f"(bias {result['bias_median']:+.1%}); at realised density: median "
        f"{result['with_realised_density']['median_ape']:.1%}; after refit on half: "
        f"median {result['refit_half']['test_after_refit']['median_ape']:.1%} "
        f"p90 {result['refit_half']['test_after_refit']['p90_ape']:.1%}; "
        f"wall clock median {result['wall_clock']['all']['median_ape']:.1%}; "
        f"load {load0} -> {result['machine']['load_avg_1min_end']}, "
        f"cpu share {cpu_share:.0%}; machine now/profile {drift}"
    )
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
