"""The recipe's inner attention: dense or dynamic block-sparse, per layer.

TorchTitan's GQAttention calls `inner_attention(q, k, v, attention_masks=, scale=,
enable_gqa=)`; the recipe's per-micro-batch metadata (document layout, budget)
arrives as `attention_masks`, an AttnMeta, so every pipeline stage receives exactly
the metadata of the micro-batch it is running.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torchtitan.protocols.module import Module

from sb_titan.attention.dense import dense_document_attention
from sb_titan.attention.layout import AttnMeta
from sb_titan.attention.selection import POLICIES, AttnStats
from sb_titan.attention.sparse import BACKENDS


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
        """Per-micro-batch sums of realised density over rows and of recall over
        attending tokens (kept on device, read once per step, so measuring adds no
        per-layer host sync)."""
        self.stats: dict[int, list[torch.Tensor]] = {}

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
        measuring = not _paused
        for observer in ATTENTION_OBSERVERS if measuring else ():
            observer(self, attention_masks, "forward")
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
            if measuring:
                self._record(attention_masks, stats)
        else:
            out = dense_document_attention(q, k, v, doc_id, scale)
        if measuring and ATTENTION_OBSERVERS and out.requires_grad:
            out.register_hook(lambda grad: _notify_backward(self, attention_masks))
        return out.transpose(1, 2)

    @torch.no_grad()
    def _record(self, meta: AttnMeta, stats: AttnStats) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # activation-checkpoint recompute inside backward: already counted
        mb = 0 if meta.microbatch is None else int(meta.microbatch)
        rows = stats.density.new_tensor(stats.density.numel())
        sums = [stats.density.sum(), rows, (stats.recall * stats.tokens).sum(), stats.tokens.sum()]
        self.stats.setdefault(mb, []).append(torch.stack(sums))

    def pop_stats(self) -> dict[int, torch.Tensor]:
        """micro-batch -> [density_sum, rows, recall_sum, attending_tokens] of the sparse
        layers since the last call (recall_sum is token-weighted; dense layers are not
        counted: density and recall refer to sparse layers)."""
        out = {mb: torch.stack(v).sum(0) for mb, v in self.stats.items()}
        self.stats = {}
        return out


_paused: list[bool] = []


@contextlib.contextmanager
def measurement_paused() -> Iterator[None]:
    """Forwards that are not training compute (the pipeline's shape/metadata
    inference) must not count in the statistics or reach the observers."""
    _paused.append(True)
    try:
        yield
    finally:
        _paused.pop()


def is_measuring() -> bool:
    return not _paused


def _notify_backward(module: SBAttention, meta: AttnMeta) -> None:
    for observer in ATTENTION_OBSERVERS:
        observer(module, meta, "backward")


ATTENTION_OBSERVERS: list = []
"""Callables `(module, attn_meta, phase)` run at every attention forward (and
recompute) and when its backward reaches the attention output; the trainer's
attention recorder uses them to show which budget and layout each stage computed with."""
