"""DST on a deliberately imbalanced batch: measured compute of the slowest rank.

    python bench/dst_balance.py [--repeats 3] [--steps 6]

Two CPU ranks (torchrun, gloo, DP=2). Every step rank 0 trains one 2048-token document
(attention-heavy) and rank 1 a row of 32 short documents. Static budget beta0 = 0.9 vs
DST: DST lowers rank 0's budget and raises rank 1's. Runs alternate (static, dst, ...)
`--repeats` times; the table gives each run's median slowest-rank compute after warm-up
and the run-paired ratio. Writes bench/results/dst_balance.json.

tests/test_dst_balance.py checks the same scenario deterministically (budgets, kept
block pairs, recall); only this script measures time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from sb_titan.data.indexed import IndexedWriter
from sb_titan.runtime.tensorboard import read_scalars

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "dst_balance.json"
SEQ = 2048
SHORT = 64
WARMUP = 1
CONFIG = """
[model]
flavor = "debug"
[sparse_attention]
policy = "topk"
dense_layers = []
[training]
seq_len = {seq}
local_batch_size = 1
steps = {steps}
mixed_precision_param = "float32"
[dataloader]
dataset = "indexed"
dataset_path = "{data}"
sample_log = true
[sab]
policy = "sequential"
shuffle = false
[cost_model]
analytic_device = "cpu"
[dst]
enabled = {dst}
beta0 = {beta0}
beta_min = 0.15
beta_max = 1.0
verify_ranks = true
[metrics]
log_freq = 1
"""


def write_dataset(out: Path, steps: int) -> Path:
    """Alternating samples: one SEQ-token document (rank 0's row), then SEQ/SHORT short
    ones (rank 1's row), so sequential packing gives each rank the same kind every step."""
    rng = np.random.default_rng(0)
    writer = IndexedWriter(out)
    for _ in range(steps + 2):
        writer.add(rng.integers(3, 1000, SEQ))
        for _ in range(SEQ // SHORT):
            writer.add(rng.integers(3, 1000, SHORT))
    writer.close({"tokenizer": "random ids", "source": "bench/dst_balance.py"})
    return out


def write_config(path: Path, data: Path, steps: int, dst: bool, beta0: float) -> Path:
    text = CONFIG.format(seq=SEQ, steps=steps, data=data, dst=str(dst).lower(), beta0=beta0)
    path.write_text(text)
    return path


def launch(config: Path, dump: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sb_titan.tools.launch", "--standalone", "--nproc_per_node=2"]
    cmd += ["--", "--config_file", str(config), "--dump_folder", str(dump)]  # as run_train.sh
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def slowest_rank_s(dump: Path) -> float:
    series = read_scalars(dump)["balance/rank_compute_max_s"]
    return statistics.median(v for step, v in sorted(series.items()) if step > WARMUP)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    runs: dict[str, list[float]] = {"static": [], "dst": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = write_dataset(tmp / "data", args.steps)
        for r in range(args.repeats):
            for name in runs:
                cfg = write_config(tmp / f"{name}.toml", data, args.steps, name == "dst", 0.9)
                proc = launch(cfg, tmp / f"{name}{r}")
                if proc.returncode != 0:
                    print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                    return 1
                runs[name].append(slowest_rank_s(tmp / f"{name}{r}"))
                print(f"run {r} {name}: slowest rank {runs[name][-1]:.3f} s", file=sys.stderr)
    ratios = [d / s for d, s in zip(runs["dst"], runs["static"], strict=True)]
    print("| run | static slowest rank s | DST slowest rank s | DST / static |")
    print("|---|---|---|---|")
    for i, (s, d, q) in enumerate(zip(runs["static"], runs["dst"], ratios, strict=True)):
        print(f"| {i} | {s:.3f} | {d:.3f} | {q:.3f} |")
    print(f"median ratio {statistics.median(ratios):.3f} over {len(ratios)} paired runs")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "scenario": f"DP=2 CPU, rank 0: one {SEQ}-token doc, rank 1: {SEQ // SHORT} x {SHORT}",
        "steps": args.steps,
        "warmup_steps": WARMUP,
        "host": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
        "static_slowest_rank_s": runs["static"],
        "dst_slowest_rank_s": runs["dst"],
        "dst_over_static": ratios,
        "median_ratio": statistics.median(ratios),
    }
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
