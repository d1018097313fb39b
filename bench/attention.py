"""Forward+backward latency: dense causal SDPA vs the PyTorch block-sparse path (CPU).

One document per row (the case dense causal SDPA covers exactly), Qwen2.5-0.5B heads
(14 q / 2 kv, head_dim 64), fp32, B=1, block 64. `topk` selection pins the block
density to the requested value; selection time is reported separately (select_s) and
is not part of fwd_bwd_s. Each configuration is timed as the median of `--repeats`
runs after one warm-up, for every torch thread count in `--threads`. Besides wall
time the process CPU time is recorded: on a shared machine it is the steadier number.

    python bench/attention.py            # L in {4096, 8192}, density in {1, .5, .25, .1}
    python bench/attention.py --quick    # L=2048, two densities, 2 repeats, no files
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sb_titan.attention.ops import block_sparse_attention
from sb_titan.attention.selection import select_blocks

HQ, HKV, HEAD_DIM, BLOCK = 14, 2, 64, 64
RESULTS = Path(__file__).parent / "results"


def _time(step, repeats: int) -> tuple[float, float]:
    """Median (wall, process CPU) seconds of `step` after one warm-up call."""
    step()
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        step()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def _fwd_bwd(attn, q, k, v, grad):
    def step():
        for x in (q, k, v):
            x.grad = None
        attn(q, k, v).backward(grad)

    return step


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def run(seq_lens, densities, repeats: int, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    rows = []
    for L in seq_lens:
        torch.manual_seed(0)
        q = torch.randn(1, HQ, L, HEAD_DIM, requires_grad=True)
        k = torch.randn(1, HKV, L, HEAD_DIM, requires_grad=True)
        v = torch.randn(1, HKV, L, HEAD_DIM, requires_grad=True)
        grad = torch.randn(1, HQ, L, HEAD_DIM)
        doc_id = torch.zeros(1, L, dtype=torch.int32)
        dense = _time(_fwd_bwd(_sdpa, q, k, v, grad), repeats)
        rows.append(_row("dense_sdpa", L, 1.0, threads, dense, dense, 0.0))
        print(_fmt(rows[-1]), flush=True)
        for rho in densities:
            t0 = time.perf_counter()
            table, stats = select_blocks(q, k, doc_id, rho, policy="topk", block_size=BLOCK)
            select_s = time.perf_counter() - t0

            def sparse(q, k, v, table=table, doc_id=doc_id):
                return block_sparse_attention(q, k, v, doc_id, table)

            s = _time(_fwd_bwd(sparse, q, k, v, grad), repeats)
            rows.append(
                _row("block_sparse_cpu", L, float(stats.density[0]), threads, s, dense, select_s)
            )
            print(_fmt(rows[-1]), flush=True)
    return rows


def _row(impl, L, density, threads, t, dense, select_s) -> dict:
    return {
        "impl": impl,
        "seq_len": L,
        "density": round(density, 4),
        "threads": threads,
        "fwd_bwd_s": round(t[0], 4),
        "speedup_vs_dense": round(dense[0] / t[0], 2),
        "cpu_s": round(t[1], 4),
        "cpu_speedup_vs_dense": round(dense[1] / t[1], 2),
        "select_s": round(select_s, 4),
    }


HEADER = (
    f"{'impl':<17} {'L':>6} {'density':>8} {'thr':>4} {'fwd_bwd_s':>10} {'speedup':>8} "
    f"{'cpu_s':>8} {'cpu_spd':>8} {'select_s':>9}"
)


def _fmt(r: dict) -> str:
    return (
        f"{r['impl']:<17} {r['seq_len']:>6} {r['density']:>8.3f} {r['threads']:>4} "
        f"{r['fwd_bwd_s']:>10.3f} {r['speedup_vs_dense']:>7.2f}x {r['cpu_s']:>8.3f} "
        f"{r['cpu_speedup_vs_dense']:>7.2f}x {r['select_s']:>9.3f}"
    )


def markdown(rows: list[dict]) -> str:
    """The results as a markdown table (for docs/attention.md)."""
    lines = [
        "| impl | L | density | threads | fwd+bwd s | speedup | CPU s | CPU speedup |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = lambda r: (r["threads"], r["seq_len"], r["impl"] != "dense_sdpa", -r["density"])
    for r in sorted(rows, key=order):
        lines.append(
            f"| {r['impl']} | {r['seq_len']} | {r['density']:.3f} | {r['threads']} | "
            f"{r['fwd_bwd_s']:.3f} | {r['speedup_vs_dense']:.2f}× | {r['cpu_s']:.3f} | "
            f"{r['cpu_speedup_vs_dense']:.2f}× |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Speedup over dense vs density, one line per (L, threads), with the 1/rho bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sparse = [r for r in rows if r["impl"] == "block_sparse_cpu"]
    for L, thr in sorted({(r["seq_len"], r["threads"]) for r in sparse}):
        pts = sorted(
            (r["density"], r["speedup_vs_dense"])
            for r in sparse
            if (r["seq_len"], r["threads"]) == (L, thr)
        )
        ax.plot(*zip(*pts, strict=True), marker="o", label=f"L={L}, {thr} thread(s)")
    dens = sorted({r["density"] for r in sparse})
    ax.plot(dens, [1 / d for d in dens], "k--", lw=1, label="1/density (SDPA's efficiency)")
    ax.set(xscale="log", yscale="log", xlabel="block density", ylabel="speedup vs dense SDPA")
    ax.set_title("CPU fwd+bwd, fp32, 14q/2kv heads, head_dim 64")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="L=2048, 2 densities, 2 repeats")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "attention.json")
    ap.add_argument("--plot", type=Path, default=Path(__file__).parents[1] / "docs/attention.png")
    ap.add_argument("--markdown", action="store_true", help="print --out as a markdown table")
    args = ap.parse_args()
    if args.markdown:
        print(markdown(json.loads(args.out.read_text())["rows"]))
        return
    threads = [int(t) for t in args.threads.split(",")]
    if args.quick:
        seq_lens, densities, repeats = [2048], [1.0, 0.25], 2
    else:
        seq_lens, densities, repeats = [4096, 8192], [1.0, 0.5, 0.25, 0.1], args.repeats
    print(
        f"torch {torch.__version__}, threads {threads}, fp32, B=1, Hq={HQ}, Hkv={HKV}, "
        f"D={HEAD_DIM}, block={BLOCK}, median of {repeats} after 1 warm-up"
    )
    load_start = os.getloadavg()
    print(f"load average (1, 5, 15 min) at start: {load_start}")
    print(HEADER)
    rows = [r for t in threads for r in run(seq_lens, densities, repeats, t)]
    load_end = os.getloadavg()
    print(f"load average at end: {load_end} (cores: {os.cpu_count()})")
    if args.quick:
        return
    meta = {
        "torch": torch.__version__,
        "threads": threads,
        "cpu": platform.processor() or platform.machine(),
        "dtype": "float32",
        "shape": {"B": 1, "Hq": HQ, "Hkv": HKV, "head_dim": HEAD_DIM, "block": BLOCK},
        "policy": "topk",
        "repeats": repeats,
        "cores": os.cpu_count(),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in load_end],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    plot(rows, args.plot)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
