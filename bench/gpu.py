"""What a person with a GPU runs first: sb_titan's attention kernels, checked and timed.

    python bench/gpu.py --quick --budget-s 200 --out DIR   # (a), (b), then Flex
    python bench/gpu.py --quick --parts c --budget-s 200 --out DIR   # (c), second call
    python bench/gpu.py report --out DIR                   # DIR/*.jsonl -> markdown
    python bench/gpu.py --dry-run --quick                  # CPU, tiny shapes (tests)

Runs from a plain source checkout on torch, Triton and numpy alone (no install, no
torchtitan: docs/kernels.md, "The first ten minutes on a GPU"). Every row is appended to
`DIR/gpu_<device>.jsonl` (`train_<device>.jsonl` for (c) alone) the moment it is
measured; `--budget-s` stops between rows before that many seconds, `--max-rows` after
that many rows, and a run cut off keeps what it measured.

(a) correctness: our Triton forward and backward against the recipe's PyTorch path in
    fp32 (sb_titan.attention.block_sparse) on the same `topk` table, GQA 7:1, blocks 64
    and 128, head_dim 64 and 128; --quick: L = 8K fp32 and bf16, 32K bf16. Errors as
    relative norms and max abs; ours runs twice and must repeat bitwise; freed device
    memory is NaN before every run, so an output a kernel leaves unwritten shows. bf16
    also on the full table beside torch's flash (ours within 2x flash's error).
(b) speed, L in {32K, 128K}, `topk` at 1 (every allowed block) and 0.1, heads 14/2
    (D 64) and 28/4 (D 128), blocks 64 and 128: each of our kernels timed alone
    (forward, backward preprocess, dQ, dK/dV with its work plan and partial reduce),
    as TFLOP/s per computed block pair (4·Bs²·D per pair forward, 10·Bs²·D backward:
    recomputation not counted, as for flash; dQ 6·Bs²·D and dK/dV 8·Bs²·D, what each
    executes). Beside them on the same inputs, document-masked (one causal call per
    document, K/V expanded to the q heads outside the timing): torch's bundled flash
    kernel (SDPA's FLASH_ATTENTION backend: FlashAttention-2 class, not FA3) and SDPA's
    cuDNN backend, each as TFLOP/s per pair of the full table. The bar: ours per pair
    >= 0.6 of flash's at density 0.1.
Flex: FlexAttention (the `flex` backend's BlockMask and kernel options, the same scale)
    on (b)'s tables, last and optional: a failure is a row with its error.
(c) one GPU, Qwen2.5-0.5B's shape at 32K, sparse and dense (bench/gpu_train.py).

Every implementation gets the same seeded dO; gradients are cleared between repeats;
times are CUDA-event medians after warm-up. `--dry-run` runs the same code at tiny
shapes on the CPU with the Triton interpreter (no time is reported there).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if "--dry-run" in sys.argv:  # before Triton is imported: the interpreter is chosen then
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("SB_TRITON_UPCAST", "1")
if importlib.util.find_spec("sb_titan") is None:  # a source checkout without install
    sys.path.insert(0, str(REPO))
if str(REPO / "bench") not in sys.path:
    sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from gpu_rows import (  # noqa: E402
    RowLog,
    guarded,
    markdown,
    median_ms,
    poison,
    read_rows,
    rel_norm,
    run_rows,
)

from sb_titan.util.source_tree import use_source_kernels  # noqa: E402

use_source_kernels()

F32, BF16 = torch.float32, torch.bfloat16
HEADS = [(14, 2, 64), (28, 4, 128)]  # Qwen2.5-0.5B and 7B: GQA 7:1, head_dim 64 / 128
GRIDS = {
    "quick": {
        "checks": [(8192, F32), (8192, BF16), (32768, BF16)],
        "heads": HEADS,
        "blocks": [64, 128],
        "lengths": [32768, 131072],
        "densities": [1.0, 0.1],
        "repeats": 5,
    },
    "full": {
        "checks": [(L, dt) for L in (8192, 32768, 131072) for dt in (F32, BF16)],
        "heads": HEADS,
        "blocks": [64, 128],
        "lengths": [32768, 131072],
        "densities": [1.0, 0.5, 0.3, 0.1],
        "repeats": 10,
    },
    "dry": {
        "checks": [(256, F32), (256, BF16)],
        "heads": [(2, 1, 64)],
        "blocks": [64],
        "lengths": [256],
        "densities": [1.0, 0.1],
        "repeats": 1,
    },
}
CHECK_DENSITY = 0.25
# max abs error vs the fp32 reference over max(max |reference|, 1), as in
# tests/test_kernels.py: bf16 rounds P, dS and the outputs (8 mantissa bits), and dK/dV
# sum over G heads and many query blocks, so their scale grows with L
TOLERANCE = {F32: 2e-3, BF16: 2.5e-2}
BF16_ULP = 2.0**-7  # bf16 spacing relative to a value: at most 2^-7 (7 stored bits)
VS_DENSE_MAX_L = 32768  # (a)'s bf16 comparison with flash (its fp32 reference is slow)
GOAL, GOAL_DENSITY = 0.6, 0.1  # (b): ours per pair at density 0.1 vs flash's
# FLOPs per computed block pair and q head, over Bs^2 * D (see the module docstring)
FLOPS = {"fwd": 4, "bwd": 10, "dq": 6, "dkdv": 8}
GRAD_NAMES = ("out", "dq", "dk", "dv")
PEERS = {  # SDPA backend per peer, and what it is
    "flash": ("FLASH_ATTENTION", "torch's bundled flash (FA2-class, not FA3)"),
    "cudnn": ("CUDNN_ATTENTION", "cuDNN (SDPA backend)"),
}


def _inputs(L: int, heads, dtype, device, seed: int = 0, structured: bool = False):
    """q, k, v [1, H, L, D] and doc_id [1, L], drawn on `device` from a seeded generator:
    two documents, the second starting mid-row, so document masking is exercised.
    `structured` adds to q and k a slowly varying component shared by each kv head's
    group (sinusoids, 2K-64K-token periods), so selection sees attention that is not
    flat (tables like trained ones: heavy sinks, popular blocks) rather than noise."""
    hq, hkv, d = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(1, h, L, d, generator=gen, device=device) for h in (hq, hkv, hkv))
    if structured:
        period = 2048.0 * 32.0 ** torch.rand(hkv, 1, d, generator=gen, device=device)
        phase = 2 * math.pi * torch.rand(hkv, 1, d, generator=gen, device=device)
        pos = torch.arange(L, dtype=torch.float32, device=device)[None, :, None]
        smooth = torch.sin(2 * math.pi * pos / period + phase)[None]
        q += smooth.repeat_interleave(hq // hkv, dim=1)
        k += smooth
    doc_id = (torch.arange(L, device=device) >= L // 2 + 17).to(torch.int32)[None]
    return [t.to(dtype) for t in (q, k, v)], doc_id


@functools.lru_cache(maxsize=1)
def _speed_inputs(L: int, heads: tuple[int, int, int], device):
    """(b)'s inputs, made once per shape: structured q/k, bf16 on CUDA."""
    dtype = BF16 if device.type == "cuda" else F32
    return _inputs(L, heads, dtype, device, structured=True)


def _table(q, k, doc_id, density: float, block: int):
    from sb_titan.attention.selection import select_blocks

    table, stats = select_blocks(q, k, doc_id, density, policy="topk", block_size=block)
    return table, float(stats.density.mean())


def grad_like(q: torch.Tensor) -> torch.Tensor:
    """The one upstream gradient dO of every implementation: seeded, random."""
    gen = torch.Generator(device=q.device).manual_seed(123)
    return torch.randn(q.shape, generator=gen, device=q.device).to(q.dtype)


def _run_with_grads(fn, qkv, cast, grad, *args) -> list:
    """[out, dq, dk, dv] in fp32 of fn(q, k, v, *args) on fresh leaves cast to `cast`,
    with the free device memory NaN-filled first."""
    poison(qkv[0].device)
    xs = [t.detach().to(cast).requires_grad_() for t in qkv]
    out = fn(*xs, *args)
    out.backward(grad.to(out.dtype))
    return [out.detach().float()] + [x.grad.float() for x in xs]


def _compare(got: list, ref: list) -> dict:
    named = list(zip(GRAD_NAMES, got, ref, strict=True))
    return {
        "max_abs_error": {n: float((a - b).abs().max()) for n, a, b in named},
        "rel_norm_error": {n: rel_norm(a, b) for n, a, b in named},
        "scale": {n: float(b.abs().max()) for n, _, b in named},
        "finite": all(bool(torch.isfinite(a).all()) for _, a, _ in named),
    }


def _ours():
    from sb_titan_kernels import block_sparse_attention_triton

    return block_sparse_attention_triton


def _reference():
    from sb_titan.attention.ops import block_sparse_attention

    return block_sparse_attention


def check(L: int, heads, block: int, dtype, device) -> dict:
    """(a): ours (twice, compared bitwise) against the PyTorch path in fp32."""
    (q, k, v), doc_id = _inputs(L, heads, dtype, device)
    table, realised = _table(q.float(), k.float(), doc_id, CHECK_DENSITY, block)
    grad, scale = grad_like(q), heads[2] ** -0.5
    args = (doc_id, table, scale)
    first = _run_with_grads(_ours(), (q, k, v), dtype, grad, *args)
    again = _run_with_grads(_ours(), (q, k, v), dtype, grad, *args)
    ref = _run_with_grads(_reference(), (q, k, v), F32, grad, *args)
    row = {"realised_density": realised} | _compare(first, ref)
    row["deterministic"] = all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    tol = TOLERANCE[dtype]
    within = all(row["max_abs_error"][n] <= tol * max(row["scale"][n], 1.0) for n in GRAD_NAMES)
    row["ok"] = row["finite"] and row["deterministic"] and within
    return row


def _doc_spans(doc_id: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document of the single row of doc_id (host side, once)."""
    ids = doc_id[0].tolist()
    starts = [0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]]
    return list(zip(starts, starts[1:] + [len(ids)], strict=True))


def per_document_sdpa(q, k, v, spans, backend: str | None, scale: float) -> torch.Tensor:
    """Document-masked causal attention as one SDPA call per document (K/V already
    expanded to the q heads), restricted to `backend` where given (CUDA)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend():
        parts = [
            F.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=scale
            )
            for s, e in spans
        ]
        return torch.cat(parts, dim=2)

    if backend is None:
        return attend()
    with sdpa_kernel([getattr(SDPBackend, backend)]):
        return attend()


def _flash_document_attention(q, k, v, doc_id, scale):
    g = q.shape[1] // k.shape[1]
    ke, ve = (t.repeat_interleave(g, dim=1) for t in (k, v))
    backend = PEERS["flash"][0] if q.device.type == "cuda" else None
    return per_document_sdpa(q, ke, ve, _doc_spans(doc_id), backend, scale)


def check_vs_dense(L: int, heads, block: int, dtype, device) -> dict:
    """(a), bf16, full table (density 1): ours computes what flash computes, with the
    same bf16 rounding of P and dS before their dots (which the interpreter, computing
    in fp32, cannot show). Both against the PyTorch path in fp32 on the same bf16
    inputs; ours must stay within 2x flash's error (the criterion of FlashAttention's
    own tests) plus one bf16 ulp of the output scale (the interpreter converts fp32 to
    bf16 by truncation where GPUs round to nearest)."""
    from sb_titan.attention.selection import full_block_table

    (q, k, v), doc_id = _inputs(L, heads, dtype, device, seed=1)
    table = full_block_table(doc_id, heads[1], block)
    grad, scale, qkv = grad_like(q), heads[2] ** -0.5, (q, k, v)
    ref = _run_with_grads(_reference(), qkv, F32, grad, doc_id, table, scale)
    ours = _compare(_run_with_grads(_ours(), qkv, dtype, grad, doc_id, table, scale), ref)
    flash = _run_with_grads(_flash_document_attention, qkv, dtype, grad, doc_id, scale)
    dense = _compare(flash, ref)
    scales = ours["scale"]
    within = all(
        ours["max_abs_error"][n] <= 2 * dense["max_abs_error"][n] + BF16_ULP * scales[n]
        for n in GRAD_NAMES
    )
    return ours | {
        "realised_density": 1.0,
        "dense_max_abs_error": dense["max_abs_error"],
        "dense_rel_norm_error": dense["rel_norm_error"],
        "ok": ours["finite"] and within,
        "criterion": "ours <= 2 x flash + 2^-7 x max|ref| (max abs)",
    }


def part_a(grid: dict, device):
    def run(log: RowLog) -> None:
        for L, dtype in grid["checks"]:
            for h in grid["heads"]:
                for b in grid["blocks"]:
                    key = {"part": "a", "L": L, "heads": h, "block": b, "dtype": str(dtype)}
                    log.measure(key | {"check": "vs fp32"}, guarded, check, L, h, b, dtype, device)
                    if dtype == BF16 and L <= VS_DENSE_MAX_L:
                        key |= {"check": "vs flash"}
                        log.measure(key, guarded, check_vs_dense, L, h, b, dtype, device)

    return run


# ------------------------------------------------------------------------------- (b)


def _full_pairs(doc_id, heads, block: int) -> int:
    from sb_titan.attention.selection import full_block_table

    table = full_block_table(doc_id, heads[1], block)
    return int(table.kv_count.sum()) * (heads[0] // heads[1])


def _token_pairs(spans, heads) -> int:
    """Query-key pairs of document-causal attention over the q heads."""
    return sum((e - s) * (e - s + 1) // 2 for s, e in spans) * heads[0]


def peer(name: str, L: int, heads, repeats: int, device) -> dict:
    """A dense peer on (b)'s inputs: forward, and backward (forward + backward less
    forward) with the shared dO; TFLOP/s per query-key pair (FlashAttention's count)."""
    (q, k, v), doc_id = _speed_inputs(L, tuple(heads), device)
    spans, g, scale = _doc_spans(doc_id), heads[0] // heads[1], heads[2] ** -0.5
    backend = PEERS[name][0] if device.type == "cuda" else None
    ke, ve = (t.repeat_interleave(g, dim=1) for t in (k, v))
    leaves = [t.detach().requires_grad_() for t in (q, ke, ve)]
    do = grad_like(q)

    def fwd():
        with torch.no_grad():
            per_document_sdpa(q, ke, ve, spans, backend, scale)

    def fwd_bwd():
        per_document_sdpa(*leaves, spans, backend, scale).backward(do)

    def clear():
        for t in leaves:
            t.grad = None

    row = {"peer": PEERS[name][1], "peer_key": name}
    try:
        row["fwd_ms"] = median_ms(fwd, repeats, device)
        fwd_bwd_ms = median_ms(fwd_bwd, repeats, device, reset=clear)
    except Exception as e:  # noqa: BLE001 -- this backend does not run these inputs
        return row | {"error": f"{type(e).__name__}: {e}"[:300]}
    row["bwd_ms"] = None if fwd_bwd_ms is None else fwd_bwd_ms - row["fwd_ms"]
    pairs = _token_pairs(spans, heads)
    for d in ("fwd", "bwd"):
        ms = row[f"{d}_ms"]
        row[f"{d}_tflops_per_pair"] = None if ms is None else FLOPS[d] * heads[2] * pairs / ms / 1e9
    return row


def _kernel_times(q, k, v, doc_id, table, scale: float, repeats: int, device) -> dict:
    """The attention kernel families timed one by one through their launchers: forward,
    backward preprocess, dQ, and dK/dV (work plan, kernel and partial reduce); the plan
    alone as well. dO: the shared seeded one."""
    from sb_titan_kernels.attn_bwd_dkdv import attn_bwd_dkdv, plan_dkdv
    from sb_titan_kernels.attn_bwd_dq import attn_bwd_dq, attn_bwd_preprocess
    from sb_titan_kernels.attn_fwd import attn_fwd
    from sb_titan_kernels.block_sparse_attn import prepare

    p = prepare(q, k, v, doc_id, table, scale)
    bs = p.block_size
    out, lse = attn_fwd(p)
    do = grad_like(q)
    delta = attn_bwd_preprocess(out, do, bs)
    timed = {
        "fwd_ms": lambda: attn_fwd(p),
        "preprocess_ms": lambda: attn_bwd_preprocess(out, do, bs),
        "dq_ms": lambda: attn_bwd_dq(p, do, lse, delta),
        "dkdv_ms": lambda: attn_bwd_dkdv(p, do, lse, delta),
        "dkdv_plan_ms": lambda: plan_dkdv(p.q_ptr, p.q_index.numel()),
    }
    row = {name: median_ms(fn, repeats, device) for name, fn in timed.items()}
    row["preprocess_bytes"] = 2 * out.numel() * out.element_size() + 4 * delta.numel()
    return row


def speed(L: int, heads, block: int, density: float, repeats: int, device, peers: dict) -> dict:
    """(b): each kernel alone on a `topk` table, and the rates beside the peers'."""
    from sb_titan_kernels.attn_bwd_dkdv import plan_dkdv

    (q, k, v), doc_id = _speed_inputs(L, tuple(heads), device)
    table, realised = _table(q.float(), k.float(), doc_id, density, block)
    plan = plan_dkdv(table.q_ptr, table.q_index.numel())
    row = {
        "realised_density": realised,
        "block_pairs": int(table.kv_count.sum()) * (heads[0] // heads[1]),
        "full_pairs": _full_pairs(doc_id, heads, block),
        "dkdv_items": int(plan.items.shape[0]),
        "dkdv_split_blocks": int(plan.splits.shape[0]),
        "dkdv_partials": plan.num_partials,
    }
    row |= _kernel_times(q, k, v, doc_id, table, heads[2] ** -0.5, repeats, device)
    for name, p in peers.items():
        row |= {f"{name}_fwd_ms": p.get("fwd_ms"), f"{name}_bwd_ms": p.get("bwd_ms")}
    return row | rates(row, block, heads[2])


def rates(row: dict, block: int, head_dim: int) -> dict:
    """TFLOP/s per computed pair of each kernel, the peers' per pair of the full table
    (what they compute, at this block size), and ours as a fraction of each peer's.
    Missing times (dry run, a failed peer) give None."""
    unit = block * block * head_dim

    def tflops(kind: str, pairs: int, ms) -> float | None:
        return None if ms is None else FLOPS[kind] * unit * pairs / ms / 1e9

    def ratio(a, b):
        return None if a is None or not b else a / b

    pairs, full = row["block_pairs"], row["full_pairs"]
    parts = [row.get(k) for k in ("preprocess_ms", "dq_ms", "dkdv_ms")]
    out = {"bwd_ms": None if None in parts else sum(parts)}
    for kind, key in (("fwd", "fwd_ms"), ("bwd", "bwd_ms"), ("dq", "dq_ms"), ("dkdv", "dkdv_ms")):
        out[f"{kind}_tflops_per_pair"] = tflops(kind, pairs, row.get(key, out.get(key)))
    pre = row.get("preprocess_ms")
    out["preprocess_gb_per_s"] = None if pre is None else row["preprocess_bytes"] / pre / 1e6
    for name in PEERS:
        for d in ("fwd", "bwd"):
            theirs = tflops(d, full, row.get(f"{name}_{d}_ms"))
            out[f"{name}_{d}_tflops_per_pair"] = theirs
            out[f"{d}_vs_{name}"] = ratio(out[f"{d}_tflops_per_pair"], theirs)
    return out


def part_b(grid: dict, device, done: dict):
    """(b); its rows also go into `done` (the Flex rows compare with them)."""

    def run(log: RowLog) -> None:
        reps = grid["repeats"]
        for L in grid["lengths"]:
            for h in grid["heads"]:
                shape = {"L": L, "heads": h}
                peers = {}
                for name in PEERS:
                    key = {"part": "peer"} | shape
                    peers[name] = log.measure(key, peer, name, L, h, reps, device)
                for b in grid["blocks"]:
                    for rho in grid["densities"]:
                        key = {"part": "b"} | shape | {"block": b, "density": rho}
                        row = log.measure(key, guarded, speed, L, h, b, rho, reps, device, peers)
                        done[(L, tuple(h), b, rho)] = row
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    return run


def goal(rows: list[dict]) -> dict:
    """The bar at density GOAL_DENSITY: ours per computed pair >= GOAL x flash's,
    forward and backward; None where nothing was timed."""
    at = [r for r in rows if r.get("part", "b") == "b" and r["density"] == GOAL_DENSITY]
    ratios = {d: [r.get(f"{d}_vs_flash") for r in at] for d in ("fwd", "bwd")}
    met = {d: None if not v or None in v else all(x >= GOAL for x in v) for d, v in ratios.items()}
    return {"density": GOAL_DENSITY, "fraction_of_flash": GOAL, "met": met}


# ------------------------------------------------------------------------------- Flex


def flex_speed(L, heads, block: int, density: float, repeats: int, device, ours: dict) -> dict:
    """The `flex` backend's pieces on (b)'s table: BlockMask build, compiled Flex forward
    and backward (CUDA; the dry run compiles and runs the forward only: Flex has no CPU
    backward), its outputs against ours, and ours per pair as a fraction of Flex's."""
    from sb_titan.attention.flex import block_mask, compiled_flex_attention, flex_kernel_options

    (q, k, v), doc_id = _speed_inputs(L, tuple(heads), device)
    table, _ = _table(q.float(), k.float(), doc_id, density, block)
    scale, cuda = heads[2] ** -0.5, device.type == "cuda"
    flex = compiled_flex_attention(block, device.type)
    opts = flex_kernel_options(block, device.type)
    row = {"mask_ms": median_ms(lambda: block_mask(table, doc_id, q.shape[1]), repeats, device)}
    mask = block_mask(table, doc_id, q.shape[1])

    def call(*xs):
        return flex(*xs, block_mask=mask, scale=scale, enable_gqa=True, kernel_options=opts)

    do = grad_like(q)
    leaves = [t.detach().requires_grad_(cuda) for t in (q, k, v)]
    got = call(*leaves)
    mine = _ours()(*leaves, doc_id, table, scale) if cuda else None
    if cuda:
        got.backward(do)
        got_grads = [got.detach()] + [t.grad for t in leaves]
        for t in leaves:
            t.grad = None
        mine.backward(do)
        mine_grads = [mine.detach()] + [t.grad for t in leaves]
        row["rel_norm_vs_ours"] = {
            n: rel_norm(a, b) for n, a, b in zip(GRAD_NAMES, got_grads, mine_grads, strict=True)
        }
    else:
        with torch.no_grad():
            mine = _ours()(q, k, v, doc_id, table, scale)
        row["rel_norm_vs_ours"] = {"out": rel_norm(got.detach(), mine)}

    def fwd():
        with torch.no_grad():
            call(q, k, v)

    def fwd_bwd():
        call(*leaves).backward(do)

    def clear():
        for t in leaves:
            t.grad = None

    row["fwd_ms"] = median_ms(fwd, repeats, device)
    fwd_bwd_ms = median_ms(fwd_bwd, repeats, device, reset=clear) if cuda else None
    row["bwd_ms"] = None if fwd_bwd_ms is None else fwd_bwd_ms - row["fwd_ms"]
    unit, pairs = block * block * heads[2], int(table.kv_count.sum()) * (heads[0] // heads[1])
    for d in ("fwd", "bwd"):
        ms = row[f"{d}_ms"]
        row[f"{d}_tflops_per_pair"] = None if ms is None else FLOPS[d] * unit * pairs / ms / 1e9
        mine_ms = ours.get(f"{d}_ms")
        row[f"ours_{d}_vs_flex"] = None if ms is None or not mine_ms else ms / mine_ms
    return row


def part_flex(grid: dict, device, done: dict, measure=flex_speed):
    """Flex on (b)'s tables, after everything else. Any failure becomes the row's
    "error" (Flex is a peer, not the subject: it never fails the run)."""

    def run(log: RowLog) -> None:
        for L in grid["lengths"]:
            for h in grid["heads"]:
                for b in grid["blocks"]:
                    for rho in grid["densities"]:
                        key = {"part": "flex", "L": L, "heads": h, "block": b, "density": rho}
                        ours = done.get((L, tuple(h), b, rho), {})
                        reps = grid["repeats"]
                        log.measure(key, guarded, measure, L, h, b, rho, reps, device, ours)
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    return run


def raise_recompile_limit(limit: int = 256) -> None:
    """Every Flex shape of a run is its own compile: past Dynamo's default limit (8) Flex
    would fall back to eager, which builds the L x L score matrix."""
    import torch._dynamo.config as dynamo

    for name, value in (("recompile_limit", limit), ("cache_size_limit", limit)):
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), value))
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), 4 * limit))


# ------------------------------------------------------------------------------- run


def device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)"


def env_versions() -> dict:
    import triton

    kernels = sys.modules.get("sb_titan_kernels") or importlib.import_module("sb_titan_kernels")
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "sb_titan_kernels": str(Path(kernels.__file__).parent),
    }


def exit_code(rows: list[dict]) -> int:
    """1 if a correctness row failed or raised (an error row: guarded, so the run goes
    on to (b)); Flex rows, peers and a budget stop never fail."""
    return 1 if any(r["part"] == "a" and not r.get("ok") for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:
        return report(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="a,b,flex", help="comma list of a, b, flex, c")
    ap.add_argument("--quick", action="store_true", help="the <= 5 minute grid")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (interpreter)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    ap.add_argument("--budget-s", type=float, help="start no row that would end past this")
    ap.add_argument("--max-rows", type=int, help="stop after this many rows")
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if set(parts) - {"a", "b", "flex", "c"}:
        ap.error(f"--parts: expected a comma list of a, b, flex, c; got {args.parts!r}")
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA GPU here; --dry-run checks the code path", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    grid = GRIDS["dry" if args.dry_run else "quick" if args.quick else "full"]
    name = "dry_run" if args.dry_run else device_name(device).lower().replace(" ", "_")
    path = args.out / f"{'train' if parts == ['c'] else 'gpu'}_{name}.jsonl"
    log = RowLog(path, args.budget_s, args.max_rows)
    log.write({"part": "run", "device": device_name(device), "env": env_versions()} | vars(args))
    raise_recompile_limit()
    done: dict = {}
    steps = {"a": part_a(grid, device), "b": part_b(grid, device, done)}
    steps["flex"] = part_flex(grid, device, done)
    if "c" in parts:
        import gpu_train

        steps["c"] = gpu_train.part_c(device, args.dry_run, args.quick, grid["repeats"])
    reason = run_rows(log, [steps[p] for p in parts])
    rows = read_rows([path])
    print(markdown(rows))
    print(f"goal: {goal([r for r in rows if r['part'] == 'b'])}")
    print(f"wrote {path} ({log.rows} rows, stopped: {reason})")
    return exit_code(rows)


def report(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/gpu.py report", description="JSONL -> markdown")
    ap.add_argument("files", nargs="*", type=Path, help="JSONL files (default: DIR/*.jsonl)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args(argv)
    files = args.files or sorted(args.out.glob("*.jsonl"))
    if not files:
        print(f"bench/gpu.py report: no JSONL under {args.out}", file=sys.stderr)
        return 2
    rows = read_rows(files)
    print(markdown(rows))
    print(f"\ngoal: {goal([r for r in rows if r['part'] == 'b'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
