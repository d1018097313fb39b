"""`sb-simulate`: SAB and DST at 8-1024 GPUs, replayed on a CPU.

Per step: documents come from a length distribution (longtail-v1 or an indexed
dataset's lengths), the project's own `sab.Planner` packs them (policy `sequential`,
or `tokens`, for the baseline and DST-only, `sab` for SAB and SAB+DST), the project's own
`dst.tune_budgets` gives every work unit its budget (DST off: beta0 everywhere), the
project's own `CostModel` times every micro-batch on every pipeline stage, and the
pipeline schedule is replayed event by event in the order torch.distributed.pipelining
runs it (1F1B, Interleaved1F1B, GPipe). DP ranks wait for the slowest at the
gradient reduction. Nothing here re-implements planning, budgeting or cost prediction:
the simulator only adds the schedule replay and the cluster's communication.
See docs/simulate.md for the method, the assumptions and results.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sb_titan.simulator.cluster import Cluster, Scenario

# The choices --help lists, named here so that --help answers without importing the
# simulator (it loads torch and TorchTitan's model code); tests/test_cli.py holds them
# equal to the simulator's SCHEDULES, sorted ANALYTIC_DEVICES, BASELINE_POLICIES, ANCHORS.
SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe")
DEVICES = ("cpu", "h100", "h200")
BASELINE_POLICIES = ("sequential", "tokens")
FAMILIES = ("llama3", "qwen2_5", "qwen3")
ANCHORS = ("min", "mean", "median", "max", "recall")
RECALL_MEASURES = ("top_key", "true", "estimated")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sb-simulate",
        description="Simulate baseline / SAB / DST / SAB+DST step times for a cluster shape "
        "with the project's planner, DST and cost model and an event-level pipeline replay.",
    )
    p.add_argument("--config", help="TOML train config (model, sab, dst, sparse_attention, pp)")
    p.add_argument(
        "--family",
        choices=FAMILIES,
        help="model family of --flavor (the config's, else qwen2_5)",
    )
    p.add_argument(
        "--flavor",
        help="a named size of --family instead of the config's model (default 3b)",
    )
    p.add_argument("--dp", type=int, required=True, help="data-parallel ranks")
    p.add_argument("--pp", type=int, help="pipeline stages (config, else 1)")
    p.add_argument("--microbatches", type=int, help="micro-batches per step and DP rank")
    p.add_argument("--schedule", choices=SCHEDULES, help="pipeline schedule (config, else 1F1B)")
    p.add_argument("--virtual-stages", type=int, default=2, help="chunks per rank (Interleaved)")
    p.add_argument("--rows", type=int, help="rows of seq_len per micro-batch (default 1)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--profile", help="sb-profile JSON (one stage) instead of the analytic model")
    src.add_argument("--device", choices=DEVICES, help="analytic device (default h200)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq-len", type=int, help="row length R (config, else 65536)")
    p.add_argument("--data", help="sb-prep dataset directory (lengths only); default longtail-v1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--baseline-policy",
        choices=BASELINE_POLICIES,
        default="sequential",
        help="planner policy of the baseline and DST-only variants",
    )
    p.add_argument("--anchor", choices=ANCHORS, help="DST anchor (config, else mean)")
    p.add_argument(
        "--per-document",
        action="store_true",
        help="also simulate SAB+DST with per-document budgets (sab_dst_doc; "
        "[dst] per_document of the config does the same)",
    )
    _recall_args(p)
    p.add_argument(
        "--density-exponent",
        type=float,
        default=1.0,
        help="density-model prior rho = beta**k (1.0: the cost model's default)",
    )
    p.add_argument(
        "--bwd-over-fwd",
        type=float,
        default=2.0,
        help="backward / forward time (3.0 with full activation checkpointing)",
    )
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: simulate DP x CP groups training one row each "
        "(dense/sparse x zigzag/balanced split) instead of the pipeline variants",
    )
    net = "GB/s (default: sb_titan.simulator.Network's)"
    p.add_argument("--cp-gbps", type=float, help=f"CP ring {net}")
    p.add_argument("--p2p-gbps", type=float, help=f"between pipeline stages, {net}")
    p.add_argument("--allreduce-gbps", type=float, help=f"gradient all-reduce, {net}")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--plot", help="write a Gantt chart of step 0 per variant (PNG)")
    p.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    return p


def _recall_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--recall-curves",
        help="measured per-document recall curves (bench/recall_curves.py's JSON): DST's "
        "recall model learns their fit half, their held-out half scores every step",
    )
    p.add_argument(
        "--recall-measure",
        choices=RECALL_MEASURES,
        help="what DST's recall model and `recall` anchor follow (config, else top_key)",
    )
    p.add_argument(
        "--recall-by-budget",
        action="store_true",
        help="DST's recall model learns by budget as well as by length ([dst] recall_by_budget)",
    )


def _recall_settings(args: argparse.Namespace, sc: Scenario) -> None:
    """The recall flags over the config's [dst]; bad curves end here, in one line."""
    if args.recall_measure:
        sc.dst = dataclasses.replace(sc.dst, recall_measure=args.recall_measure)
    if args.recall_by_budget:
        sc.dst = dataclasses.replace(sc.dst, recall_by_budget=True)
    if args.recall_curves:
        from sb_titan.simulator.heldout import RecallCurves

        RecallCurves.load(args.recall_curves)
        sc.recall_curves = args.recall_curves


def _resolve(args: argparse.Namespace) -> tuple[Cluster, Scenario]:
    """CLI > config > defaults."""
    from sb_titan.simulator.cluster import SCHEDULES, Cluster, Network, Scenario, model_dims_of

    links = dict(p2p_gbps=args.p2p_gbps, allreduce_gbps=args.allreduce_gbps, cp_gbps=args.cp_gbps)
    sc = Scenario(
        seed=args.seed,
        steps=args.steps,
        baseline_policy=args.baseline_policy,
        density_exponent=args.density_exponent,
        bwd_over_fwd=args.bwd_over_fwd,
        network=Network(**{k: v for k, v in links.items() if v is not None}),
    )
    pp, schedule, seq_len, mbs, rows = 1, "1F1B", 65536, 8, 1
    if args.config:
        from sb_titan.balance.step_shape import step_shape
        from sb_titan.config.toml import load_config
        from sb_titan.models.registry import model_dims

        cfg = load_config(args.config)
        par = cfg.parallelism
        pp, schedule = par.pipeline_parallel_degree, par.pipeline_parallel_schedule
        non_dp = pp * par.tensor_parallel_degree * par.context_parallel_degree
        # The trainer's step (gradient accumulation included) for --dp ranks of data
        # parallelism; --pp below only overrides the stage count of the replay.
        step = step_shape(cfg, args.dp * non_dp)
        seq_len, mbs, rows = step.seq_len, step.microbatches, step.rows
        # the model the run builds: [model] with its overrides, an HF load's config.json
        sc.dims = model_dims(cfg)
        sc.family, sc.flavor = sc.dims.family, cfg.model.flavor
        sc.sab = cfg.sab
        sc.dst, sc.selection = cfg.dst, cfg.sparse_attention.policy
        sc.block_size = cfg.sparse_attention.block_size
        sc.first_less = par.pipeline_parallel_first_stage_less_layers
        sc.last_less = par.pipeline_parallel_last_stage_less_layers
        if cfg.cost_model.profile and not args.device:
            sc.profile = cfg.cost_model.profile
    if args.anchor:
        sc.dst = dataclasses.replace(sc.dst, anchor=args.anchor)
    if args.per_document:
        sc.dst = dataclasses.replace(sc.dst, per_document=True)
    _recall_settings(args, sc)
    if args.flavor or args.family:  # a named size instead of the config's model
        sc.family = args.family or sc.family
        sc.flavor = (args.flavor or sc.flavor).lower()
        sc.dims = model_dims_of(sc.family, sc.flavor)
    if args.profile:
        sc.profile, sc.device = args.profile, None
    elif sc.profile is None:
        sc.device = args.device or "h200"
    else:
        sc.device = None
    pp = args.pp or pp
    schedule = args.schedule or schedule
    if schedule not in SCHEDULES:
        raise SystemExit(f"sb-simulate: schedule {schedule!r} is not one of {SCHEDULES}")
    cluster = Cluster(
        dp=args.dp,
        pp=pp,
        microbatches=args.microbatches or mbs,
        schedule=schedule,
        virtual_stages=args.virtual_stages if schedule == "Interleaved1F1B" else 1,
        rows=args.rows or rows,
        seq_len=args.seq_len or seq_len,
    )
    if args.data:
        from sb_titan.data.indexed import IndexedDataset

        ds = IndexedDataset(args.data)
        sc.lengths, sc.data_name = ds.lengths, ds.name
    else:
        sc.data_name = f"longtail-v1 (R={cluster.seq_len}, seed={args.seed})"
    return cluster, sc


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cluster, sc = _resolve(args)
    except ValueError as e:
        print(f"sb-simulate: {e}", file=sys.stderr)
        return 2
    if args.cp > 1:
        return _main_cp(args, cluster, sc)
    from sb_titan.simulator.report import format_table, plot_timelines
    from sb_titan.simulator.run import simulate

    rep, first = simulate(cluster, sc, progress=not args.quiet)
    src = sc.profile or f"analytic {sc.device}"
    title = (
        f"{sc.model_name} DP={cluster.dp} x PP={cluster.pp} {cluster.schedule}, "
        f"{cluster.microbatches} micro-batches x {cluster.rows} x {cluster.seq_len} tokens, "
        f"{sc.data_name}, {src}"
    )
    print(title)
    print(format_table(rep))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
    if args.plot:
        plot_timelines(first, cluster, args.plot, title)
    return 0


def _main_cp(args: argparse.Namespace, cluster: Cluster, sc: Scenario) -> int:
    """`--cp N`: DP x CP groups, each training one row per micro-batch (no PP)."""
    from sb_titan.simulator.context import CPCluster, CPScenario, format_cp_table, simulate_cp

    if cluster.pp != 1 or cluster.rows != 1:
        print("sb-simulate: --cp needs --pp 1 and one row per micro-batch", file=sys.stderr)
        return 2
    if sc.device is None:
        print("sb-simulate: --cp prices attention with the analytic model; use --device, "
              "not --profile", file=sys.stderr)  # fmt: skip
        return 2
    cp = CPCluster(cp=args.cp, dp=cluster.dp, microbatches=cluster.microbatches,
                   seq_len=cluster.seq_len)  # fmt: skip
    csc = CPScenario(family=sc.family, flavor=sc.flavor, dims=sc.dims, device=sc.device,
                     budget=sc.dst.beta0, block_size=sc.block_size,
                     density_exponent=sc.density_exponent, steps=sc.steps, seed=sc.seed,
                     network=sc.network)  # fmt: skip
    try:
        rep = simulate_cp(cp, csc)
    except ValueError as e:
        print(f"sb-simulate: {e}", file=sys.stderr)
        return 2
    a = rep["assumptions"]
    print(
        f"{sc.model_name} CP={cp.cp} x DP={cp.dp} ({cp.gpus} GPUs), "
        f"{cp.microbatches} rows of {cp.seq_len} tokens per CP group and step, "
        f"{sc.data_name}, analytic {sc.device}, `mass` budget {csc.budget:g} "
        f"(predicted density of a full-row document {a['density_at_budget_full_row']:.3f}); "
        f"CP K/V traffic {a['cp_comm_bytes_per_microbatch'] / 1e9:.2f} GB per rank and row, "
        f"{a['cp_comm_seconds_per_microbatch']:.3f} s, not overlapped"
    )
    print(format_cp_table(rep))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
    return 0
