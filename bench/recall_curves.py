"""Measured per-document recall curves: what each budget keeps of one document's true
attention, for `sb-simulate --recall-curves` to score recall with curves that the
allocator never saw.

Per-document DST allocates from a model of recall by length. Graded by that same model
it can only look right. So this measures real selection on the synthetic selective
pattern of bench/context_parallel.py (per (layer, kv head) a few hot key blocks, a
local window and noise: real sparsity, density falling with length) for documents of
128 to 65,536 tokens, several documents per length, every document alone in its row:
- the trainer's `select_blocks` (`mass` policy, the `mean` scorer) at each budget of
  BETAS, every layer;
- true recall: the exact attention mass the kept blocks cover, for one sampled query
  per query block (attention/recall.py's positions), and the top-key hit (whether the
  key of greatest true probability was kept), over every q head and layer;
- the estimator's own estimated recall, beside them.

The pattern's q/k are constant within a block, so a query's exact attention is exact
at block level: every key of block j < i carries logit s_ij, block i holds the query's
own offset + 1 keys. `block_true_recall` uses that to measure 64K-token documents in
seconds; tests/test_recall_curves.py checks it against attention/recall.true_recall at
token level.

Documents alternate between two halves: `fit` (what the allocator's recall model
learns from in the simulation, as a trainer learns from documents it trained) and
`heldout` (what the simulation scores with). Different documents, drawn with different
seeds.

    python bench/recall_curves.py [--quick]  ->  bench/results/recall_curves.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from context_parallel import BLOCK, synthetic_qk  # the pattern this measures

from sb_titan.attention.layout import doc_ids_from_lengths
from sb_titan.attention.recall import kept_block_mask, sample_positions
from sb_titan.attention.selection import select_blocks

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "recall_curves.json"
FORMAT = "sb_titan.recall_curves"
BETAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0)
LENGTHS = tuple(2**k for k in range(7, 17))  # 128 .. 65536 tokens
DOCS_PER_LENGTH = 8  # even: fit, odd: held out
QUICK_LENGTHS, QUICK_DOCS = (128, 512, 2048), 2
CURVE_SEED = 4242


def block_true_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    kept: torch.Tensor,
    pos: torch.Tensor,
    block_size: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([Hq, NB] true recall, [Hq, NB] top-key hit) of one row holding one document whose
    q/k are constant within each block, for the queries at `pos` [NB] (one per query
    block). kept: [Hkv, NB, NB] bool, the kept (query block, key block) pairs. Exact for
    block-constant q/k, in fp64."""
    Hq, L, _ = q.shape
    G = Hq // k.shape[0]
    nb = kept.shape[-1]
    qb = q[:, ::block_size].double()  # [Hq, NB, D]: one token stands for its block
    kb = k[:, ::block_size].double().repeat_interleave(G, dim=0)
    logits = torch.einsum("hid,hjd->hij", qb, kb) * scale
    i = torch.arange(nb)
    own = (pos - i * block_size + 1).double()  # keys of its own block the query sees
    count = torch.where(i[None, :] < i[:, None], float(block_size), 0.0)
    count = count + torch.diag(own)
    allowed = count > 0
    weighted = torch.where(allowed, logits + torch.log(count.clamp(min=1.0)), -math.inf)
    full = torch.logsumexp(weighted, dim=-1)
    kept_h = kept.repeat_interleave(G, dim=0) & allowed
    part = torch.logsumexp(weighted.masked_fill(~kept_h, -math.inf), dim=-1)
    top = torch.where(allowed, logits, -math.inf).argmax(dim=-1)  # [Hq, NB]
    hit = kept_h.gather(-1, top[..., None])[..., 0]
    return torch.exp(part - full).clamp(max=1.0).float(), hit


def measure_document(length: int, seed: int, betas: tuple[float, ...]) -> dict:
    """One document alone in its row: per budget, true recall, top-key hit, estimated
    recall and density, each a mean over layers (and heads, sampled queries)."""
    bs = BLOCK
    doc_id = doc_ids_from_lengths([[length]], length)
    pos = sample_positions(doc_id, bs, 1.0)[0]
    out = {k: np.zeros(len(betas)) for k in ("true", "top_key", "estimated", "density")}
    layers = 0
    for _, q, k in synthetic_qk(doc_id, seed):
        layers += 1
        scale = q.shape[-1] ** -0.5
        for b, beta in enumerate(betas):
            table, stats = select_blocks(q, k, doc_id, beta, policy="mass", block_size=bs)
            kept = kept_block_mask(table.kv_ptr, table.kv_index)[0]
            recall, hit = block_true_recall(q[0], k[0], kept, pos, bs, scale)
            out["true"][b] += float(recall.mean())
            out["top_key"][b] += float(hit.double().mean())
            out["estimated"][b] += float(stats.recall[0])
            out["density"][b] += float(stats.density[0])
    return {key: (v / layers).round(6).tolist() for key, v in out.items()}


def measure(lengths: tuple[int, ...], docs: int, betas: tuple[float, ...] = BETAS) -> dict:
    t0 = time.perf_counter()
    rows = []
    for length in lengths:
        for d in range(docs):
            seed = int(np.random.SeedSequence([CURVE_SEED, length, d]).generate_state(1)[0])
            rows.append(
                {
                    "length": length,
                    "seed": seed,
                    "half": "fit" if d % 2 == 0 else "heldout",
                    **measure_document(length, seed, betas),
                }
            )
        print(
            f"[recall_curves] {length} tokens: {docs} documents ({time.perf_counter() - t0:.0f}s)",
            file=sys.stderr,
        )
    return {
        "format": FORMAT,
        "source": "synthetic selective pattern (bench/context_parallel.py), one document per "
        "row, `mass` policy, `mean` scorer, block 64, 4 layers x 2 kv heads x 2 q heads",
        "betas": list(betas),
        "documents": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def format_table(rep: dict) -> str:
    """Held-out mean true recall / top-key hit per length, at a few budgets."""
    betas = rep["betas"]
    shown = [b for b in (0.5, 0.7, 0.9, 1.0) if b in betas]
    head = "| tokens | docs | " + " | ".join(f"β={b:g} true / top-key" for b in shown) + " |"
    lines = [head, "|" + "---|" * (2 + len(shown))]
    for length in sorted({r["length"] for r in rep["documents"]}):
        rows = [r for r in rep["documents"] if r["length"] == length]
        cells = []
        for b in shown:
            j = betas.index(b)
            cells.append(
                f"{np.mean([r['true'][j] for r in rows]):.3f} / "
                f"{np.mean([r['top_key'][j] for r in rows]):.3f}"
            )
        lines.append(f"| {length} | {len(rows)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3 short lengths, 2 documents each")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.quick:
        rep = measure(QUICK_LENGTHS, QUICK_DOCS)
    else:
        rep = measure(LENGTHS, DOCS_PER_LENGTH)
    print(format_table(rep))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rep, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
