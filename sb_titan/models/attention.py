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

from sb_titan.attention.backends import BACKENDS, Backend, estimator_for, resolve_backend
from sb_titan.attention.block_scores import ORACLES, SCORERS, Scorer
from sb_titan.attention.dense import dense_document_attention
from sb_titan.attention.layout import AttnMeta
from sb_titan.attention.selection import POLICIES, AttnStats, Policy, cp_share
from sb_titan.attention.sparse import sparse_attention
from sb_titan.compat.autograd import in_backward_recompute
from sb_titan.context_parallel.attention import cp_attention
from sb_titan.context_parallel.split import CPSplit


@dataclass(kw_only=True, slots=True)
class SparseAttentionConfig:
    """The `[sparse_attention]` section."""

    enabled: bool = True
    """False: every layer dense (the exact baseline)."""
    policy: Policy = "topk"
    """Budget semantics: `topk` (keep ceil(beta * n) of a query block's n allowed blocks)
    or `mass` (keep blocks until beta of the estimated mass). `topk` is the default by
    measurement: with the max scorers, `mass` accumulates a softmax of block maxima,
    which is peakier than attention mass (bench/selection.py: int4_max 51.6% exact
    match at 0.46 density under `mass`, 63.3% at 0.51 under `topk`)."""
    block_size: int = 64
    backend: Backend = "auto"
    """`auto`: Triton on CUDA tensors, PyTorch on CPU; `torch` / `triton` force one;
    `flex`: compiled FlexAttention on the same table (trains on CUDA only)."""
    scorer: Scorer = "int4_max"
    """What ranks a block pair (attention/block_scores.py). The default by measurement
    (docs/attention.md, "Which blocks to keep"): at half the blocks on the accuracy base
    `int4_max` kept both oracles' 63.3% held-out exact match, `mean` 26.6%.
    `mean` (block-mean q . k),
    `int4_max` (per-token int4 q . k, max per block, like SALE), `kmax` (block-mean q .
    per-token k, max per key block), `pool8_max` (8-token sub-block means, max);
    `exact` / `exact_max` are O(L^2) oracles for benches and eval, refused here."""
    true_recall_rate: float = 1.0
    """Share of query blocks whose hashed query measures true recall and the top-key hit
    (exact, against a full pass over its keys); 0 turns the measurement off."""
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
        if self.scorer not in SCORERS or self.scorer in ORACLES:
            trainable = tuple(s for s in SCORERS if s not in ORACLES)
            raise ValueError(
                f"sparse_attention.scorer: {self.scorer!r} is not one of {trainable} "
                f"({', '.join(ORACLES)} are O(L^2) oracles for benches and eval only)"
            )
        if not 0.0 <= self.true_recall_rate <= 1.0:
            raise ValueError(
                f"sparse_attention.true_recall_rate: {self.true_recall_rate} (expected 0..1)"
            )


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
        scorer: str = "mean"
        true_recall_rate: float = 0.0

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
                scorer=self.config.scorer,
                true_recall_rate=self._true_recall_rate(),
                per_block=meta.block_stats is not None,
            )
            _add_stats(meta, stats)
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
            estimator=estimator_for(backend, q.device.type), scorer=self.config.scorer,
            true_recall_rate=self._true_recall_rate(),
            per_block=meta.block_stats is not None,
        )  # fmt: skip
        if stats is not None:  # a shard's density and recall sums; its share of the rows
            _add_stats(meta, stats, split.degree)
        return out

    def _true_recall_rate(self) -> float:
        """The configured rate in forwards that count as training compute; 0 in an eager
        activation-recompute forward (compiled, the recompute graph drops the op: its
        outputs feed only the statistics)."""
        return self.config.true_recall_rate if _counts_as_training() else 0.0


class CPGroup(NamedTuple):
    rank: int
    group_name: str


def _counts_as_training() -> bool:
    """Activation recomputation repeats the forward inside backward: count it once.
    Compiled, the recompute lives in the backward graph, which never replays the
    forward's input mutations (nor ops whose outputs only feed them)."""
    return torch.compiler.is_compiling() or not in_backward_recompute()


def _add_stats(meta: AttnMeta, stats: AttnStats, cp_degree: int = 1) -> None:
    """Add a layer's statistics into the micro-batch's tensors (a CP shard counts
    1 / cp_degree of each row); per query block only where sampled ones were measured."""
    if not _counts_as_training():
        return
    if meta.stats is not None:
        totals = stats.totals()
        meta.stats.add_(totals if cp_degree == 1 else cp_share(totals, cp_degree))
    if meta.block_stats is not None and stats.blocks.dim() == 3:  # measured per block
        meta.block_stats.add_(stats.block_sums())
