"""Dense causal attention with document masking (the exact baseline), linear in L.

Used for `dense_layers`, for `sparse_attention.enabled=false`, for evaluation prefill
and as the dense baseline in benchmarks. Nothing here builds a token x token tensor
(an explicit [L, L] mask is 4 GiB per row at 64K and keeps SDPA off its flash kernel).
One kernel per device, named by `choose_dense_kernel`:

  varlen  CUDA, fp16/bf16, flash available: torch's variable-length flash attention,
          one sequence per document (cu_seqlens from doc_id), causal, native GQA.
  flex    CUDA otherwise (e.g. fp32): compiled FlexAttention on the full block table
          (attention/flex.py: whole-document blocks skip the document-causal mask_mod).
  triton  CUDA without Flex: sb_titan's block-sparse Triton kernels, full table.
  torch   everything else (CPU): the block-sparse PyTorch path with the full table
          (every allowed pair [sink(i), i]), tested equal to masked dense attention.

Inside a compiled block (`--compile.enable`) the dense layers take the last two, which
are custom ops (attention/ops.py): `triton` on CUDA, `torch` elsewhere.

CUDA paths are tested on CPU where possible (choice, varlen arguments, Flex compiled
forward, Triton in the interpreter) but have not been run on a GPU yet.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import NamedTuple

import torch

from sb_titan.attention.backends import resolve_backend
from sb_titan.attention.flex import flex_attention
from sb_titan.attention.ops import block_sparse_attention, full_table
from sb_titan.attention.selection import full_block_table

DENSE_KERNELS = ("varlen", "flex", "triton", "torch")
CPU_BLOCK_SIZE = 64  # PyTorch path; 64 vs 128 within noise (bench/dense_attention.py)
GPU_BLOCK_SIZE = 128  # of the Flex and Triton paths (Flex's native block size)
FLASH_DTYPES = (torch.float16, torch.bfloat16)
TRITON_HEAD_DIMS = (64, 128)  # the Triton kernels' tile table


class DenseSupport(NamedTuple):
    """What the running torch and device offer (probed once per device)."""

    varlen: bool  # torch.nn.attention.varlen.varlen_attn exists
    flash: bool  # the device runs torch's flash attention (CUDA, sm80+, built in)
    flex: bool  # FlexAttention and Triton are importable
    triton: bool  # sb_titan_kernels (Triton) is importable


def choose_dense_kernel(
    device_type: str, dtype: torch.dtype, head_dim: int, support: DenseSupport
) -> str:
    """The kernel `dense_document_attention` uses for these inputs (see module doc)."""
    if device_type != "cuda":
        return "torch"
    flash_shape = head_dim % 8 == 0 and head_dim <= 256
    if support.varlen and support.flash and dtype in FLASH_DTYPES and flash_shape:
        return "varlen"
    if support.flex:
        return "flex"
    if support.triton and head_dim in TRITON_HEAD_DIMS:
        return "triton"
    return "torch"


@functools.cache
def device_support(device: torch.device) -> DenseSupport:
    """Probe torch and `device` for the kernels `choose_dense_kernel` can name."""
    has = importlib.util.find_spec
    triton = has("triton") is not None
    varlen = has("torch.nn.attention.varlen") is not None
    if varlen:
        from torch.nn.attention import varlen as varlen_mod

        varlen = hasattr(varlen_mod, "varlen_attn")
    flash = (
        device.type == "cuda"
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability(device) >= (8, 0)
    )
    flex = triton and has("torch.nn.attention.flex_attention") is not None
    return DenseSupport(varlen, flash, flex, triton and has("sb_titan_kernels") is not None)


def dense_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc_id: torch.Tensor,
    scale: float | None = None,
    *,
    kernel: str = "auto",
) -> torch.Tensor:
    """q: [B, Hq, L, D]; k, v: [B, Hkv, L, D] (Hq a multiple of Hkv); doc_id: [B, L]
    non-decreasing per row -> [B, Hq, L, D]. Query t attends key s iff s <= t and both
    are in the same document. `kernel` forces one of DENSE_KERNELS (tests, benchmarks).
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if kernel == "auto" and torch.compiler.is_compiling():
        # Inside a compiled block: the block-sparse custom ops on the full table (the
        # varlen and Flex paths need host-side lengths and their own compilation).
        kernel = resolve_backend("auto", q.device.type)
    elif kernel == "auto":
        support = device_support(q.device)
        kernel = choose_dense_kernel(q.device.type, q.dtype, q.shape[-1], support)
    if kernel == "varlen":
        return _varlen(q, k, v, doc_id, scale)
    if kernel == "flex":
        return _flex(q, k, v, doc_id, scale)
    if kernel not in ("triton", "torch"):
        raise ValueError(f"unknown dense kernel {kernel!r}; expected 'auto' or {DENSE_KERNELS}")
    block_size = GPU_BLOCK_SIZE if kernel == "triton" else CPU_BLOCK_SIZE
    table = full_table(doc_id, k.shape[1], block_size)
    return block_sparse_attention(q, k, v, doc_id, table, scale, backend=kernel)


# ------------------------------------------------------------------ varlen (CUDA flash)


def cu_seqlens(doc_id: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens [N+1] int32, longest length) of the documents of all rows, flattened
    row-major: a sequence starts at every row start and wherever doc_id changes."""
    B, L = doc_id.shape
    start = torch.ones_like(doc_id, dtype=torch.bool)
    start[:, 1:] = doc_id[:, 1:] != doc_id[:, :-1]
    starts = start.flatten().nonzero().flatten()
    cu = torch.cat([starts, starts.new_full((1,), B * L)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def varlen_kwargs(params, scale: float, head_dim: int, gqa: bool) -> tuple[dict, float]:
    """Keyword arguments for this torch's `varlen_attn` (its signature changed between
    releases: `is_causal=` until ~2.9, `window_size=` after, `enable_gqa=` from ~2.12),
    and the factor q must be multiplied by when it takes no `scale=`."""
    kwargs: dict = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    elif "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        raise RuntimeError("varlen_attn takes neither window_size nor is_causal")
    if gqa and "enable_gqa" in params:
        kwargs["enable_gqa"] = True  # without the flag, flash handles Hkv | Hq natively
    if "scale" in params:
        kwargs["scale"] = scale
        return kwargs, 1.0
    return kwargs, scale * head_dim**0.5


def _varlen(q, k, v, doc_id, scale: float) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    B, Hq, L, D = q.shape
    params = inspect.signature(varlen_attn).parameters
    kwargs, q_factor = varlen_kwargs(params, scale, D, q.shape[1] != k.shape[1])
    cu, longest = cu_seqlens(doc_id)
    # [B, H, L, D] -> packed [B*L, H, D]; a view when the model passes [B, L, H, D].T
    qp, kp, vp = (t.transpose(1, 2).reshape(B * L, t.shape[1], D) for t in (q, k, v))
    if q_factor != 1.0:
        qp = qp * q_factor
    out = varlen_attn(qp, kp, vp, cu, cu, longest, longest, **kwargs)
    return out.view(B, L, Hq, D).transpose(1, 2)


# ------------------------------------------------------------------ FlexAttention


def _flex(q, k, v, doc_id, scale: float) -> torch.Tensor:
    """Compiled FlexAttention on the full table (attention/flex.py: one pattern for all
    heads; blocks inside one document skip the mask). The dense path picks it on CUDA
    only; on CPU, Flex has a forward but no backward."""
    table = full_block_table(doc_id, 1, GPU_BLOCK_SIZE)
    return flex_attention(q, k, v, doc_id, table, scale)
