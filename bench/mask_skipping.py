"""Which tiles the Triton forward computes, masks or skips: a CPU model on real tables.

    python bench/mask_skipping.py [--length 8192] [--docs 128,2048]

The forward/dQ kernels walk, per (q head, BLOCK_M query rows), the BLOCK_N sub-tiles of
the query block's kept key blocks. Each pair of tiles falls in one class, decided from
the document bounds of the first and last row (kernels/block_sparse_attn.py):

  dead      keys all before the first row's document, or all after the last row:
            cut from the iteration range (not loaded, not computed);
  interior  keys all <= the first row and all in the last row's document: computed
            without evaluating the mask;
  masked    the rest: computed with the causal and document mask.

`classify` restates those rules in Python, and `tests/test_kernel_tiles.py` checks them
against the brute-force token mask (dead tiles have no allowed pair, interior tiles
only allowed pairs). This script counts the classes on `select_blocks` tables for rows
packed with short documents and reports useful / computed (allowed token pairs over
BLOCK_M x BLOCK_N per computed tile) before (every kept sub-tile computed, the old
kernel) and after. It models the work; it does not time anything.
Writes bench/results/mask_skipping.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

import torch
from sb_titan_kernels.block_sparse_attn import attn_tiles, doc_bounds

from sb_titan.attention.selection import select_blocks

OUT = Path(__file__).resolve().parents[1] / "bench" / "results" / "mask_skipping.json"


class TileCounts(NamedTuple):
    dead: int
    interior: int
    masked: int
    useful_pairs: int  # allowed (query, key) token pairs inside computed tiles


def classify(start_m: int, start_n: int, bm: int, bn: int, seq_len: int, start) -> str:
    """The kernels' class of a (query tile, key sub-tile) pair; start: [L] doc starts."""
    last_row = min(start_m + bm, seq_len) - 1
    if start_n + bn <= start[start_m] or start_n > last_row:
        return "dead"
    if start_n + bn <= start_m + 1 and start_n >= start[last_row]:
        return "interior"
    return "masked"


def count_tiles(table, doc_id: torch.Tensor, block_m: int, block_n: int) -> TileCounts:
    """Classes of every (q-head-independent) forward tile pair of `table`, row 0."""
    start = doc_bounds(doc_id)[0][0].tolist()
    doc = doc_id[0]
    seq_len, bs = doc.numel(), table.block_size
    counts = {"dead": 0, "interior": 0, "masked": 0}
    useful = 0
    ptr = table.kv_ptr[0].tolist()
    kv_index = table.kv_index.tolist()
    for row_ptr in ptr:  # kv heads
        for i in range(len(row_ptr) - 1):
            kept = kv_index[row_ptr[i] : row_ptr[i + 1]]
            for start_m in range(i * bs, min((i + 1) * bs, seq_len), block_m):
                rows = torch.arange(start_m, min(start_m + block_m, seq_len))
                for kb in kept:
                    for start_n in range(kb * bs, (kb + 1) * bs, block_n):
                        kind = classify(start_m, start_n, block_m, block_n, seq_len, start)
                        counts[kind] += 1
                        if kind != "dead":
                            cols = torch.arange(start_n, min(start_n + block_n, seq_len))
                            allowed = (cols[None] <= rows[:, None]) & (
                                doc[cols][None] == doc[rows][:, None]
                            )
                            useful += int(allowed.sum())
    return TileCounts(counts["dead"], counts["interior"], counts["masked"], useful)


def packed_doc_id(length: int, mean_doc: int, seed: int) -> torch.Tensor:
    """One row of documents of uniform random length in [mean/2, 3 mean/2]."""
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < length:
        n = int(torch.randint(mean_doc // 2, 3 * mean_doc // 2 + 1, (1,), generator=gen))
        n = min(n, length - total)
        lengths.append(n)
        total += n
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None].int()


def run(length: int, mean_doc: int, budgets: list[float], kv_heads: int = 1) -> list[dict]:
    rows = []
    doc_id = packed_doc_id(length, mean_doc, seed=0)
    torch.manual_seed(0)
    q = torch.randn(1, 2 * kv_heads, length, 64)
    k = torch.randn(1, kv_heads, length, 64)
    for bs, head_dim in ((64, 128), (128, 128), (64, 64)):
        t = attn_tiles(torch.bfloat16, head_dim, bs).fwd
        for beta in budgets:
            table, _ = select_blocks(q, k, doc_id, beta, policy="topk", block_size=bs)
            c = count_tiles(table, doc_id, t.block_m, t.block_n)
            tile = t.block_m * t.block_n
            before, after = c.dead + c.interior + c.masked, c.interior + c.masked
            rows.append(
                {
                    "L": length,
                    "mean_doc": mean_doc,
                    "block": bs,
                    "head_dim": head_dim,
                    "tile": f"{t.block_m}x{t.block_n}",
                    "beta": beta,
                    "tiles_before": before,
                    "tiles_after": after,
                    "interior_share": round(c.interior / max(after, 1), 3),
                    "useful_over_computed_before": round(c.useful_pairs / (before * tile), 3),
                    "useful_over_computed_after": round(c.useful_pairs / max(after * tile, 1), 3),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--docs", default="128,2048", help="mean document lengths")
    ap.add_argument("--budgets", default="1.0,0.3")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",")]
    rows = [r for d in args.docs.split(",") for r in run(args.length, int(d), budgets)]
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
