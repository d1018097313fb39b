"""CPU attention latency: dense causal SDPA, the PyTorch block-sparse path, and Flex.

One document per row (the case dense causal SDPA covers exactly), Qwen2.5-0.5B heads
(14 q / 2 kv, head_dim 64), fp32, B=1. `topk` selection pins the block density to the
requested value; selection time is reported separately (select_s) and is not part of
the timings. Variants:

  dense_sdpa        F.scaled_dot_product_attention(is_causal=True): fwd and fwd+bwd
  block_sparse_cpu  sb_titan.attention.block_sparse per (block size, density): fwd and
                    fwd+bwd
  flex_cpu          torch.compile(flex_attention) on a BlockMask of the SAME block table
                    (sb_titan.attention.flex.block_mask: kept pairs inside one document
                    are "full" blocks, the rest get a document-causal mask_mod): fwd
                    only, FlexAttention has no CPU backward. Checked against ours.

For each (L, threads) all variants run round-robin, `--repeats` rounds after one
warm-up (Flex compiles there), and each time is the median over rounds: the ratios come
from the same minutes of a shared machine. Besides wall time the process CPU time is
recorded: on a loaded machine it is the steadier number with one thread.

    python bench/attention.py            # L in {4096, 8192}, density in {1, .5, .25, .1}
    python bench/attention.py --quick    # L=2048, two densities, 2 repeats, no files
    python bench/attention.py --dry-run  # L=256, tiny: the code path only (tests)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from sb_titan.attention.block_sparse import block_sparse_forward
from sb_titan.attention.flex import block_mask, compiled_flex_attention
from sb_titan.attention.ops import block_sparse_attention
from sb_titan.attention.selection import select_blocks

HQ, HKV, HEAD_DIM = 14, 2, 64
RESULTS = Path(__file__).parent / "results"
FLEX_TOL = 1e-5  # max abs difference of Flex's fp32 output from ours


def _round_robin(steps: dict[str, Callable], repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall, process CPU) seconds per step; steps interleaved, one warm-up each."""
    for step in steps.values():
        step()
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            w0, c0 = time.perf_counter(), time.process_time()
            step()
            wall[name].append(time.perf_counter() - w0)
            cpu[name].append(time.process_time() - c0)
    return {n: (statistics.median(wall[n]), statistics.median(cpu[n])) for n in steps}


def _fwd_bwd(attn, q, k, v, grad):
    def step():
        for x in (q, k, v):
            x.grad = None
        attn(q, k, v).backward(grad)

    return step


def _fwd(attn, q, k, v):
    def step():
        with torch.no_grad():
            attn(q, k, v)

    return step


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _flex_peer(q, k, v, doc_id, table, ours: torch.Tensor) -> tuple[Callable | None, dict]:
    """(forward step, facts) of compiled Flex on `table`; facts hold the error if any."""
    try:
        mask = block_mask(table, doc_id, q.shape[1])
        flex = compiled_flex_attention()
        qd, kd, vd = (x.detach() for x in (q, k, v))

        def step():
            return flex(qd, kd, vd, block_mask=mask, scale=HEAD_DIM**-0.5, enable_gqa=True)

        diff = float((step() - ours).abs().max())
    except Exception as e:  # report, do not hide: Flex is a peer, not the subject
        return None, {"error": f"{type(e).__name__}: {e}"[:300]}
    return step, {"max_abs_diff_vs_block_sparse": diff}


def run(seq_lens, densities, blocks, repeats: int, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    rows = []
    for L in seq_lens:
        torch.manual_seed(0)
        q = torch.randn(1, HQ, L, HEAD_DIM, requires_grad=True)
        k = torch.randn(1, HKV, L, HEAD_DIM, requires_grad=True)
        v = torch.randn(1, HKV, L, HEAD_DIM, requires_grad=True)
        grad = torch.randn(1, HQ, L, HEAD_DIM)
        doc_id = torch.zeros(1, L, dtype=torch.int32)
        steps = {"dense/fwd": _fwd(_sdpa, q, k, v), "dense/fb": _fwd_bwd(_sdpa, q, k, v, grad)}
        configs = []
        for bs in blocks:
            for rho in densities:
                t0 = time.perf_counter()
                table, stats = select_blocks(q, k, doc_id, rho, policy="topk", block_size=bs)
                select_s = time.perf_counter() - t0

                def sparse(q, k, v, table=table, doc_id=doc_id):
                    return block_sparse_attention(q, k, v, doc_id, table)

                key = f"{bs}/{rho}"
                steps[f"ours/fwd/{key}"] = _fwd(sparse, q, k, v)
                steps[f"ours/fb/{key}"] = _fwd_bwd(sparse, q, k, v, grad)
                with torch.no_grad():
                    ours, _ = block_sparse_forward(q, k, v, doc_id, table, HEAD_DIM**-0.5)
                flex_step, flex = _flex_peer(q, k, v, doc_id, table, ours)
                if flex_step is not None:
                    steps[f"flex/fwd/{key}"] = flex_step
                configs.append((key, bs, float(stats.density[0]), select_s, flex))
        t = _round_robin(steps, repeats)
        dense_fwd, dense_fb = t["dense/fwd"], t["dense/fb"]
        base = {"seq_len": L, "threads": threads}
        rows.append(
            {"impl": "dense_sdpa", **base, "block": None, "density": 1.0}
            | _times(dense_fwd, dense_fb, dense_fwd, dense_fb)
        )
        print(_fmt(rows[-1]), flush=True)
        for key, bs, density, select_s, flex in configs:
            cfg = {**base, "block": bs, "density": round(density, 4)}
            flex_fwd = t.get(f"flex/fwd/{key}")
            ours = _times(t[f"ours/fwd/{key}"], t[f"ours/fb/{key}"], dense_fwd, dense_fb)
            if flex_fwd is not None:
                ours["fwd_speedup_vs_flex"] = round(flex_fwd[0] / t[f"ours/fwd/{key}"][0], 3)
            rows.append({"impl": "block_sparse_cpu", **cfg, **ours, "select_s": round(select_s, 4)})
            print(_fmt(rows[-1]), flush=True)
            peer = {"impl": "flex_cpu", **cfg, **flex}
            if flex_fwd is not None:
                peer |= _times(flex_fwd, None, dense_fwd, dense_fb)
            rows.append(peer)
            print(_fmt(rows[-1]), flush=True)
    return rows


def _times(fwd, fb, dense_fwd, dense_fb) -> dict:
    """Seconds (wall, CPU) and speedups over dense SDPA; fb is None for forward-only."""
    out = {
        "fwd_s": round(fwd[0], 4),
        "fwd_cpu_s": round(fwd[1], 4),
        "fwd_speedup_vs_dense": round(dense_fwd[0] / fwd[0], 2),
    }
    if fb is not None:
        out |= {
            "fwd_bwd_s": round(fb[0], 4),
            "cpu_s": round(fb[1], 4),
            "speedup_vs_dense": round(dense_fb[0] / fb[0], 2),
            "cpu_speedup_vs_dense": round(dense_fb[1] / fb[1], 2),
        }
    return out


HEADER = (
    f"{'impl':<17} {'L':>6} {'block':>5} {'density':>8} {'thr':>4} {'fwd_s':>8} "
    f"{'vs_flex':>8} {'fwd_bwd_s':>10} {'speedup':>8} {'cpu_s':>8} {'cpu_spd':>8} "
    f"{'notes':>8}"
)


def _fmt(r: dict) -> str:
    def num(key, spec, suffix=""):
        return f"{r[key]:{spec}}{suffix}" if r.get(key) is not None else "-"

    note = ""
    if "error" in r:
        note = f"Flex failed: {r['error']}"
    elif "max_abs_diff_vs_block_sparse" in r:
        d = r["max_abs_diff_vs_block_sparse"]
        note = f"max|flex-ours| {d:.1e}" + ("" if d < FLEX_TOL else f" > {FLEX_TOL:.0e}!")
    elif "select_s" in r:
        note = f"select {r['select_s']:.3f}s"
    return (
        f"{r['impl']:<17} {r['seq_len']:>6} {r['block'] or '-':>5} {r['density']:>8.3f} "
        f"{r['threads']:>4} {num('fwd_s', '.3f'):>8} {num('fwd_speedup_vs_flex', '.2f', 'x'):>8} "
        f"{num('fwd_bwd_s', '.3f'):>10} {num('speedup_vs_dense', '.2f', 'x'):>8} "
        f"{num('cpu_s', '.3f'):>8} {num('cpu_speedup_vs_dense', '.2f', 'x'):>8}  {note}"
    )


def markdown(rows: list[dict]) -> str:
    """The results as a markdown table (for docs/attention.md)."""
    lines = [
        "| impl | L | block | density | threads | fwd s | ours vs Flex fwd | fwd+bwd s | "
        "speedup | CPU s | CPU speedup |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(r, key, spec, suffix=""):
        return f"{r[key]:{spec}}{suffix}" if r.get(key) is not None else "–"

    order = lambda r: (r["threads"], r["seq_len"], r["block"] or 0, -r["density"], r["impl"])
    for r in sorted(rows, key=order):
        lines.append(
            f"| {r['impl']} | {r['seq_len']} | {r['block'] or '–'} | {r['density']:.3f} | "
            f"{r['threads']} | {cell(r, 'fwd_s', '.3f')} | "
            f"{cell(r, 'fwd_speedup_vs_flex', '.2f', '×')} | {cell(r, 'fwd_bwd_s', '.3f')} | "
            f"{cell(r, 'speedup_vs_dense', '.2f', '×')} | {cell(r, 'cpu_s', '.3f')} | "
            f"{cell(r, 'cpu_speedup_vs_dense', '.2f', '×')} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Speedup over dense vs density, one line per (L, threads, block), with 1/rho."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sparse = [r for r in rows if r["impl"] == "block_sparse_cpu"]
    for L, thr, bs in sorted({(r["seq_len"], r["threads"], r["block"]) for r in sparse}):
        pts = sorted(
            (r["density"], r["speedup_vs_dense"])
            for r in sparse
            if (r["seq_len"], r["threads"], r["block"]) == (L, thr, bs)
        )
        ax.plot(*zip(*pts, strict=True), marker="o", label=f"L={L}, {thr} thr, block {bs}")
    dens = sorted({r["density"] for r in sparse})
    ax.plot(dens, [1 / d for d in dens], "k--", lw=1, label="1/density (SDPA's efficiency)")
    ax.set(xscale="log", yscale="log", xlabel="block density", ylabel="speedup vs dense SDPA")
    ax.set_title("CPU fwd+bwd, fp32, 14q/2kv heads, head_dim 64")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="L=2048, 2 densities, 2 repeats")
    mode.add_argument("--dry-run", action="store_true", help="L=256, the code path only")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--blocks", default="64,128", help="comma-separated block sizes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, help="JSON path (default for a full run: results/)")
    ap.add_argument("--plot", type=Path, default=Path(__file__).parents[1] / "docs/attention.png")
    ap.add_argument("--markdown", action="store_true", help="print --out as a markdown table")
    args = ap.parse_args()
    full = not (args.quick or args.dry_run)
    out = args.out or (RESULTS / "attention.json" if full else None)
    if args.markdown:
        print(markdown(json.loads((out or RESULTS / "attention.json").read_text())["rows"]))
        return
    threads = [int(t) for t in args.threads.split(",")]
    blocks = [int(b) for b in args.blocks.split(",")]
    seq_lens, densities, repeats = [4096, 8192], [1.0, 0.5, 0.25, 0.1], args.repeats
    if args.quick:
        seq_lens, densities, repeats = [2048], [1.0, 0.25], 2
    if args.dry_run:
        seq_lens, densities, repeats = [256], [0.5], 1
    print(
        f"torch {torch.__version__}, threads {threads}, fp32, B=1, Hq={HQ}, Hkv={HKV}, "
        f"D={HEAD_DIM}, blocks {blocks}, interleaved, median of {repeats} after 1 warm-up"
    )
    load_start = os.getloadavg()
    print(f"load average (1, 5, 15 min) at start: {load_start}")
    print(HEADER)
    rows = [r for t in threads for r in run(seq_lens, densities, blocks, repeats, t)]
    load_end = os.getloadavg()
    print(f"load average at end: {load_end} (cores: {os.cpu_count()})")
    if out is None:
        return
    meta = {
        "torch": torch.__version__,
        "threads": threads,
        "cpu": platform.processor() or platform.machine(),
        "dtype": "float32",
        "shape": {"B": 1, "Hq": HQ, "Hkv": HKV, "head_dim": HEAD_DIM, "blocks": blocks},
        "policy": "topk",
        "repeats": repeats,
        "timing": "variants of one (L, threads) interleaved; median over rounds",
        "dry_run": args.dry_run,
        "cores": os.cpu_count(),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in load_end],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    if full:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
