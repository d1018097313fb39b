"""Dense document attention on CPU: the full-table block-sparse path vs the old
[B, 1, L, L] mask + SDPA, forward+backward time and peak memory.

One document per row (so causal SDPA without a mask, also timed, is exact too),
Qwen2.5-0.5B heads (14 q / 2 kv, head_dim 64), fp32, B=1. Each (impl, L) runs in a
fresh process: time is the median of `--repeats` fwd+bwd after one warm-up (wall and
process CPU time: on a shared machine CPU time is the steadier); memory is the
process's peak RSS (ru_maxrss) minus its RSS once the inputs exist, so it counts
everything the attention allocates, torch's included.

    python bench/dense_attention.py                 # L in {4096, 8192}, 1 thread
    python bench/dense_attention.py --lengths 16384 --repeats 1 --impls full_table_64 masked_sdpa

Rows go to bench/results/dense_attention.json, replacing earlier rows of the same
(impl, L, threads).
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

import torch
import torch.nn.functional as F

HQ, HKV, HEAD_DIM = 14, 2, 64
IMPLS = ("full_table_128", "full_table_64", "masked_sdpa", "causal_sdpa")
RESULTS = Path(__file__).parent / "results"


def _attn(impl: str, doc_id: torch.Tensor):
    from sb_titan.attention import dense
    from sb_titan.attention.layout import document_causal_mask

    if impl.startswith("full_table"):
        dense.CPU_BLOCK_SIZE = int(impl.rsplit("_", 1)[1])
        return lambda q, k, v: dense.dense_document_attention(q, k, v, doc_id, kernel="torch")
    if impl == "masked_sdpa":  # what dense_document_attention did before
        return lambda q, k, v: F.scaled_dot_product_attention(
            q, k, v, attn_mask=document_causal_mask(doc_id), enable_gqa=True
        )
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(impl: str, L: int, threads: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, L, HEAD_DIM, requires_grad=True) for h in (HQ, HKV, HKV))
    grad = torch.randn(1, HQ, L, HEAD_DIM)
    doc_id = torch.zeros(1, L, dtype=torch.int32)
    attn = _attn(impl, doc_id)
    base = _rss_mib()

    def step():
        for x in (q, k, v):
            x.grad = None
        attn(q, k, v).backward(grad)

    step()
    times, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    return {
        "impl": impl,
        "L": L,
        "threads": threads,
        "fwd_bwd_s": round(statistics.median(times), 4),
        "cpu_s": round(statistics.median(cpu), 4),
        "peak_extra_mib": round(peak - base, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--child", nargs=2, metavar=("IMPL", "L"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        row = child(args.child[0], int(args.child[1]), args.threads, args.repeats)
        print(json.dumps(row))
        return
    rows = []
    print(f"{'impl':<15} {'L':>6} {'thr':>4} {'fwd_bwd_s':>10} {'cpu_s':>8} {'peak_MiB':>9}")
    for L in args.lengths:
        for impl in args.impls:
            cmd = [sys.executable, __file__, "--child", impl, str(L)]
            cmd += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
            env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(r)
            print(
                f"{r['impl']:<15} {r['L']:>6} {r['threads']:>4} {r['fwd_bwd_s']:>10.3f} "
                f"{r['cpu_s']:>8.3f} {r['peak_extra_mib']:>9.1f}",
                flush=True,
            )
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "dense_attention.json"  # rows of earlier runs stay unless re-measured
    key = lambda r: (r["impl"], r["L"], r["threads"])  # noqa: E731
    old = json.loads(path.read_text()) if path.exists() else []
    new = {key(r) for r in rows}
    rows = sorted(
        [r for r in old if key(r) not in new] + rows, key=lambda r: (r["threads"], r["L"])
    )
    path.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
