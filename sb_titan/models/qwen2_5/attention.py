"""The recipe's inner attention: dense or dynamic block-sparse, per layer.

TorchTitan's GQAttention calls `inner_attention(q, k, v, attention_masks=, scale=,
enable_gqa=)`; the recipe's per-micro-batch metadata (document layout, budget)
arrives as `attention_masks`, an AttnMeta, so every pipeline stage receives exactly
the metadata of the micro-batch it is running.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torchtitan.protocols.module import Module

from sb_titan.attention.dense import dense_document_attention
from sb_titan.attention.layout import AttnMeta
from sb_titan.attention.selection import POLICIES, Policy
from sb_titan.attention.sparse import (
    BACKENDS,
    Backend,
    estimator_for,
    resolve_backend,
    sparse_attention,
)
from sb_titan.compat.autograd import in_backward_recompute
from sb_titan.context_parallel.attention import cp_attention
from sb_titan.context_parallel.split import CPSplit


@dataclass(kw_only=True, slots=True)
class SparseAttentionConfig:
    """The `[sparse_attention]` section."""

    enabled: bool = True
    """False: every layer dense (the exact baseline)."""
    policy: Policy = "mass"
    """Budget semantics: `mass` (keep blocks until beta of estimated mass) or `topk`."""
    block_size: int = 64
    backend: Backend = "auto"
    """`auto`: Triton on CUDA tensors, PyTorch on CPU; `torch` / `triton` force one;
    `flex`: compiled FlexAttention on the same table (trains on CUDA only)."""
    dense_layers: list[int] = field(default_factory=lambda: [0])
    """Layer indices that stay dense (negative indices count from the end)."""
    record: bool = False
    """Debug: log every attention call's stage, micro-batch, phase, budget and document
    layout to dump_folder/attention_rank<r>.jsonl (what the schedule tests check)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"sparse_attention.policy: {self.policy!r} is not one of {POLICIES}")
        if self.backend not in BACKENDS:
            raise ValueError(f"sparse_attention.backend: {self.backend!r} is not one of {BACKENDS}")
        if self.block_size not in (64, 128):
            raise ValueError(f"sparse_attention.block_size: {self.block_size} (expected 64 or 128)")


class SBAttention(Module):
    """Document-masked causal attention; sparse under the micro-batch's budget.

    Statistics (density, recall) go into the micro-batch's `AttnMeta.stats` tensor.
    `recorder`, when a trainer sets one (debug: `[sparse_attention] record`), is called
    with (module, meta, phase) at every forward and when backward reaches the output."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        sparse: bool = True
        policy: str = "mass"
        block_size: int = 64
        backend: str = "auto"

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.recorder: Callable[[SBAttention, AttnMeta, str], None] | None = None
        self.cp: CPGroup | None = None
        """This rank's CP group, set by parallelization when context parallelism is on."""

    def forward(
        self,
        q_BLNH: torch.Tensor,
        k_BLNH: torch.Tensor,
        v_BLNH: torch.Tensor,
        *,
        attention_masks: AttnMeta | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if not isinstance(attention_masks, AttnMeta):
            raise TypeError(
                "SBAttention needs the micro-batch's AttnMeta (document layout and "
                f"budget) as attention_masks, got {type(attention_masks).__name__}"
            )
        meta = attention_masks
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        if self.recorder is not None:
            self.recorder(self, meta, "forward")
        if meta.cp_blocks is not None:
            out = self._context_parallel(q, k, v, meta, scale)
        elif self.config.sparse:
            out, stats = sparse_attention(
                q,
                k,
                v,
                meta.doc_id,
                meta.budget,
                policy=self.config.policy,
                block_size=self.config.block_size,
                scale=scale,
                backend=self.config.backend,
            )
            _add_stats(meta, stats.totals())
        else:
            out = dense_document_attention(q, k, v, meta.doc_id, scale)
        if self.recorder is not None and out.requires_grad:
            recorder = self.recorder
            out.register_hook(lambda grad: recorder(self, meta, "backward"))
        return out.transpose(1, 2)

    def _context_parallel(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttnMeta, scale
    ) -> torch.Tensor:
        """This CP rank's query blocks against the row's keys (context_parallel/)."""
        if self.cp is None:
            raise RuntimeError("AttnMeta carries a CP split but this model has no CP group")
        backend = resolve_backend(self.config.backend, q.device.type)
        if backend == "flex":
            raise ValueError("sparse_attention.backend = 'flex' does not run under CP")
        split = CPSplit(meta.cp_blocks, self.config.block_size)
        out, stats = cp_attention(
            q, k, v, meta.doc_id, split, self.cp.rank, self.cp.group_name,
            budget=meta.budget if self.config.sparse else None,
            policy=self.config.policy, scale=scale, backend=backend,
            estimator=estimator_for(backend, q.device.type),
        )  # fmt: skip
        if stats is not None:  # a shard's density and recall sums; its share of the rows
            totals = stats.totals()
            _add_stats(meta, torch.cat([totals[:1], totals[1:2] / split.degree, totals[2:]]))
        return out


class CPGroup(NamedTuple):
    rank: int
    group_name: str


def _add_stats(meta: AttnMeta, totals: torch.Tensor) -> None:
    # Activation recomputation repeats the forward inside backward: count once.
    # Compiled, the recompute lives in the backward graph, which never replays
    # the forward's input mutations.
    if meta.stats is not None and (torch.compiler.is_compiling() or not in_backward_recompute()):
        meta.stats.add_(totals)
