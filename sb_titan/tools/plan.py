"""`sb-plan`: how well each planner policy balances a dataset, without training.

Plans --steps steps per policy over a dataset's lengths (an sb-prep directory, or the
synthetic longtail-v1 corpus) for one cluster shape, and prints predicted imbalance
(max/mean) across DP ranks and across micro-batches, the micro-batch lower bound set by
the heaviest single piece, the padding share and the planning throughput. Predictions
use the analytic cost model of sb_titan.balance.sab.AnalyticCost (stated in the output).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from sb_titan.balance.sab import POLICIES, AnalyticCost, SABConfig, plan_stats, summarize
from sb_titan.data.longtail import longtail_v1

if TYPE_CHECKING:  # these import torch: the work needs it, --help does not
    from sb_titan.balance.balancer import Balancer
    from sb_titan.balance.step_shape import StepShape

DEFAULT_WORLD = 8
TIMING_REPEATS = 3  # planning throughput is the best of this many runs (least disturbed)


def evaluate(
    lengths: np.ndarray,
    shape: StepShape,
    sab: SABConfig,
    steps: int,
    attention_share: float = 0.6,
    setup: Callable[[Balancer], None] | None = None,
) -> dict[str, float]:
    """Plan `steps` steps with the trainer's balancer, priced by the analytic cost
    (no cost model: no DST); mean per-step statistics plus planning samples/s. `setup`
    prepares each fresh balancer (e.g. feeds it observed densities)."""
    from sb_titan.balance.balancer import Balancer

    cost = AnalyticCost(shape.seq_len, attention_share)
    best = float("inf")
    for _ in range(TIMING_REPEATS):
        b = Balancer(lengths, shape, sab, cost_fn=cost)
        if setup is not None:
            setup(b)
        start = time.perf_counter()
        plans = [b.next_step().plan for _ in range(steps)]
        best = min(best, time.perf_counter() - start)
    stats = [plan_stats(plan, shape.seq_len, cost) for plan in plans]
    out = summarize(stats)
    out["samples_per_s"] = sum(s.pieces for s in stats) / best
    out["dropped"] = b.planner.dropped
    return out


def load_lengths(data: str, seq_len: int, docs: int, seed: int) -> tuple[np.ndarray, str]:
    if data == "synthetic":
        return longtail_v1(docs, seq_len, seed), f"synthetic longtail-v1 (n={docs}, seed={seed})"
    from sb_titan.data.indexed import IndexedDataset

    ds = IndexedDataset(data)
    return ds.lengths, ds.name


def shape_from_config(
    path: Path | None, world_size: int | None, checkpoint: Path | None = None
) -> tuple[StepShape, SABConfig, dict]:
    """The shape the trainer would give the loader, from a TOML train config or a
    checkpoint's own (its run record, on the world size it was saved with unless
    `world_size` says otherwise; a `path` given too must agree with it)."""
    from sb_titan.balance.step_shape import step_shape
    from sb_titan.config.toml import load_config

    if checkpoint is None:
        config = load_config(path)
    else:
        from sb_titan.config.recorded import SHAPE_KEYS, checkpoint_config
        from sb_titan.eval.checkpoint import resolve_checkpoint
        from sb_titan.runtime.run_record import read_record

        step_dir = resolve_checkpoint(checkpoint)
        config = checkpoint_config(step_dir, path, keys=SHAPE_KEYS)
        record = read_record(step_dir)
        if world_size is None and record is not None:
            world_size = record["layout"]["world"]
    shape = step_shape(config, world_size or DEFAULT_WORLD)
    loader = config.dataloader
    synthetic = {"docs": loader.synthetic_docs, "seed": loader.synthetic_seed}
    return shape, config.sab, synthetic


def print_table(rows: dict[str, dict[str, float]], file=None) -> None:
    file = file or sys.stdout  # looked up per call: a default would bind the stdout of import time
    head = f"{'policy':<12}{'rank max/mean':>14}{'mb max/mean':>13}{'mb bound':>10}"
    head += f"{'padding':>9}{'samples/s':>11}"
    print(head, file=file)
    for name, r in rows.items():
        speed = "-" if r["samples_per_s"] is None else f"{r['samples_per_s']:,.0f}"
        print(
            f"{name:<12}{r['rank_imbalance']:>14.4f}{r['microbatch_imbalance']:>13.4f}"
            f"{r['microbatch_bound']:>10.4f}{r['padding']:>9.2%}{speed:>11}",
            file=file,
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sb-plan", description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="an sb-prep directory, or 'synthetic'")
    ap.add_argument("--config", type=Path, help="TOML train config (shape and [sab])")
    ap.add_argument(
        "--checkpoint", type=Path, help="a checkpoint: its own config and world size (run record)"
    )
    ap.add_argument("--world-size", type=int, help="ranks (default: the checkpoint's, else 8)")
    ap.add_argument("--policy", default="all", choices=[*POLICIES, "all"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", type=Path, metavar="OUT", help="also write the results here")
    ap.add_argument("--seq-len", type=int, help="row length (default 65536, or the config's)")
    ap.add_argument("--dp", type=int, help="data-parallel ranks (default 8)")
    ap.add_argument("--microbatches", type=int, help="micro-batches per rank and step (8)")
    ap.add_argument("--rows", type=int, help="rows per micro-batch (default 1)")
    ap.add_argument("--max-tokens", type=int, help="token cap per micro-batch")
    ap.add_argument("--long-docs", choices=["split", "truncate", "drop"])
    ap.add_argument("--docs", type=int, help="synthetic documents (default 20000)")
    ap.add_argument("--seed", type=int, help="synthetic corpus and sample-order seed (0)")
    ap.add_argument(
        "--attention-share",
        type=float,
        default=0.6,
        help="attention share of a full one-document row in the cost model",
    )
    args = ap.parse_args(argv)
    from sb_titan.balance.step_shape import StepShape

    shape, sab, synthetic = StepShape(65536, 8, 8, 1), SABConfig(), {"docs": 20000, "seed": 0}
    if args.config is not None or args.checkpoint is not None:
        try:
            shape, sab, synthetic = shape_from_config(args.config, args.world_size, args.checkpoint)
        except (ValueError, FileNotFoundError) as e:  # ConfigError: one line naming file, key
            print(f"sb-plan: error: {e}", file=sys.stderr)
            return 2
    shape = StepShape(
        seq_len=args.seq_len or shape.seq_len,
        dp=args.dp or shape.dp,
        microbatches=args.microbatches or shape.microbatches,
        rows=args.rows or shape.rows,
    )
    seed = synthetic["seed"] if args.seed is None else args.seed
    docs = args.docs or synthetic["docs"]
    try:
        lengths, source = load_lengths(args.data, shape.seq_len, docs, seed)
    except ValueError as e:
        print(f"sb-plan: error: {e}", file=sys.stderr)
        return 1
    policies = POLICIES if args.policy == "all" else (args.policy,)
    results = {}
    for policy in policies:
        config = SABConfig(
            policy=policy,
            long_docs=args.long_docs or sab.long_docs,
            shuffle=sab.shuffle,
            seed=sab.seed if args.seed is None else args.seed,
            max_tokens=args.max_tokens or sab.max_tokens,
        )
        results[policy] = evaluate(lengths, shape, config, args.steps, args.attention_share)
    print(f"data: {source}; {len(lengths)} samples, {int(lengths.sum())} tokens")
    print(
        f"shape: seq_len={shape.seq_len} dp={shape.dp} microbatches={shape.microbatches} "
        f"rows={shape.rows}; {args.steps} steps"
    )
    print(
        f"cost model: latency = tokens + a·Σ density·len², attention = "
        f"{args.attention_share:.0%} of a full one-document row; densities 1.0"
    )
    print_table(results)
    if args.json is not None:
        payload = {
            "data": source,
            "shape": {f: getattr(shape, f) for f in StepShape.__dataclass_fields__},
            "steps": args.steps,
            "attention_share": args.attention_share,
            "policies": results,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
