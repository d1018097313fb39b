"""What a person with a GPU runs first: sb_titan's attention kernels, checked and timed.

    python bench/gpu.py [--parts a,b,c] [--out bench/results]     # on a CUDA GPU
    python bench/gpu.py --dry-run                                 # CPU, tiny shapes (CI)

(a) correctness: the Triton block-sparse forward and backward against the recipe's
    PyTorch path (sb_titan.attention.block_sparse, fp32) on the same block table, from
    real `topk` selection, GQA 7:1, L in {8K, 32K, 128K}, block sizes 64 and 128, fp32
    and bf16. bf16 also on the full table against dense flash (L <= 32K): the kernels
    round P and dS to bf16 before their dots as flash does, which only a GPU shows (the
    interpreter computes in fp32), so ours must stay within 2x flash's error. The
    `flex` backend (sb_titan.attention.flex) is checked on the same tables (forward
    only off CUDA: Flex has no CPU backward).
(b) speed, L in {32K, 128K}, heads 14/2 (D 64) and 28/4 (D 128), block sizes 64 and
    128, tables from `topk` selection at 1 (every allowed block), 0.5, 0.3 and 0.1 on
    structured q/k: each kernel timed alone through its launcher (forward, backward
    preprocess, dQ, dK/dV with its work plan and partial reduce), CUDA events, median of
    repeats after warm-up, as TFLOP/s per computed block pair (4·Bs²·D per pair
    forward, 10·Bs²·D backward: recomputation not counted, as for flash; dQ 6·Bs²·D and
    dK/dV 8·Bs²·D, what each executes). Beside them, on the same inputs: dense
    document-masked attention (the recipe's dense path, `kernel` names it: varlen flash
    where torch has it, no L x L mask; per pair of the full table), SDPA causal over the
    whole row with the flash and the cuDNN backend, and FlexAttention on the same block
    table (the `flex` backend's BlockMask build, forward and backward). Goal columns:
    ours per pair as a fraction of dense flash's (the bar: >= 0.6 at density 0.1) and
    of Flex's.
(c) a one-GPU training step: needs torchtitan and torchdata; says what is missing and
    skips otherwise. It runs `sb_titan.tools.train` with Qwen2.5-0.5B at 32K rows, sparse
    and dense, compile off and on, and reports step time and peak memory from
    TensorBoard (the dry run loads each variant's config instead). The four-variant
    balance comparison needs >= 2 GPUs (bench/e2e.py).

(a) and (b) import only torch, Triton and the recipe's attention ops and kernels, so they
run from a source checkout without torchtitan. `--dry-run` runs the same code at tiny
shapes on the CPU with the Triton interpreter (timings there mean nothing and are not
reported). Writes `<out>/gpu_<device>.json` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if "--dry-run" in sys.argv:  # before Triton is imported: the interpreter is chosen then
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("SB_TRITON_UPCAST", "1")
if importlib.util.find_spec("sb_titan") is None:  # a source checkout without install
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

HEADS = [(14, 2, 64), (28, 4, 128)]  # Qwen2.5-0.5B and 7B: GQA 7:1, head_dim 64 / 128
FULL = {"lengths": [8192, 32768, 131072], "blocks": [64, 128], "heads": HEADS, "repeats": 10}
DRY = {"lengths": [256], "blocks": [64], "heads": [(7, 1, 64)], "repeats": 1}
SPEED_LENGTHS = [32768, 131072]  # (b) on the GPU; the dry run takes DRY's
DENSITIES = [1.0, 0.5, 0.3, 0.1]  # topk budgets of (b); 1.0 keeps every allowed block
# max abs error vs the fp32 reference over max(max |reference|, 1), as in
# tests/test_kernels.py: bf16 rounds P, dS and the outputs (8 mantissa bits), and dK/dV
# sum over G heads and many query blocks, so their scale grows with L
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 2.5e-2}
BF16_ULP = 2.0**-7  # bf16 spacing relative to a value: at most 2^-7 (7 stored bits)
VS_DENSE_MAX_L = 32768  # (a)'s bf16 comparison with dense flash (its fp32 reference is slow)
GOAL = 0.6  # (b): TFLOP/s per computed pair at density 0.1 as a fraction of dense FA's
GOAL_DENSITY = 0.1
# FLOPs per computed block pair and q head, over Bs^2 * D: forward QK^T and PV; backward
# 2.5x forward (the FlashAttention convention, recomputation not counted), so per-pair
# rates of the backward compare with dense flash's; dQ and dK/dV count what each
# kernel executes (recomputation of S and dP included).
FLOPS = {"fwd": 4, "bwd": 10, "dq": 6, "dkdv": 8}
GRAD_NAMES = ("out", "dq", "dk", "dv")


def _inputs(L: int, heads, dtype, device, seed: int = 0, structured: bool = False):
    """q, k, v [1, H, L, D] and doc_id [1, L]: two documents, the second starting
    mid-row, so document masking is exercised. `structured` adds to q and k a slowly
    varying component shared by each kv head's group (sinusoids, 2K-64K-token periods),
    so selection sees attention that is not flat (tables like trained ones: heavy sinks,
    popular blocks) rather than noise."""
    hq, hkv, d = heads
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(1, h, L, d, generator=gen) for h in (hq, hkv, hkv))
    if structured:
        period = 2048.0 * 32.0 ** torch.rand(hkv, 1, d, generator=gen)
        phase = 2 * math.pi * torch.rand(hkv, 1, d, generator=gen)
        pos = torch.arange(L, dtype=torch.float32)[None, :, None]
        smooth = torch.sin(2 * math.pi * pos / period + phase)[None]
        q += smooth.repeat_interleave(hq // hkv, dim=1)
        k += smooth
    doc_id = (torch.arange(L) >= L // 2 + 17).to(torch.int32)[None]
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)], doc_id.to(device)


@functools.lru_cache(maxsize=1)
def _speed_inputs(L: int, heads: tuple[int, int, int], device):
    """(b)'s inputs, made once per shape (each takes seconds at 128K): structured q/k."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return _inputs(L, heads, dtype, device, structured=True)


def _table(q, k, doc_id, density: float, block: int):
    from sb_titan.attention.selection import select_blocks

    table, stats = select_blocks(q, k, doc_id, density, policy="topk", block_size=block)
    return table, float(stats.density.mean())


def _grad_like(q: torch.Tensor) -> torch.Tensor:
    """A seeded upstream gradient (the global RNG would make the checks vary by run)."""
    gen = torch.Generator(device="cpu").manual_seed(123)
    return torch.randn(q.shape, generator=gen).to(q)


def _run_with_grads(fn, qkv, cast, doc_id, grad, *args) -> list:
    """[out, dq, dk, dv] in fp32 of fn(q, k, v, doc_id, *args) on inputs cast to `cast`."""
    xs = [t.detach().to(cast).requires_grad_() for t in qkv]
    out = fn(*xs, doc_id, *args)
    out.backward(grad.to(out.dtype))
    return [out.detach().float()] + [x.grad.float() for x in xs]


def _errors(got: list, ref: list) -> dict:
    return {n: float((a - b).abs().max()) for n, a, b in zip(GRAD_NAMES, got, ref, strict=True)}


def _scales(ref: list) -> dict:
    return {n: float(r.abs().max()) for n, r in zip(GRAD_NAMES, ref, strict=True)}


def check(L: int, heads, block: int, density: float, dtype, device) -> dict:
    """(a): max abs error of out, dq, dk, dv against the PyTorch path in fp32."""
    from sb_titan_kernels import block_sparse_attention_triton

    from sb_titan.attention.ops import block_sparse_attention

    (q, k, v), doc_id = _inputs(L, heads, dtype, device)
    table, realised = _table(q.float(), k.float(), doc_id, density, block)
    grad = _grad_like(q)
    ours = _run_with_grads(block_sparse_attention_triton, (q, k, v), dtype, doc_id, grad, table)
    ref = _run_with_grads(block_sparse_attention, (q, k, v), torch.float32, doc_id, grad, table)
    errors, scales = _errors(ours, ref), _scales(ref)
    ok = all(errors[n] <= TOLERANCE[dtype] * max(scales[n], 1.0) for n in GRAD_NAMES)
    row = {"realised_density": realised, "max_abs_error": errors, "scale": scales, "ok": ok}
    return row | _check_flex((q, k, v), doc_id, grad, table, ref, scales, dtype, device)


def _check_flex(qkv, doc_id, grad, table, ref: list, scales: dict, dtype, device) -> dict:
    """The `flex` backend on the same table against the same fp32 reference (out only
    off CUDA: Flex has no CPU backward)."""
    from sb_titan.attention.flex import flex_attention

    try:
        backward = device.type == "cuda"
        xs = [t.detach().to(dtype).requires_grad_(backward) for t in qkv]
        with torch.set_grad_enabled(backward):
            out = flex_attention(*xs, doc_id, table)
        got = [out.detach().float()]
        if backward:
            out.backward(grad.to(out.dtype))
            got += [x.grad.float() for x in xs]
        names = GRAD_NAMES[: len(got)]
        errors = {n: float((a - b).abs().max()) for n, a, b in zip(names, got, ref, strict=False)}
        ok = all(errors[n] <= TOLERANCE[dtype] * max(scales[n], 1.0) for n in names)
        return {"flex_max_abs_error": errors, "flex_ok": ok}
    except Exception as e:  # report, do not hide: the Triton check still stands
        return {"flex_error": f"{type(e).__name__}: {e}"[:300], "flex_ok": False}


def check_vs_dense(L: int, heads, block: int, dtype, device) -> dict:
    """(a), bf16: on the full table (density 1) the kernels compute what dense flash
    computes, with the same bf16 rounding of P and dS before their dots (which the
    interpreter, computing in fp32, cannot show). Both against the PyTorch path in fp32
    on the same bf16 inputs; ours must stay within 2x dense flash's error (the
    criterion of FlashAttention's own tests) plus one bf16 ulp of the output scale (the
    Triton interpreter converts fp32 to bf16 by truncation where GPUs round to nearest,
    so in the dry run ours is up to 2x the CPU path's error by construction)."""
    from sb_titan_kernels import block_sparse_attention_triton

    from sb_titan.attention.dense import dense_document_attention
    from sb_titan.attention.ops import block_sparse_attention
    from sb_titan.attention.selection import full_block_table

    (q, k, v), doc_id = _inputs(L, heads, dtype, device, seed=1)
    table = full_block_table(doc_id, heads[1], block)
    grad = _grad_like(q)
    qkv = (q, k, v)
    ref = _run_with_grads(block_sparse_attention, qkv, torch.float32, doc_id, grad, table)
    ours = _errors(
        _run_with_grads(block_sparse_attention_triton, qkv, dtype, doc_id, grad, table), ref
    )
    dense = _errors(_run_with_grads(dense_document_attention, qkv, dtype, doc_id, grad), ref)
    scales = _scales(ref)
    ok = all(ours[n] <= 2 * dense[n] + BF16_ULP * scales[n] for n in GRAD_NAMES)
    return {
        "realised_density": 1.0,
        "max_abs_error": ours,
        "dense_max_abs_error": dense,
        "scale": scales,
        "ok": ok,
        "criterion": "ours <= 2 x dense + 2^-7 x max|ref|",
    }


def _median_ms(fn, repeats: int, device) -> float | None:
    if device.type != "cuda":
        fn()  # the dry run executes the code path once; its time means nothing
        return None
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def speed(L: int, heads, block: int, density: float, repeats: int, device, dense: dict) -> dict:
    """(b): each Triton kernel timed alone, the autograd path end to end, and the peers
    on the same inputs: dense flash (`dense`, timed once per shape by `dense_peers`) and
    FlexAttention on the same block table."""
    from sb_titan_kernels import block_sparse_attention_triton
    from sb_titan_kernels.block_sparse_attn import plan_dkdv

    from sb_titan.attention.selection import full_block_table

    (q, k, v), doc_id = _speed_inputs(L, tuple(heads), device)
    table, realised = _table(q.float(), k.float(), doc_id, density, block)
    g = heads[0] // heads[1]
    plan = plan_dkdv(table.q_ptr, table.q_index.numel())
    row = {
        "realised_density": realised,
        "block_pairs": int(table.kv_count.sum()) * g,  # computed pairs, over the q heads
        "full_pairs": int(full_block_table(doc_id, heads[1], block).kv_count.sum()) * g,
        "dkdv_items": int(plan.items.shape[0]),
        "dkdv_split_blocks": int(plan.splits.shape[0]),
        "dkdv_partials": plan.num_partials,
        "fwd_max_over_mean": _max_over_mean(table.kv_count),
    }
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            block_sparse_attention_triton(q, k, v, doc_id, table)

    def fwd_bwd():
        out = block_sparse_attention_triton(qg, kg, vg, doc_id, table)
        out.backward(torch.ones_like(out))

    row["triton_fwd_ms"] = _median_ms(fwd, repeats, device)
    row["triton_fwd_bwd_ms"] = _median_ms(fwd_bwd, repeats, device)
    row.update(_kernel_times(q, k, v, doc_id, table, repeats, device))
    row.update(_flex_peer(q, k, v, doc_id, table, block, repeats, device))
    row.update({f"dense_{n}": t for n, t in dense.items()})
    return row | rates(row, block, heads[2])


def _max_over_mean(count: torch.Tensor) -> float:
    c = count.double()
    return float(c.max() / c.mean())


def _kernel_times(q, k, v, doc_id, table, repeats: int, device) -> dict:
    """The four kernels of sb_titan_kernels.block_sparse_attn timed one by one through
    their launchers: forward (with its launch order), backward preprocess, dQ, and
    dK/dV (work plan, kernel and partial reduce); the plan alone as well."""
    from sb_titan_kernels import block_sparse_attn as kern  # the kernels' own stages

    p = kern._prepare(q, k, v, doc_id, table, None)
    bs = p.block_size
    out, lse = kern._fwd(p)
    do = torch.randn_like(out)
    delta = kern._bwd_preprocess(out, do, bs)
    timed = {
        "fwd_ms": lambda: kern._fwd(p),
        "preprocess_ms": lambda: kern._bwd_preprocess(out, do, bs),
        "dq_ms": lambda: kern._bwd_dq(p, do, lse, delta),
        "dkdv_ms": lambda: kern._bwd_dkdv(p, do, lse, delta),
        "dkdv_plan_ms": lambda: kern.plan_dkdv(p.q_ptr, p.q_index.numel()),
    }
    row = {name: _median_ms(fn, repeats, device) for name, fn in timed.items()}
    row["preprocess_bytes"] = 2 * out.numel() * out.element_size() + 4 * delta.numel()
    return row


def rates(row: dict, block: int, head_dim: int) -> dict:
    """TFLOP/s per computed pair of each kernel and of the peers, and the goal columns:
    ours per pair as a fraction of dense flash's (which computes `full_pairs`) and of
    Flex's (same table, same pairs). Missing times (dry run, a failed peer) give none."""
    unit = block * block * head_dim

    def tflops(kind: str, pairs: int, ms) -> float | None:
        return None if ms is None else FLOPS[kind] * unit * pairs / ms / 1e9

    def minus(a, b):
        return None if a is None or b is None else a - b

    def ratio(a, b):
        return None if a is None or not b else a / b

    pairs, full = row["block_pairs"], row["full_pairs"]
    parts = [row.get(k) for k in ("preprocess_ms", "dq_ms", "dkdv_ms")]
    bwd_ms = None if None in parts else sum(parts)
    dense_bwd_ms = minus(row.get("dense_fwd_bwd_ms"), row.get("dense_fwd_ms"))
    flex_bwd_ms = minus(row.get("flex_fwd_bwd_ms"), row.get("flex_fwd_ms"))
    out = {
        "bwd_ms": bwd_ms,
        "fwd_tflops_per_pair": tflops("fwd", pairs, row.get("fwd_ms")),
        "bwd_tflops_per_pair": tflops("bwd", pairs, bwd_ms),
        "dq_tflops_per_pair": tflops("dq", pairs, row.get("dq_ms")),
        "dkdv_tflops_per_pair": tflops("dkdv", pairs, row.get("dkdv_ms")),
        "dense_fwd_tflops_per_pair": tflops("fwd", full, row.get("dense_fwd_ms")),
        "dense_bwd_tflops_per_pair": tflops("bwd", full, dense_bwd_ms),
        "flex_fwd_tflops_per_pair": tflops("fwd", pairs, row.get("flex_fwd_ms")),
        "flex_bwd_tflops_per_pair": tflops("bwd", pairs, flex_bwd_ms),
    }
    pre = row.get("preprocess_ms")
    out["preprocess_gb_per_s"] = None if pre is None else row["preprocess_bytes"] / pre / 1e6
    for d in ("fwd", "bwd"):
        mine = out[f"{d}_tflops_per_pair"]
        out[f"{d}_vs_dense"] = ratio(mine, out[f"dense_{d}_tflops_per_pair"])
        out[f"{d}_vs_flex"] = ratio(mine, out[f"flex_{d}_tflops_per_pair"])
    return out


def dense_peers(L: int, heads, repeats: int, device) -> dict:
    """(b)'s dense references, once per shape (they do not depend on the table): the
    recipe's dense document-masked path (`dense_kernel` names it: varlen flash on CUDA,
    no L x L mask) forward and forward+backward, and SDPA causal over the whole row
    (one document, so more pairs than ours) with only the flash or only the cuDNN
    backend, K/V expanded to the q heads outside the timing."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sb_titan.attention.dense import (
        choose_dense_kernel,
        dense_document_attention,
        device_support,
    )

    (q, k, v), doc_id = _speed_inputs(L, tuple(heads), device)
    support = device_support(device)
    out: dict = {"kernel": choose_dense_kernel(device.type, q.dtype, q.shape[-1], support)}
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def dense_fwd():
        with torch.no_grad():
            dense_document_attention(q, k, v, doc_id)

    def dense_fwd_bwd():
        o = dense_document_attention(qg, kg, vg, doc_id)
        o.backward(torch.ones_like(o))

    out["fwd_ms"] = _median_ms(dense_fwd, repeats, device)
    out["fwd_bwd_ms"] = _median_ms(dense_fwd_bwd, repeats, device)
    g = heads[0] // heads[1]
    ke, ve = (t.repeat_interleave(g, dim=1).detach().requires_grad_() for t in (k, v))

    def sdpa_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

    def sdpa_fwd_bwd():
        o = F.scaled_dot_product_attention(qg, ke, ve, is_causal=True)
        o.backward(torch.ones_like(o))

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    for name, backend in backends.items():
        try:
            with sdpa_kernel([backend]):
                out[f"sdpa_{name}_causal_fwd_ms"] = _median_ms(sdpa_fwd, repeats, device)
                out[f"sdpa_{name}_causal_fwd_bwd_ms"] = _median_ms(sdpa_fwd_bwd, repeats, device)
        except RuntimeError as e:  # backend not available for this device / dtype / shape
            out[f"sdpa_{name}_error"] = f"{type(e).__name__}: {e}"[:200]
    return out


def _flex_peer(q, k, v, doc_id, table, block: int, repeats: int, device) -> dict:
    """The `flex` backend's pieces on the same block table: the BlockMask build, then
    compiled Flex forward and forward+backward (CUDA: the dry run builds the BlockMask
    only; Flex has no CPU backward)."""
    out: dict = {}
    try:
        from sb_titan.attention.flex import block_mask, compiled_flex_attention

        mask = block_mask(table, doc_id, q.shape[1])
        if device.type != "cuda":
            return {"flex": "BlockMask built; timed on CUDA only"}
        # one compiled Flex for every shape of the run: above dynamo's default of 8
        # recompiles it would fall back to eager Flex, which builds the full score matrix
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        flex = compiled_flex_attention()
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def flex_fwd():
            with torch.no_grad():
                flex(q, k, v, block_mask=mask, enable_gqa=True)

        def flex_fwd_bwd():
            o = flex(qg, kg, vg, block_mask=mask, enable_gqa=True)
            o.backward(torch.ones_like(o))

        build = lambda: block_mask(table, doc_id, q.shape[1])  # noqa: E731
        out["flex_mask_ms"] = _median_ms(build, repeats, device)
        out["flex_fwd_ms"] = _median_ms(flex_fwd, repeats, device)
        out["flex_fwd_bwd_ms"] = _median_ms(flex_fwd_bwd, repeats, device)
    except Exception as e:  # report, do not hide: Flex is a peer, not the subject
        out["flex_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


TRAIN_CONFIG = REPO / "train_configs" / "qwen2.5_0.5b_64k.toml"
# One GPU, 32K rows, the synthetic corpus, no pipeline: the step's attention and memory
# alone (the balance comparison needs >= 2 GPUs: bench/e2e.py).
ONE_GPU = ["--training.seq_len", "32768", "--training.local_batch_size", "1"]
ONE_GPU += ["--parallelism.pipeline_parallel_degree", "1"]
ONE_GPU += ["--parallelism.data_parallel_shard_degree", "-1"]
ONE_GPU += ["--dataloader.dataset", "synthetic", "--sab.policy", "sequential"]
ONE_GPU += ["--dst.no-enabled", "--checkpoint.no-enable", "--metrics.log_freq", "1"]
ONE_GPU += ["--training.steps", "6", "--hf_assets_path", "sb_titan/assets/tokenizer"]
TRAIN_VARIANTS = {
    "sparse": [],
    "dense": ["--sparse_attention.no-enabled"],
    "sparse_compiled": ["--compile.enable"],
    "dense_compiled": ["--sparse_attention.no-enabled", "--compile.enable"],
    "sparse_flex": ["--sparse_attention.backend", "flex"],
}


def check_train_variants() -> dict:
    """Dry run of (c): every variant's overrides load against the shipped config and pass
    the launcher's checks for one process (profile, dataset, vocabulary, step shape)."""
    if importlib.util.find_spec("torchtitan") is None:
        return {"skipped": "needs torchtitan"}
    from sb_titan.config.preflight import preflight
    from sb_titan.config.toml import load_config

    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = "1"  # preflight checks the step shape for this world size
    try:
        for extra in TRAIN_VARIANTS.values():
            preflight(load_config(TRAIN_CONFIG, [*ONE_GPU, *extra]), TRAIN_CONFIG)
    finally:
        if saved is None:
            del os.environ["WORLD_SIZE"]
        else:
            os.environ["WORLD_SIZE"] = saved
    return {"checked": sorted(TRAIN_VARIANTS)}


def train_step(device) -> dict:
    """(c): what it needs, and a short run of each variant when it is there."""
    missing = [m for m in ("torchtitan", "torchdata") if importlib.util.find_spec(m) is None]
    if device.type != "cuda":
        missing.append("a CUDA GPU")
    if missing:
        return {"skipped": f"needs {', '.join(missing)}"}
    rows = {}
    for name, extra in TRAIN_VARIANTS.items():
        with tempfile.TemporaryDirectory() as dump:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            cmd += ["--nproc_per_node=1", "-m", "sb_titan.tools.train", "--config_file"]
            cmd += [str(TRAIN_CONFIG), "--dump_folder", dump, *ONE_GPU, *extra]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                rows[name] = {"failed": (proc.stdout + proc.stderr)[-1500:]}
                continue
            from sb_titan.runtime.tensorboard import read_scalars

            scalars = read_scalars(dump)
            steps = scalars.get("time_metrics/end_to_end(s)", {})
            memory = scalars.get("memory/max_reserved(GiB)", {})
            rows[name] = {
                "step_s": statistics.median(v for s, v in steps.items() if s > 2),
                "peak_reserved_gib": max(memory.values()) if memory else None,
            }
    return rows


def run(parts: set[str], dry_run: bool) -> dict:
    device = torch.device("cpu" if dry_run else "cuda")
    grid = DRY if dry_run else FULL
    # bf16 in the dry run runs the code path only: the interpreter's dots are fp32
    dtypes = [torch.float32, torch.bfloat16]
    report: dict = {"device": _device_name(device), "dry_run": dry_run, "env": _env()}
    if "a" in parts:
        rows = []
        for L in grid["lengths"]:
            for h in grid["heads"]:
                for b in grid["blocks"]:
                    for dt in dtypes:
                        key = {"L": L, "heads": h, "block": b, "dtype": str(dt)}
                        rows.append(key | {"check": "vs fp32"} | check(L, h, b, 0.25, dt, device))
                        if dt == torch.bfloat16 and L <= VS_DENSE_MAX_L:
                            result = check_vs_dense(L, h, b, dt, device)
                            rows.append(key | {"check": "vs dense"} | result)
        report["correctness"] = rows
    if "b" in parts:
        lengths = grid["lengths"] if dry_run else SPEED_LENGTHS
        rows = []
        for L in lengths:
            for h in grid["heads"]:
                dense = dense_peers(L, h, grid["repeats"], device)
                report.setdefault("dense", []).append({"L": L, "heads": h} | dense)
                peer = {k: dense.get(k) for k in ("fwd_ms", "fwd_bwd_ms")}
                for b in grid["blocks"]:
                    for rho in DENSITIES:
                        row = speed(L, h, b, rho, grid["repeats"], device, peer)
                        rows.append({"L": L, "heads": h, "block": b, "density": rho} | row)
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
        report["speed"] = rows
        report["goal"] = goal(rows)
    if "c" in parts:
        report["train_step"] = check_train_variants() if dry_run else train_step(device)
    return report


def goal(rows: list[dict]) -> dict:
    """The bar at density GOAL_DENSITY: ours per computed pair >= GOAL x dense flash's,
    forward and backward; None where nothing was timed."""
    at = [r for r in rows if r["density"] == GOAL_DENSITY]
    ratios = {d: [r.get(f"{d}_vs_dense") for r in at] for d in ("fwd", "bwd")}
    met = {d: None if not v or None in v else all(x >= GOAL for x in v) for d, v in ratios.items()}
    return {"density": GOAL_DENSITY, "fraction_of_dense": GOAL, "met": met}


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)"


def _env() -> dict:
    import triton

    cuda = torch.version.cuda
    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": cuda}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


SPEED_COLUMNS = {
    "fwd ms": "fwd_ms",
    "pre ms": "preprocess_ms",
    "dQ ms": "dq_ms",
    "dK/dV ms": "dkdv_ms",
    "fwd TF/s": "fwd_tflops_per_pair",
    "bwd TF/s": "bwd_tflops_per_pair",
    "dQ TF/s": "dq_tflops_per_pair",
    "dK/dV TF/s": "dkdv_tflops_per_pair",
    "pre GB/s": "preprocess_gb_per_s",
    "dense fwd TF/s": "dense_fwd_tflops_per_pair",
    "dense bwd TF/s": "dense_bwd_tflops_per_pair",
    "fwd/dense": "fwd_vs_dense",
    "bwd/dense": "bwd_vs_dense",
    "Flex mask ms": "flex_mask_ms",
    "Flex fwd TF/s": "flex_fwd_tflops_per_pair",
    "Flex bwd TF/s": "flex_bwd_tflops_per_pair",
    "fwd/Flex": "fwd_vs_flex",
    "bwd/Flex": "bwd_vs_flex",
}


def markdown(report: dict) -> str:
    lines = [f"device: {report['device']}"]
    if "correctness" in report:
        lines += [
            "",
            "| L | heads | block | dtype | check | density | max abs error (out, dq, dk, dv) | "
            "dense flash's | ok | Flex max abs error | Flex ok |",
        ]
        lines += ["|---" * 11 + "|"]
        for r in report["correctness"]:
            errs = [r["max_abs_error"], r.get("dense_max_abs_error"), r.get("flex_max_abs_error")]
            cells = ["-" if e is None else ", ".join(f"{v:.1e}" for v in e.values()) for e in errs]
            flex_ok = r.get("flex_ok", "-")
            lines.append(
                f"| {r['L']} | {r['heads']} | {r['block']} | {r['dtype']} | {r['check']} | "
                f"{r['realised_density']:.3f} | {cells[0]} | {cells[1]} | {r['ok']} | "
                f"{r.get('flex_error', cells[2])} | {flex_ok} |"
            )
    if "speed" in report:
        lines += ["", "TFLOP/s per computed block pair (dense: per pair of the full table)"]
        lines += ["| L | heads | block | β | density | " + " | ".join(SPEED_COLUMNS) + " |"]
        lines += ["|" + "---|" * (5 + len(SPEED_COLUMNS))]
        for r in report["speed"]:
            lines.append(
                f"| {r['L']} | {r['heads']} | {r['block']} | {r['density']} | "
                f"{r['realised_density']:.3f} | "
                + " | ".join(_fmt(r.get(k)) for k in SPEED_COLUMNS.values())
                + " |"
            )
        lines += ["", f"goal: {json.dumps(report['goal'])}"]
    if "dense" in report:
        keys = ["fwd_ms", "fwd_bwd_ms"]
        keys += [f"sdpa_{b}_causal_{d}_ms" for b in ("flash", "cudnn") for d in ("fwd", "fwd_bwd")]
        lines += ["", "| L | heads | dense kernel | " + " | ".join(keys) + " |"]
        lines += ["|" + "---|" * (3 + len(keys))]
        for r in report["dense"]:
            cells = " | ".join(_fmt(r.get(k)) for k in keys)
            lines.append(f"| {r['L']} | {r['heads']} | {r['kernel']} | {cells} |")
    if "train_step" in report:
        lines += ["", f"training step: {json.dumps(report['train_step'])}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="a,b,c", help="comma list of a, b, c")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (interpreter)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "bench/gpu.py: no CUDA GPU here; use --dry-run to check the code path", file=sys.stderr
        )
        return 2
    report = run(set(args.parts.split(",")), args.dry_run)
    print(markdown(report))
    args.out.mkdir(parents=True, exist_ok=True)
    name = "dry_run" if args.dry_run else report["device"].lower().replace(" ", "_")
    path = args.out / f"gpu_{name}.json"
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    failed = [r for r in report.get("correctness", []) if not (r["ok"] and r.get("flex_ok", True))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
