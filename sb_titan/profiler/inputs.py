"""Packed rows and attention metadata the profiler times the stage on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.config import TrainingConfig

from sb_titan.attention.layout import AttnMeta
from sb_titan.attention.selection import select_blocks
from sb_titan.models.attention import SBAttention
from sb_titan.profiler.stage import PROFILE_POLICY, ProfilerError, profile_dtype


def doc_ids(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """[B, R] int32 document index per token from each row's document lengths."""
    out = [np.repeat(np.arange(len(r), dtype=np.int32), r) for r in rows]
    return torch.from_numpy(np.stack(out)).to(device)


def positions_of(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """[B, R] position within the document (what the loader emits)."""
    out = [np.concatenate([np.arange(n) for n in r]) for r in rows]
    return torch.from_numpy(np.stack(out)).to(device)


def packed_rows(doc_len: int, rows: int, row_len: int, shift: int = 0) -> list[list[int]]:
    """`rows` rows of row_len // doc_len copies of a doc_len-token document.

    shift > 0 starts the copies `shift` tokens into the row (a `shift`-token document
    first, the last copy cut short), so they straddle block boundaries as packed
    documents almost always do: a 64n-token document then spans n + 1 blocks, not n.
    """
    if row_len % doc_len:
        raise ProfilerError(f"document length {doc_len} must divide the row length {row_len}")
    k = row_len // doc_len
    if shift <= 0 or doc_len <= shift:
        return [[doc_len] * k] * rows
    return [[shift, *[doc_len] * (k - 1), doc_len - shift]] * rows


def _meta(rows: Sequence[Sequence[int]], budget: float, device: torch.device) -> AttnMeta:
    return AttnMeta(doc_ids(rows, device), torch.full((len(rows),), float(budget), device=device))


def make_stage_step(
    model: nn.Module,
    training: TrainingConfig,
    rows: Sequence[Sequence[int]],
    budget: float,
    device: torch.device,
    seed: int = 0,
) -> Callable[[], None]:
    """A closure running the model's fwd+bwd on one micro-batch, as training does: from
    tokens where it holds the embedding, else from hidden states; cross-entropy where it
    holds the head, else backward of a random output gradient."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, R = len(rows), sum(rows[0])
    dtype = profile_dtype(training, device)
    dim, vocab = model.config.dim, model.config.vocab_size  # the stage's model, whole
    meta = _meta(rows, budget, device)
    positions = positions_of(rows, device)
    if model.tok_embeddings is not None:
        x = torch.randint(0, vocab, (B, R), generator=g).to(device)
    else:
        x = torch.randn(B, R, dim, generator=g).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (B, R), generator=g).to(device)
    grad = torch.randn(B, R, dim, generator=g).to(device, dtype)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if x.requires_grad:
            x.grad = None
        out = model(x, positions=positions, attention_masks=meta)
        if model.lm_head is not None:
            F.cross_entropy(out.flatten(0, 1).float(), labels.flatten()).backward()
        else:
            out.backward(grad)

    return step


@dataclass(frozen=True)
class AttentionInputs:
    """q, k, v ([B, R, heads, head_dim], as GQAttention hands them over) and an output
    gradient; shared by every grid point, which differ only in layout and budget."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad: torch.Tensor

    @classmethod
    def random(
        cls,
        training: TrainingConfig,
        model: nn.Module,
        rows: int,
        row_len: int,
        device: torch.device,
        seed: int = 0,
    ) -> AttentionInputs:
        """For the attention of `model` (a stage from build_stage)."""
        g = torch.Generator(device="cpu").manual_seed(seed)
        attn = model.config.layers[0].attention
        dtype = profile_dtype(training, device)
        shapes = [(rows, row_len, h, attn.head_dim) for h in (attn.n_heads, attn.n_kv_heads)]
        q, k, v = (
            torch.randn(shapes[i], generator=g).to(device, dtype).requires_grad_()
            for i in (0, 1, 1)
        )
        return cls(q, k, v, torch.randn(shapes[0], generator=g).to(device, dtype))


def make_attention_step(
    module: SBAttention,
    inputs: AttentionInputs,
    rows: Sequence[Sequence[int]],
    budget: float,
) -> tuple[Callable[[], None], float]:
    """(fwd+bwd closure of one inner attention for this layout and budget, realised
    density of the point: 1.0 for a dense layer)."""
    q, k, v, grad = inputs.q, inputs.k, inputs.v, inputs.grad
    meta = _meta(rows, budget, q.device)
    scale, gqa = q.shape[-1] ** -0.5, q.shape[2] != k.shape[2]

    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        module(q, k, v, attention_masks=meta, scale=scale, enable_gqa=gqa).backward(grad)

    density = 1.0
    if module.config.sparse:
        _, stats = select_blocks(
            q.detach().transpose(1, 2),
            k.detach().transpose(1, 2),
            meta.doc_id,
            meta.budget,
            policy=PROFILE_POLICY,
            block_size=module.config.block_size,
        )
        density = float(stats.density.mean())
    return step, density
