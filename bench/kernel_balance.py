"""Load balance of the block-sparse attention kernels: a CPU work model over real tables.

    python bench/kernel_balance.py                      # L in {32K, 128K}: the full grid
    python bench/kernel_balance.py --lengths 32768      # one length
    python bench/kernel_balance.py --no-subtiles        # skip the token-level sub-tile census

Nothing here runs a kernel or times anything: it counts the work each GPU program of
the Triton kernels (kernels/attn_*.py) would do, on block tables made by the
recipe's own selection (`select_blocks`, CPU) from structured q/k. A unit of work is one
kept (query block, key block) pair of one kv head; every program's cost is that count
times the same per-pair factor (sub-tiles x G q heads), so ratios are exact in this
unit, though not GPU time: tail effects, L2 hits and the reduce are not modelled.

dK/dV, BEFORE: one program per key block (per key sub-tile, the same ratio) walking its
whole transposed column, work = q_count. Every document's first (sink) block is kept by
all of its query blocks, so at L=32K, Bs=64 one program does ~20x the mean.
dK/dV, AFTER: `plan_dkdv`'s items, work = hi - lo (at most `cap`, the mean rounded up);
split blocks write fp32 partials (`num_partials` x Bs x D x 4 bytes, for dK and dV).
Forward/dQ: one program per query block (per sub-tile and q head), work = kv_count.

`makespan` is a greedy list schedule of the programs, in launch order, over SLOTS
resident programs (132 SMs x 2, an assumption), over the ideal total / SLOTS: what the
balance costs once program counts and launch order are taken into account.

The optional sub-tile census classifies, from doc ids token by token, every
(query sub-tile, key sub-tile) pair the kernels meet inside kept blocks (the shipped
tiles of `--census-head-dim`, default 64):
dead (no allowed token pair: the kernels cut these from their iteration range),
interior (every token pair allowed: no mask evaluated) or masked (diagonal, document
edges). Writes bench/results/kernel_balance.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # a source checkout without install
    sys.path.insert(0, str(REPO))

from sb_titan_kernels.attn_bwd_dkdv import plan_dkdv  # noqa: E402
from sb_titan_kernels.attn_tiles import attn_tiles  # noqa: E402

from sb_titan.attention.selection import BlockTable, select_blocks  # noqa: E402

LENGTHS = (32768, 131072)
BETAS = (0.1, 0.3, 0.5)
POLICIES = ("topk", "mass")
BLOCKS = (64, 128)
LAYOUTS = ("one_doc", "packed", "short")
#: the tile table of the census: the one its committed figures were counted on
CENSUS_TABLE = "common"
KV_HEADS = 2  # the table's kv heads (Qwen2.5-0.5B has 2); q gets one head per kv head
HEAD_DIM = 64  # of the q/k that selection scores
#: head_dim -> (q heads, kv heads) of the models the workspace is sized for (GQA 7:1)
MODEL_HEADS = {64: (14, 2), 128: (28, 4)}
SLOTS = 264  # resident programs in the makespan model: 132 SMs x 2 (an assumption)
SUBTILE_MAX_L = 32768  # the token-level census runs up to this length
OUT = REPO / "bench" / "results" / "kernel_balance.json"


def structured_qk(L: int, heads: int, dim: int = HEAD_DIM, seed: int = 0):
    """q, k [1, heads, L, dim]: unit noise plus a shared slowly varying component
    (sinusoids with periods of 2K to 64K tokens), so pooled block scores have a spread of
    several logits and attention is not flat: nearby and in-phase blocks get the mass."""
    gen = torch.Generator().manual_seed(seed)
    period = 2048.0 * 32.0 ** torch.rand(heads, 1, dim, generator=gen)
    phase = 2 * math.pi * torch.rand(heads, 1, dim, generator=gen)
    pos = torch.arange(L, dtype=torch.float32)[None, :, None]
    smooth = torch.sin(2 * math.pi * pos / period + phase)[None]
    q = torch.randn(1, heads, L, dim, generator=gen) + smooth
    k = torch.randn(1, heads, L, dim, generator=gen) + smooth
    return q, k


def packed_lengths(L: int, seed: int = 0) -> list[int]:
    """Document lengths filling one row: log-uniform in [128, L/2] tokens, the last one cut."""
    gen = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < L:
        n = int(128 * (L / 256) ** float(torch.rand((), generator=gen)))
        n = min(n, L - total)
        lengths.append(n)
        total += n
    return lengths


def doc_layout(layout: str, L: int, seed: int = 0) -> torch.Tensor:
    """doc_id [1, L] int32: one document, a packed row of mixed lengths, or a row of
    short documents (uniform in [64, 192] tokens: where masks waste the most)."""
    if layout == "one_doc":
        return torch.zeros(1, L, dtype=torch.int32)
    if layout in ("packed", "short"):
        if layout == "packed":
            lengths = torch.tensor(packed_lengths(L, seed))
        else:
            gen = torch.Generator().manual_seed(seed)
            lengths = torch.randint(64, 193, (L // 64,), generator=gen)
            lengths = lengths[: int((lengths.cumsum(0) < L).sum()) + 1]
            lengths[-1] -= int(lengths.sum()) - L
        return torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None].to(torch.int32)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def make_table(L: int, block: int, beta: float, policy: str, layout: str, seed: int = 0):
    """(table, doc_id, realised density) from select_blocks on structured q/k."""
    q, k = structured_qk(L, KV_HEADS, seed=seed)
    doc_id = doc_layout(layout, L, seed)
    table, stats = select_blocks(q, k, doc_id, beta, policy=policy, block_size=block)
    return table, doc_id, float(stats.density.mean())


def work_stats(work: torch.Tensor) -> dict:
    """programs, max, mean, max/mean of a per-program work vector."""
    w = work.double()
    mean = float(w.mean())
    return {
        "programs": int(w.numel()),
        "max": int(w.max()),
        "mean": mean,
        "max_over_mean": float(w.max()) / mean if mean > 0 else float("nan"),
    }


def makespan(work: torch.Tensor, slots: int = SLOTS) -> float:
    """Greedy list schedule in launch order (each program to the first free slot), as a
    multiple of the ideal total / slots; 1 is perfect balance."""
    free = [0] * min(slots, work.numel())
    for w in work.tolist():
        heapq.heapreplace(free, free[0] + w)
    return max(free) / (float(work.sum()) / slots)


def balance(table: BlockTable, L: int) -> dict:
    """Before/after dK/dV work, the split's workspace, forward/dQ work: one table."""
    bs = table.block_size
    # launch order before: key tiles of (b, kv head) in position order
    before = table.q_count.flatten().long()
    plan = plan_dkdv(table.q_ptr, table.q_index.numel())
    after = plan.items[:, 2] - plan.items[:, 1]  # already in launch order
    kv_count = table.kv_count.flatten().long()
    heads = table.kv_ptr.shape[0] * table.kv_ptr.shape[1]
    per_head = plan.num_partials / heads
    workspace, fa_dq = {}, {}
    for d, (hq, hkv) in MODEL_HEADS.items():
        workspace[d] = per_head * hkv * bs * d * 4 * 2
        fa_dq[d] = hq * L * d * 4
    # programs per block at D=64: key sub-tiles (dK/dV), query sub-tiles x G (forward)
    tiles = attn_tiles(torch.bfloat16, 64, bs, CENSUS_TABLE)
    nsub_n, nsub_m = bs // tiles.dkdv.block_n, bs // tiles.fwd.block_m
    group = MODEL_HEADS[64][0] // MODEL_HEADS[64][1]
    fwd_order = torch.argsort(kv_count, descending=True, stable=True)
    return {
        "kept_pairs": int(table.q_index.numel()),
        "dkdv_before": work_stats(before)
        | {"makespan": makespan(before.repeat_interleave(nsub_n))},
        "dkdv_after": work_stats(after) | {"makespan": makespan(after.repeat_interleave(nsub_n))},
        "cap": plan.cap,
        "split_blocks": int(plan.splits.shape[0]),
        "num_partials": plan.num_partials,
        "workspace_bytes": workspace,
        "fa_dq_accum_bytes": fa_dq,
        "fwd": work_stats(kv_count)
        | {
            "makespan_natural": makespan(kv_count.repeat_interleave(nsub_m * group)),
            "makespan_heaviest_first": makespan(
                kv_count[fwd_order].repeat_interleave(nsub_m * group)
            ),
        },
    }


def _pair_classes(doc_id: torch.Tensor, m0: torch.Tensor, n0: torch.Tensor, bm: int, bn: int):
    """(dead, interior [P] bool, allowed token pairs [P]) of sub-tile pairs (rows
    [m0, m0+bm), keys [n0, n0+bn)), token by token: allowed = key <= row and same
    document; rows/keys past L are absent."""
    L = doc_id.shape[0]
    rows = m0[:, None] + torch.arange(bm)
    cols = n0[:, None] + torch.arange(bn)
    real = (rows < L)[:, :, None] & (cols < L)[:, None, :]
    dr = doc_id[rows.clamp(max=L - 1)]
    dc = doc_id[cols.clamp(max=L - 1)]
    allowed = (cols[:, None, :] <= rows[:, :, None]) & (dc[:, None, :] == dr[:, :, None]) & real
    dead = ~allowed.flatten(1).any(1)
    interior = (allowed | ~real).flatten(1).all(1) & ~dead
    return dead, interior, allowed.flatten(1).sum(1)


def _kernel_rules(kind: str, doc_start, doc_end, m0, n0, bm: int, bn: int, L: int):
    """(run, masked) [P] bool: the kernels' own rules, transcribed (kernels/attn_common.py,
    "Masks"): whether a sub-tile pair lies inside the program's
    iteration range, and whether it evaluates the mask."""
    last_row = (m0 + bm).clamp(max=L) - 1
    if kind == "fwd":  # range: keys after the first row's doc start, before the last row
        run = (n0 + bn > doc_start[m0.clamp(max=L - 1)]) & (n0 < last_row + 1)
        masked = (n0 + bn > m0 + 1) | (n0 < doc_start[last_row])
    else:  # dK/dV: rows ending after the key tile starts, starting before its last doc ends
        last_doc_end = doc_end[(n0 + bn).clamp(max=L) - 1]
        run = (m0 + bm > n0) & (m0 < last_doc_end)
        masked = (n0 + bn > m0 + 1) | (m0 + bm > doc_end[n0.clamp(max=L - 1)])
    return run, masked


def subtile_census(
    table: BlockTable, doc_id: torch.Tensor, head_dim: int = HEAD_DIM, chunk: int = 2048
) -> dict:
    """Sub-tile pairs inside kept blocks (shipped forward and dK/dV tiles at head_dim), classed
    token by token as dead / interior / masked, and checked against the kernels' rules:
    `dead_run` counts dead pairs inside the iteration range, `interior_masked` interior
    pairs that still evaluate the mask (both 0 when the rules are exact); `live_cut` and
    `mixed_unmasked` would be wrong results (a needed pair skipped, a mask skipped)."""
    bs = table.block_size
    doc = doc_id[0].long()
    L = doc.numel()
    start = torch.searchsorted(doc, doc)  # doc ids are non-decreasing along the row
    end = torch.searchsorted(doc, doc, right=True)
    nb = table.kv_ptr.shape[-1] - 1
    row = torch.repeat_interleave(
        torch.arange(table.kv_count.numel()), table.kv_count.flatten().long()
    )
    qb, kb = row % nb, table.kv_index.long()
    tiles = attn_tiles(torch.bfloat16, head_dim, bs, CENSUS_TABLE)
    out = {}
    for kind, t in (("fwd", tiles.fwd), ("dkdv", tiles.dkdv)):
        sm = torch.arange(bs // t.block_m) * t.block_m
        sn = torch.arange(bs // t.block_n) * t.block_n
        shape = (-1, len(sm), len(sn))
        m0 = (qb[:, None, None] * bs + sm[None, :, None]).expand(*shape).flatten()
        n0 = (kb[:, None, None] * bs + sn[None, None, :]).expand(*shape).flatten()
        names = ("dead", "interior", "dead_run", "interior_masked", "mixed_unmasked", "live_cut")
        counts = dict.fromkeys(names, 0)
        useful = computed = 0
        for c in range(0, m0.numel(), chunk):
            mc, nc = m0[c : c + chunk], n0[c : c + chunk]
            dead, interior, allowed = _pair_classes(doc, mc, nc, t.block_m, t.block_n)
            run, masked = _kernel_rules(kind, start, end, mc, nc, t.block_m, t.block_n, L)
            useful += int(allowed.sum())
            computed += int(run.sum())
            counts["dead"] += int(dead.sum())
            counts["interior"] += int(interior.sum())
            counts["dead_run"] += int((dead & run).sum())
            counts["interior_masked"] += int((interior & masked).sum())
            counts["mixed_unmasked"] += int((~dead & ~interior & ~masked).sum())  # wrong
            counts["live_cut"] += int((~dead & ~run).sum())  # wrong
        total = m0.numel()
        out[kind] = {"tile": [t.block_m, t.block_n], "pairs": total, "computed": computed}
        out[kind] |= {k: v / total for k, v in counts.items()}
        out[kind]["masked"] = 1.0 - out[kind]["dead"] - out[kind]["interior"]
        # allowed token pairs per computed tile element: every kept sub-tile (the kernels
        # before the range cut) and the sub-tiles inside the range (now)
        area = t.block_m * t.block_n
        out[kind]["useful_before"] = useful / (total * area)
        out[kind]["useful_after"] = useful / max(computed * area, 1)
    return out


def run(
    lengths, blocks, betas, policies, layouts, subtiles: bool = True, census_dim: int = HEAD_DIM
) -> list[dict]:
    rows = []
    for L in lengths:
        for layout in layouts:
            for bs in blocks:
                for policy in policies:
                    for beta in betas:
                        t0 = time.perf_counter()
                        table, doc_id, density = make_table(L, bs, beta, policy, layout)
                        select_s = time.perf_counter() - t0
                        row = {"L": L, "layout": layout, "block": bs, "policy": policy}
                        row |= {"beta": beta, "density": density, "select_s": select_s}
                        row |= balance(table, L)
                        if layout == "packed":
                            row["documents"] = int(doc_id.max()) + 1
                        if subtiles and L <= SUBTILE_MAX_L:
                            row["subtiles"] = subtile_census(table, doc_id, census_dim)
                        rows.append(row)
                        print(_line(row), flush=True)
    return rows


def _line(r: dict) -> str:
    b, a = r["dkdv_before"], r["dkdv_after"]
    return (
        f"| {r['L'] // 1024}K | {r['layout']} | {r['block']} | {r['policy']} | {r['beta']} | "
        f"{r['density']:.3f} | {b['programs']} | {b['max']} | {b['mean']:.1f} | "
        f"{b['max_over_mean']:.1f} | {b['makespan']:.2f} | {a['programs']} | {a['max']} | "
        f"{a['mean']:.1f} | {a['max_over_mean']:.2f} | {a['makespan']:.2f} | "
        f"{r['fwd']['max_over_mean']:.2f} | {r['fwd']['makespan_heaviest_first']:.2f} |"
    )


HEADER = (
    "| L | docs | Bs | policy | beta | density | before: programs | max | mean | max/mean | "
    "makespan | after: programs | max | mean | max/mean | makespan | fwd/dQ max/mean | "
    "fwd makespan |\n|" + "---|" * 18
)


def markdown(rows: list[dict]) -> str:
    lines = ["dK/dV work per program (kept block pairs), before and after the split", HEADER]
    lines += [_line(r) for r in rows]
    lines += ["", "fp32 partial workspace of the split (model heads) vs FA's fp32 dQ accumulator"]
    lines += ["| L | docs | Bs | policy | beta | split blocks | partials | "]
    lines[-1] += "D=64 (14/2) MiB | FA dQ MiB | D=128 (28/4) MiB | FA dQ MiB |"
    lines += ["|" + "---|" * 11]
    mib = 2.0**20
    for r in rows:
        w, f = r["workspace_bytes"], r["fa_dq_accum_bytes"]
        lines.append(
            f"| {r['L'] // 1024}K | {r['layout']} | {r['block']} | {r['policy']} | {r['beta']} | "
            f"{r['split_blocks']} | {r['num_partials']} | {w[64] / mib:.1f} | "
            f"{f[64] / mib:.0f} | {w[128] / mib:.1f} | {f[128] / mib:.0f} |"
        )
    census = [r for r in rows if "subtiles" in r]
    if census:
        lines += ["", "sub-tile pairs inside kept blocks, token-level census; "]
        lines[-1] += "dead run / interior masked: against the kernels' rules"
        head = "tile | dead | interior | masked | dead run | interior masked | useful before/after"
        lines += [f"| L | docs | Bs | policy | beta | fwd {head} | dK/dV {head} |"]
        lines += ["|" + "---|" * 19]
        for r in census:
            cells = []
            for k in ("fwd", "dkdv"):
                s = r["subtiles"][k]
                cols = ("dead", "interior", "masked", "dead_run", "interior_masked")
                cells += ["x".join(map(str, s["tile"])), *(f"{s[c]:.1%}" for c in cols)]
                cells.append(f"{s['useful_before']:.2f}/{s['useful_after']:.2f}")
            lines.append(
                f"| {r['L'] // 1024}K | {r['layout']} | {r['block']} | {r['policy']} | "
                f"{r['beta']} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    ap.add_argument("--blocks", type=int, nargs="+", default=list(BLOCKS))
    ap.add_argument("--betas", type=float, nargs="+", default=list(BETAS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    ap.add_argument("--no-subtiles", action="store_true", help="skip the sub-tile census")
    ap.add_argument("--census-head-dim", type=int, default=HEAD_DIM, choices=(64, 128))
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    print(HEADER)
    rows = run(
        args.lengths,
        args.blocks,
        args.betas,
        args.policies,
        args.layouts,
        not args.no_subtiles,
        args.census_head_dim,
    )
    report = {
        "what": "CPU work model of the Triton attention kernels over real selection tables; "
        "not GPU timings",
        "unit": "kept (query block, key block) pairs of one kv head per program",
        "kv_heads": KV_HEADS,
        "slots": SLOTS,
        "torch": torch.__version__,
        "host": platform.node(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print()
    print(markdown(rows))
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
