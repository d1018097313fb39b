"""What a person with a GPU runs first: sb_titan's attention kernels, checked and timed.

    python bench/gpu.py [--parts a,b,c] [--out bench/results]     # on a CUDA GPU
    python bench/gpu.py --dry-run                                 # CPU, tiny shapes (CI)

(a) correctness: the Triton block-sparse forward and backward against the recipe's
    PyTorch path (sb_titan.attention.block_sparse, fp32) on the same block table, from
    real `topk` selection, GQA 7:1, L in {8K, 32K, 128K}, block sizes 64 and 128; the
    `flex` backend (sb_titan.attention.flex) likewise (forward only off CUDA).
(b) speed: forward and forward+backward of the Triton kernels at densities 1, 0.5, 0.25
    and 0.1, as TFLOP/s per computed block pair (4·Bs²·D per pair forward, 10·Bs²·D
    backward with recomputation), beside dense document-masked attention (the recipe's
    dense path, `dense_kernel` names it: varlen flash where torch has it, no L x L mask)
    and FlexAttention on the same block table (the `flex` backend: its BlockMask build,
    forward and forward+backward), in one run, CUDA events, median of
    repeats after warm-up. The backward's kernels are also timed one by one:
    preprocess (GB/s), dQ and dK/dV (TFLOP/s of the work each executes, recomputation
    included).
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
import importlib.util
import json
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
DENSITIES = [1.0, 0.5, 0.25, 0.1]
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}  # max abs error vs fp32 reference


def _inputs(L: int, heads: tuple[int, int, int], dtype, device, seed: int = 0):
    hq, hkv, d = heads
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(1, h, L, d, generator=gen) for h in (hq, hkv, hkv))
    # two documents, the second starting mid-row, so document masking is exercised
    doc_id = (torch.arange(L) >= L // 2 + 17).to(torch.int32)[None]
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)], doc_id.to(device)


def _table(q, k, doc_id, density: float, block: int):
    from sb_titan.attention.selection import select_blocks

    table, stats = select_blocks(q, k, doc_id, density, policy="topk", block_size=block)
    return table, float(stats.density.mean())


def check(L: int, heads, block: int, density: float, dtype, device) -> dict:
    """(a): max abs error of out, dq, dk, dv against the PyTorch path in fp32, for the
    Triton kernels and for the `flex` backend (out only off CUDA: no CPU backward)."""
    from sb_titan_kernels import block_sparse_attention_triton

    from sb_titan.attention.flex import flex_attention
    from sb_titan.attention.ops import block_sparse_attention

    (q, k, v), doc_id = _inputs(L, heads, dtype, device)
    table, realised = _table(q.float(), k.float(), doc_id, density, block)
    grad = torch.randn_like(q)
    names = ("out", "dq", "dk", "dv")
    results = []
    for fn, cast in ((block_sparse_attention_triton, dtype), (block_sparse_attention, None)):
        xs = [t.detach().to(cast or torch.float32).requires_grad_() for t in (q, k, v)]
        out = fn(*xs, doc_id, table)
        out.backward(grad.to(out.dtype))
        results.append([out.detach().float()] + [x.grad.float() for x in xs])
    errors = {n: float((a - b).abs().max()) for n, a, b in zip(names, *results, strict=True)}
    row = {"realised_density": realised, "max_abs_error": errors}
    row["ok"] = max(errors.values()) <= TOLERANCE[dtype]
    try:
        backward = device.type == "cuda"
        xs = [t.detach().requires_grad_(backward) for t in (q, k, v)]
        with torch.set_grad_enabled(backward):
            out = flex_attention(*xs, doc_id, table)
        flex = [out.detach().float()]
        if backward:
            out.backward(grad.to(out.dtype))
            flex += [x.grad.float() for x in xs]
        pairs = zip(names[: len(flex)], flex, results[1][: len(flex)], strict=True)
        row["flex_max_abs_error"] = {n: float((a - b).abs().max()) for n, a, b in pairs}
        row["flex_ok"] = max(row["flex_max_abs_error"].values()) <= TOLERANCE[dtype]
    except Exception as e:  # report, do not hide: the Triton check still stands
        row["flex_error"], row["flex_ok"] = f"{type(e).__name__}: {e}"[:300], False
    return row


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


def speed(L: int, heads, block: int, density: float, repeats: int, device) -> dict:
    """(b): Triton forward and forward+backward beside dense SDPA and Flex, same inputs."""
    from sb_titan_kernels import block_sparse_attention_triton

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    (q, k, v), doc_id = _inputs(L, heads, dtype, device)
    table, realised = _table(q.float(), k.float(), doc_id, density, block)
    pairs = int(table.kv_count.sum()) * (heads[0] // heads[1])  # per q head
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fwd():
        with torch.no_grad():
            block_sparse_attention_triton(q, k, v, doc_id, table)

    def fwd_bwd():
        out = block_sparse_attention_triton(qg, kg, vg, doc_id, table)
        out.backward(torch.ones_like(out))

    row = {"realised_density": realised, "block_pairs": pairs}
    row["triton_fwd_ms"] = _median_ms(fwd, repeats, device)
    row["triton_fwd_bwd_ms"] = _median_ms(fwd_bwd, repeats, device)
    d = heads[2]
    if row["triton_fwd_ms"] is not None:
        row["fwd_tflops_per_pair"] = 4 * block * block * d * pairs / row["triton_fwd_ms"] / 1e9
        bwd_ms = row["triton_fwd_bwd_ms"] - row["triton_fwd_ms"]
        row["bwd_tflops_per_pair"] = 10 * block * block * d * pairs / max(bwd_ms, 1e-9) / 1e9
    row.update(_backward_split(q, k, v, doc_id, table, pairs, repeats, device))
    row.update(_peers(q, k, v, doc_id, table, block, repeats, device))
    return row


def _backward_split(q, k, v, doc_id, table, pairs: int, repeats: int, device) -> dict:
    """The backward's three kernels timed one by one: preprocess (memory-bound, GB/s),
    dQ (recomputes S and dP: 6·Bs²·D FLOPs per pair) and dK/dV (recomputes S, dP:
    8·Bs²·D per pair), as TFLOP/s of what each kernel executes."""
    from sb_titan_kernels import block_sparse_attn as kern  # the kernels' own stages

    p = kern._prepare(q, k, v, doc_id, table, None)
    bs = p.block_size
    out, lse = kern._fwd(p)
    do = torch.randn_like(out)
    delta = kern._bwd_preprocess(out, do, bs)
    timed = {
        "preprocess_ms": lambda: kern._bwd_preprocess(out, do, bs),
        "dq_ms": lambda: kern._bwd_dq(p, do, lse, delta),
        "dkdv_ms": lambda: kern._bwd_dkdv(p, do, lse, delta),
    }
    row = {name: _median_ms(fn, repeats, device) for name, fn in timed.items()}
    if row["dq_ms"] is not None:
        d, bytes_moved = q.shape[-1], 2 * out.numel() * out.element_size() + 4 * delta.numel()
        row["preprocess_gb_per_s"] = bytes_moved / row["preprocess_ms"] / 1e6
        row["dq_tflops_per_pair"] = 6 * bs * bs * d * pairs / row["dq_ms"] / 1e9
        row["dkdv_tflops_per_pair"] = 8 * bs * bs * d * pairs / row["dkdv_ms"] / 1e9
    return row


def _peers(q, k, v, doc_id, table, block: int, repeats: int, device) -> dict:
    """Dense document-masked attention (the recipe's dense path: varlen flash where torch
    offers it, no L x L mask) and FlexAttention on the same block table."""
    out: dict = {}
    if device.type != "cuda":
        return {"peers": "timed on CUDA only"}
    from sb_titan.attention.dense import (
        choose_dense_kernel,
        dense_document_attention,
        device_support,
    )

    out["dense_kernel"] = choose_dense_kernel("cuda", q.dtype, q.shape[-1], device_support(device))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def dense_fwd():
        with torch.no_grad():
            dense_document_attention(q, k, v, doc_id)

    def dense_fwd_bwd():
        o = dense_document_attention(qg, kg, vg, doc_id)
        o.backward(torch.ones_like(o))

    out["dense_fwd_ms"] = _median_ms(dense_fwd, repeats, device)
    out["dense_fwd_bwd_ms"] = _median_ms(dense_fwd_bwd, repeats, device)
    try:  # the `flex` backend's pieces: BlockMask from the table, then compiled Flex
        from sb_titan.attention.flex import block_mask, compiled_flex_attention

        flex = compiled_flex_attention()
        mask = block_mask(table, doc_id, q.shape[1])

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
    dtypes = [torch.float32] if dry_run else [torch.float32, torch.bfloat16]
    report: dict = {"device": _device_name(device), "dry_run": dry_run, "env": _env()}
    if "a" in parts:
        report["correctness"] = [
            {"L": L, "heads": h, "block": b, "dtype": str(dt), **check(L, h, b, 0.25, dt, device)}
            for L in grid["lengths"]
            for h in grid["heads"]
            for b in grid["blocks"]
            for dt in dtypes
        ]
    if "b" in parts:
        report["speed"] = [
            {"L": L, "heads": h, "block": b, "density": rho}
            | speed(L, h, b, rho, grid["repeats"], device)
            for L in grid["lengths"]
            for h in grid["heads"]
            for b in grid["blocks"]
            for rho in DENSITIES
        ]
    if "c" in parts:
        report["train_step"] = check_train_variants() if dry_run else train_step(device)
    return report


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)"


def _env() -> dict:
    import triton

    cuda = torch.version.cuda
    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": cuda}


def markdown(report: dict) -> str:
    lines = [f"device: {report['device']}"]
    if "correctness" in report:
        lines += [
            "",
            "| L | heads | block | dtype | density | max abs error (out, dq, dk, dv) | ok | "
            "Flex max abs error | Flex ok |",
        ]
        lines += ["|---|---|---|---|---|---|---|---|---|"]
        for r in report["correctness"]:
            e, f = r["max_abs_error"], r.get("flex_max_abs_error", {})
            err = ", ".join(f"{e[k]:.1e}" for k in ("out", "dq", "dk", "dv"))
            flex = ", ".join(f"{f[k]:.1e}" for k in f) or r.get("flex_error", "-")
            lines.append(
                f"| {r['L']} | {r['heads']} | {r['block']} | {r['dtype']} | "
                f"{r['realised_density']:.3f} | {err} | {r['ok']} | {flex} | {r['flex_ok']} |"
            )
    if "speed" in report:
        lines += ["", "| L | heads | block | density | fwd ms | fwd+bwd ms | fwd TFLOP/s | "]
        lines[-1] += "bwd TFLOP/s | dQ TFLOP/s | dK/dV TFLOP/s | preprocess GB/s | "
        lines[-1] += "dense doc fwd ms | dense doc fwd+bwd ms | Flex mask ms | Flex fwd ms | "
        lines[-1] += "Flex fwd+bwd ms |"
        lines += ["|---" * 16 + "|"]
        fmt = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
        for r in report["speed"]:
            lines.append(
                f"| {r['L']} | {r['heads']} | {r['block']} | {r['realised_density']:.3f} | "
                + " | ".join(
                    fmt(r.get(k))
                    for k in (
                        "triton_fwd_ms",
                        "triton_fwd_bwd_ms",
                        "fwd_tflops_per_pair",
                        "bwd_tflops_per_pair",
                        "dq_tflops_per_pair",
                        "dkdv_tflops_per_pair",
                        "preprocess_gb_per_s",
                        "dense_fwd_ms",
                        "dense_fwd_bwd_ms",
                        "flex_mask_ms",
                        "flex_fwd_ms",
                        "flex_fwd_bwd_ms",
                    )
                )
                + " |"
            )
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
    failed = [r for r in report.get("correctness", []) if not (r["ok"] and r["flex_ok"])]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
