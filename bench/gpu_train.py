"""(c) of bench/gpu.py: one GPU, a training step at 32K rows, sparse and dense.

    python bench/gpu.py --quick --parts c --budget-s 200 --out DIR

Which of two runs, and every row says which ("ran"):
  * torchtitan and torchdata import on this torch (e.g. carried as wheels): the recipe
    itself, `sb_titan.tools.train` under torchrun, Qwen2.5-0.5B at 32K rows on the
    synthetic corpus, sparse and dense (--quick; also compiled and `flex` otherwise);
    step time and peak memory from its TensorBoard scalars.
  * otherwise: a plain-PyTorch stack of Qwen2.5-0.5B's layers (24 x [RMSNorm, q/k/v
    with bias, RoPE, attention, o, RMSNorm, SwiGLU 896 -> 4864]; no embedding or head,
    no activation checkpointing), forward and backward of one 32K row of two documents,
    bf16. "sparse" calls `sb_titan.attention.sparse.sparse_attention` (the recipe's
    default: `mass` policy, budget 0.9, block 64, layer 0 dense), "dense" the recipe's
    dense path (`dense_document_attention`). No torchtitan module is imported.
The dry run builds the same stack at toy size on the CPU (and, where torchtitan
imports, checks that each variant's overrides pass the launcher's checks).
"""

from __future__ import annotations

import importlib
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_rows import RowLog, guarded, median_ms
from torch import nn

REPO = Path(__file__).resolve().parents[1]
TRAIN_CONFIG = REPO / "train_configs" / "qwen2.5_0.5b_64k.toml"
SEQ_LEN = 32768
# One GPU, 32K rows, the synthetic corpus, no pipeline: the step's attention and memory
# alone (the balance comparison needs >= 2 GPUs: bench/e2e.py).
ONE_GPU = ["--training.seq_len", str(SEQ_LEN), "--training.local_batch_size", "1"]
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
QUICK_VARIANTS = ("sparse", "dense")
# Qwen2.5-0.5B (its config.json) and the recipe's sparse defaults (the shipped config)
QWEN_0_5B = {"dim": 896, "layers": 24, "heads": 14, "kv_heads": 2, "head_dim": 64, "ffn": 4864}
TOY = {"dim": 128, "layers": 2, "heads": 7, "kv_heads": 1, "head_dim": 64, "ffn": 256}
ROPE_THETA = 1e6
SPARSE = {"budget": 0.9, "policy": "mass", "block_size": 64, "dense_layers": (0,)}
TORCHTITAN = "torchtitan (sb_titan.tools.train under torchrun)"
LAYER_STACK = "layer stack (plain PyTorch, Qwen2.5-0.5B shape, sparse_attention)"


class Layer(nn.Module):
    """One Qwen2.5 decoder layer in plain PyTorch; `attend(q, k, v, doc_id)` is the
    attention on [B, H, L, D] tensors."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, ffn: int, **_):
        super().__init__()
        self.shape = (heads, kv_heads, head_dim)
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        self.wq = nn.Linear(dim, heads * head_dim)
        self.wk = nn.Linear(dim, kv_heads * head_dim)
        self.wv = nn.Linear(dim, kv_heads * head_dim)
        self.wo = nn.Linear(heads * head_dim, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x, doc_id, rope, attend):
        B, L, _ = x.shape
        h = self.attn_norm(x)
        split = [(self.wq, self.shape[0]), (self.wk, self.shape[1]), (self.wv, self.shape[1])]
        q, k, v = (w(h).view(B, L, n, -1).transpose(1, 2) for w, n in split)
        q, k = _rope(q, *rope), _rope(k, *rope)
        o = attend(q, k, v, doc_id)
        x = x + self.wo(o.transpose(1, 2).reshape(B, L, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _rope_tables(L: int, head_dim: int, device, dtype):
    inv = ROPE_THETA ** (-torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angle = torch.arange(L, device=device).float()[:, None] * inv[None]
    return angle.cos().to(dtype), angle.sin().to(dtype)


def _rope(x, cos, sin):
    a, b = x.chunk(2, dim=-1)  # the half-split rotation of Qwen2 / Llama
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _attend(variant: str, layer: int):
    from sb_titan.attention.dense import dense_document_attention
    from sb_titan.attention.sparse import sparse_attention

    if variant == "dense" or layer in SPARSE["dense_layers"]:
        return dense_document_attention

    def sparse(q, k, v, doc_id):
        out, _ = sparse_attention(
            q, k, v, doc_id, SPARSE["budget"], policy=SPARSE["policy"],
            block_size=SPARSE["block_size"],
        )  # fmt: skip
        return out

    return sparse


def layer_stack_step(variant: str, dims: dict, L: int, repeats: int, device) -> dict:
    """Forward and backward of the stack on one row of two documents (seeded input and
    dO; parameter gradients cleared between repeats): median step ms, peak memory."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    layers = nn.ModuleList(Layer(**dims) for _ in range(dims["layers"])).to(device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, L, dims["dim"], generator=gen, device=device, dtype=dtype)
    do = torch.randn(x.shape, generator=gen, device=device, dtype=dtype)
    doc_id = (torch.arange(L, device=device) >= L // 2 + 17).to(torch.int32)[None]
    rope = _rope_tables(L, dims["head_dim"], device, dtype)
    attends = [_attend(variant, i) for i in range(dims["layers"])]

    def step():
        h = x
        for layer, attend in zip(layers, attends, strict=True):
            h = layer(h, doc_id, rope, attend)
        h.backward(do)

    def clear():
        layers.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    ms = median_ms(step, repeats, device, reset=clear, warmup=1)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    params = sum(p.numel() for p in layers.parameters())
    return {"ran": LAYER_STACK, "step_ms": ms, "peak_gib": peak, "params": params} | dims


def _torchtitan_missing() -> str | None:
    """None when torchtitan and torchdata import here, else why not."""
    for name in ("torchtitan", "torchdata"):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 -- absent, or built for another torch
            return f"{name}: {type(e).__name__}: {e}"[:200]
    return None


def check_train_variants() -> dict:
    """Dry run of the torchtitan path: every variant's overrides load against the
    shipped config and pass the launcher's checks for one process."""
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


def torchtitan_step(name: str, timeout_s: float) -> dict:
    """One variant of the recipe under torchrun on this GPU, read from TensorBoard."""
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc_per_node=1", "-m", "sb_titan.tools.train", "--config_file"]
        cmd += [str(TRAIN_CONFIG), "--dump_folder", dump, *ONE_GPU, *TRAIN_VARIANTS[name]]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
        )
        if proc.returncode != 0:
            return {"ran": TORCHTITAN, "error": (proc.stdout + proc.stderr)[-1500:]}
        from sb_titan.runtime.tensorboard import read_scalars

        scalars = read_scalars(dump)
        steps = scalars.get("time_metrics/end_to_end(s)", {})
        memory = scalars.get("memory/max_reserved(GiB)", {})
        return {
            "ran": TORCHTITAN,
            "step_ms": 1e3 * statistics.median(v for s, v in steps.items() if s > 2),
            "peak_gib": max(memory.values()) if memory else None,
        }


def part_c(device, dry_run: bool, quick: bool, repeats: int):
    """(c) as a part of bench/gpu.py's run: one row per variant."""

    def run(log: RowLog) -> None:
        missing = _torchtitan_missing()
        if dry_run and missing is None:
            log.measure({"part": "c", "variant": "all", "ran": TORCHTITAN}, check_train_variants)
        if missing is None and not dry_run:
            for name in QUICK_VARIANTS if quick else TRAIN_VARIANTS:
                left = 600.0 if log.budget_s is None else log.budget_s - log.elapsed()
                key = {"part": "c", "variant": name, "L": SEQ_LEN}
                log.measure(key, guarded, torchtitan_step, name, max(left, 1.0))
            return
        dims, L = (TOY, 256) if dry_run else (QWEN_0_5B, SEQ_LEN)
        for variant in ("sparse", "dense"):
            key = {"part": "c", "variant": variant, "L": L, "torchtitan": missing or "imports"}
            log.measure(key, guarded, layer_stack_step, variant, dims, L, repeats, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    return run
