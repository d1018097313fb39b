"""The end-to-end benchmark of the recipe's variants on real torchrun processes (CPU, 2 ranks).

    python bench/e2e.py [--quick] [--scenarios dp2,pp2] [--variants a,b] [--steps N] [--repeats R]

For each scenario (DP=2 with 2 micro-batches per rank; PP=2 with 4 micro-batches) it
launches ./run_train.sh with train_configs/e2e_cpu.toml once per variant — baseline
(sequential packing, static beta0), SAB only, DST only, SAB+DST (the config's
recall-neutral anchor), SAB+DST with the paper's mean anchor, and SAB+DST with
per-document budgets — reads the TensorBoard events each run wrote (estimated recall,
and true recall and top-key hits measured on sampled queries) and writes
bench/results/e2e.json, a markdown table (stdout; it goes into docs/results.md) and
docs/e2e.png. Step time is the median over the steps
after warm-up; throughput is real tokens over seconds summed over those steps. With
--repeats R every variant runs R times, interleaved, and figures are medians over runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sb_titan.runtime.tensorboard import read_scalars

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs" / "e2e_cpu.toml"
OUT = REPO / "bench" / "results" / "e2e.json"
WARMUP = 2

SCENARIOS = {
    "dp2": [],  # DP=2 (FSDP), 2 micro-batches (gradient accumulation) per rank
    "pp2": [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
        "--training.local_batch_size",
        "4",
        "--training.global_batch_size",
        "-1",
        # profiles/e2e_cpu.json timed the whole model (pp = 1): another stage layout,
        # used on purpose as the committed PP figures were (the refit scales it to a stage)
        "--cost_model.allow_shape_mismatch",
    ],
}
VARIANTS = {
    "baseline": ["--sab.policy", "sequential"],
    "sab": ["--sab.policy", "sab"],
    "dst": ["--sab.policy", "sequential", "--dst.enabled"],
    "sab_dst": ["--sab.policy", "sab", "--dst.enabled"],
    # The paper's time-neutral anchor beside the config's recall-neutral one.
    "sab_dst_mean": ["--sab.policy", "sab", "--dst.enabled", "--dst.anchor", "mean"],
    # Each document its own budget ([dst] per_document); documents of half a row or
    # more are this setting's long ones and keep at least 0.5.
    "sab_dst_doc": [
        "--sab.policy", "sab", "--dst.enabled", "--dst.per_document",
        "--dst.long_tokens", "2048", "--dst.long_floor", "0.5",
    ],
}  # fmt: skip


def _after_warmup(series: dict[int, float]) -> list[float]:
    return [v for step, v in sorted(series.items()) if step > WARMUP]


def _median_after_warmup(series: dict[int, float]) -> float:
    values = _after_warmup(series)
    return float(statistics.median(values)) if values else float("nan")


OTHER_CPU_FLAG = 0.10  # a run is flagged when other work took more of the machine's CPU


def _machine_busy_s() -> float:
    """CPU seconds the machine's processes have been busy (Linux /proc/stat: user, nice,
    system, irq, softirq; not idle, iowait or a hypervisor's steal; nan elsewhere)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    return (sum(fields[:3]) + sum(fields[5:7])) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children (and theirs, as each reaped its
    own): the run's ranks, launcher and shell."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_watching_load(args: list[str], env: dict) -> tuple[subprocess.CompletedProcess, dict]:
    """Run one training and record what else shared the CPUs: the 1-minute load average
    before and at its end (the run's own ranks raise it), and the share of the machine's
    CPU that went to other processes during it (machine busy time minus the run's own)."""
    before, busy0, own0, t0 = os.getloadavg()[0], _machine_busy_s(), _children_cpu_s(), time.time()
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.time() - t0
    other = _machine_busy_s() - busy0 - (_children_cpu_s() - own0)
    return proc, {
        "load_before": before,
        "load_1min": os.getloadavg()[0],
        "other_cpu_share": max(0.0, other) / (wall * (os.cpu_count() or 1)),
    }


def run_variant(scenario: str, variant: str, steps: int, root: Path) -> dict:
    dump = root / scenario / variant
    if dump.exists():
        subprocess.run(["rm", "-rf", str(dump)], check=True)
    args = [
        "./run_train.sh",
        "--dump_folder",
        str(dump),
        "--training.steps",
        str(steps),
        *SCENARIOS[scenario],
        *VARIANTS[variant],
    ]
    env = dict(os.environ, CONFIG_FILE=str(CONFIG), NGPU="2", OMP_NUM_THREADS="1")
    t0 = time.time()
    attempts = 0
    while attempts < 2:  # a gloo teardown abort after training was seen once
        attempts += 1
        proc, load = run_watching_load(args, env)
        if proc.returncode == 0:
            break
        print(f"    {scenario}/{variant} exited {proc.returncode} (attempt {attempts})", flush=True)
    if proc.returncode != 0:
        sys.exit(f"{scenario}/{variant} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    s = read_scalars(dump)
    med = lambda tag: _median_after_warmup(s.get(tag, {}))  # noqa: E731
    loss = s["loss_metrics/global_avg_loss"]
    # Throughput over the whole measured window (sum / sum): steps differ widely in
    # content, and a ratio of medians would pair tokens and seconds of different steps.
    seconds = _after_warmup(s["time_metrics/end_to_end(s)"])
    tokens = _after_warmup(s["data/real_tokens"])
    return {
        "step_time_s": med("time_metrics/end_to_end(s)"),
        "tokens_per_s": sum(tokens) / sum(seconds),
        "padding_share": med("data/padding_share"),
        "ideal_bound_s": med("balance/ideal_step_s"),
        "imbalance_max_over_mean": med("balance/rank_imbalance"),
        "microbatch_imbalance": med("balance/microbatch_imbalance"),
        "rank_compute_max_s": med("balance/rank_compute_max_s"),
        "rank_compute_mean_s": med("balance/rank_compute_mean_s"),
        "bubble_share": med("balance/bubble_share"),
        "mean_recall": med("sparsity/recall"),
        # measured on sampled queries (exact kept mass; their top key kept or not)
        "mean_true_recall": med("sparsity/true_recall"),
        "mean_top_key_hit": med("sparsity/top_key_hit"),
        "mean_density": med("sparsity/density"),
        "mean_budget": med("dst/budget_mean"),
        "cost_model_ape": med("cost_model/ape_mean"),
        "final_loss": loss[max(loss)],
        "wall_s": time.time() - t0,
        "attempts": attempts,
        **load,
    }


def combine(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """One row per variant from its repeats: medians of the per-run figures, and the
    speedup as the median of ratios paired by repeat (run r of a variant against run
    r of the baseline, which ran minutes apart rather than half an hour)."""
    rows = {}
    for variant, rs in runs.items():
        row = {k: float(statistics.median(r[k] for r in rs)) for k in rs[0]}
        row["other_cpu_max"] = max(r.get("other_cpu_share", float("nan")) for r in rs)
        paired = [
            r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, runs["baseline"], strict=True)
        ]
        # Per real token: SAB packs rows fuller, so a step carries more tokens.
        row["speedup_vs_baseline"] = float(statistics.median(paired))
        row["speedup_runs"] = paired
        row["step_speedup_vs_baseline"] = (
            rows.get("baseline", row)["step_time_s"] / row["step_time_s"]
        )
        rows[variant] = row
    return rows


def markdown(results: dict) -> str:
    """The tables of docs/results.md."""
    lines = []
    for scenario, variants in results["scenarios"].items():
        lines += [
            f"**{scenario}** ({results['steps']} steps, {results.get('repeats', 1)} run(s) "
            f"per variant, figures after {WARMUP} warm-up steps)",
            "",
            "| variant | step s | real tokens/s | speedup (tokens/s) [runs] | ideal s | "
            "step / ideal | rank max/mean | micro-batch max/mean | non-compute share | "
            "padding | estimated recall | true recall | top-key hit | mean density | "
            "final loss | load before / end | other CPU, max run |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in variants.items():
            runs = " / ".join(f"{x:.2f}" for x in r.get("speedup_runs", []))
            lines.append(
                f"| {name} | {r['step_time_s']:.2f} | {r['tokens_per_s']:.0f} | "
                f"{r['speedup_vs_baseline']:.3f} [{runs}] | {r['ideal_bound_s']:.2f} | "
                f"{r['step_time_s'] / r['ideal_bound_s']:.3f} | "
                f"{r['imbalance_max_over_mean']:.3f} | {r['microbatch_imbalance']:.3f} | "
                f"{r['bubble_share']:.3f} | {r['padding_share']:.3f} | "
                f"{r['mean_recall']:.3f} | {r.get('mean_true_recall', float('nan')):.3f} | "
                f"{r.get('mean_top_key_hit', float('nan')):.3f} | {r['mean_density']:.3f} | "
                f"{r['final_loss']:.3f} | {r.get('load_before', float('nan')):.1f} / "
                f"{r.get('load_1min', float('nan')):.1f} | {_other_cpu(r)} |"
            )
        lines.append("")
    return "\n".join(lines)


def _other_cpu(row: dict) -> str:
    """The worst run's share of the machine's CPU taken by other work, flagged above
    OTHER_CPU_FLAG (nan for runs recorded before it was measured)."""
    share = row.get("other_cpu_max", float("nan"))
    return f"{share:.0%}" + (" **under load**" if share > OTHER_CPU_FLAG else "")


def plot(results: dict, out: Path) -> None:
    """Real tokens/s and mean recall per variant, one panel per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = results["scenarios"]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(5 * len(scenarios), 3.6), squeeze=False)
    for ax, (name, rows) in zip(axes[0], scenarios.items(), strict=True):
        names = list(rows)
        tps = [rows[n]["tokens_per_s"] for n in names]
        colors = ["#888", "#4a90d9", "#e08a3c", "#3aa35b", "#9b59b6", "#c0392b"]
        bars = ax.bar(names, tps, color=colors[: len(names)])
        for bar, n in zip(bars, names, strict=True):
            r = rows[n]
            ax.annotate(
                f"{r['speedup_vs_baseline']:.2f}x\nrecall {r['mean_recall']:.3f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.tick_params(axis="x", labelrotation=25)  # six variant names side by side
        ax.set_title(f"{name}: real tokens/s after warm-up")
        ax.set_ylim(0, max(tps) * 1.25)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 steps, DP scenario only")
    parser.add_argument("--scenarios", default="dp2,pp2")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="a subset; baseline is always run"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--repeats", type=int, default=1, help="runs per variant, interleaved (the host is noisy)"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--root", type=Path, default=REPO / "outputs" / "bench_e2e")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "e2e.png")
    parser.add_argument(
        "--plot-only", action="store_true", help="redraw the plot and print the tables from --out"
    )
    args = parser.parse_args()
    if args.plot_only:
        results = json.loads(args.out.read_text())
        plot(results, args.plot)
        print(markdown(results))
        return
    steps = 6 if args.quick else args.steps
    scenarios = ["dp2"] if args.quick else args.scenarios.split(",")
    variants = ["baseline", *(v for v in args.variants.split(",") if v != "baseline")]
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"--variants: unknown {unknown}; expected some of {list(VARIANTS)}")
    results = {
        "config": str(CONFIG.relative_to(REPO)),
        "steps": steps,
        "warmup": WARMUP,
        "repeats": args.repeats,
        "load_average_1min": os.getloadavg()[0],
        "scenarios": {},
    }
    total = len(scenarios) * len(variants) * args.repeats
    done = 0
    for scenario in scenarios:
        runs: dict[str, list[dict]] = {v: [] for v in variants}
        for repeat in range(args.repeats):  # variants interleaved, so drift hits all alike
            for variant in variants:
                print(f"[{done + 1}/{total}] {scenario}/{variant} ...", flush=True)
                r = run_variant(scenario, variant, steps, args.root / f"r{repeat}")
                runs[variant].append(r)
                done += 1
                print(
                    f"    step {r['step_time_s']:.2f}s  {r['tokens_per_s']:.0f} tok/s  "
                    f"imbalance {r['imbalance_max_over_mean']:.3f}  recall {r['mean_recall']:.3f}"
                    f"  ({r['wall_s']:.0f}s)",
                    flush=True,
                )
        results["scenarios"][scenario] = combine(runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    plot(results, args.plot)
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
