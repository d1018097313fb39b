"""The recipe's inner attention: dense or dynamic block-sparse, per layer.

TorchTitan's GQAttention calls `inner_attention(q, k, v, attention_masks=, scale=,
enable_gqa=)`; the recipe's per-micro-batch metadata (document layout, budget)
arrives as `attention_masks`, an AttnMeta, so every pipeline stage receives exactly
the metadata of the micro-batch it is running.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torchtitan.protocols.module import Module

from sb_titan.attention.dense import dense_document_attention
from sb_titan.attention.layout import AttnMeta

POLICIES = ("mass", "topk")
BACKENDS = ("auto", "torch", "triton")


@dataclass(kw_only=True, slots=True)
class SparseAttentionConfig:
    """The `[sparse_attention]` section."""

    enabled: bool = True
    """False: every layer dense (the exact baseline)."""
    policy: str = "mass"
    """Budget semantics: `mass` (keep blocks until beta of estimated mass) or `topk`."""
    block_size: int = 64
    backend: str = "auto"
    """`auto`: Triton on CUDA tensors, PyTorch on CPU; `torch` / `triton` force one."""
    dense_layers: list[int] = field(default_factory=lambda: [0])
    """Layer indices that stay dense (negative indices count from the end)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"sparse_attention.policy: {self.policy!r} is not one of {POLICIES}")
        if self.backend not in BACKENDS:
            raise ValueError(f"sparse_attention.backend: {self.backend!r} is not one of {BACKENDS}")
        if self.block_size not in (64, 128):
            raise ValueError(f"sparse_attention.block_size: {self.block_size} (expected 64 or 128)")


class SBAttention(Module):
    """Document-masked causal attention; sparse under the micro-batch's budget."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        sparse: bool = True
        policy: str = "mass"
        block_size: int = 64
        backend: str = "auto"

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.reset_stats()

    def reset_stats(self) -> None:
        """Per-step sums of realised density and recall over rows (kept on device,
        read once per step, so logging adds no per-layer host sync)."""
        self.stats: list[torch.Tensor] = []

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
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        doc_id, budget = attention_masks.doc_id, attention_masks.budget
        for observer in ATTENTION_OBSERVERS:
            observer(self, attention_masks)
        if self.config.sparse:
            from sb_titan.attention.sparse import sparse_attention

            out, stats = sparse_attention(
                q,
                k,
                v,
                doc_id,
                budget,
                policy=self.config.policy,
                block_size=self.config.block_size,
                scale=scale,
                backend=self.config.backend,
            )
            self._record(stats.density, stats.recall)
        else:
            out = dense_document_attention(q, k, v, doc_id, scale)
            ones = torch.ones(doc_id.shape[0], device=q.device)
            self._record(ones, ones)
        return out.transpose(1, 2)

    @torch.no_grad()
    def _record(self, density: torch.Tensor, recall: torch.Tensor) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # activation-checkpoint recompute inside backward: already counted
        self.stats.append(
            torch.stack([density.sum(), recall.sum(), density.new_tensor(density.numel())])
        )

    def pop_stats(self) -> torch.Tensor:
        """[density_sum, recall_sum, rows] since the last call."""
        total = torch.stack(self.stats).sum(0) if self.stats else torch.zeros(3)
        self.stats = []
        return total


ATTENTION_OBSERVERS: list = []
"""Callables `(module, attn_meta)` run at every attention forward (and recompute);
tests use them to record which budget and document layout each stage saw."""
