"""Per-document recall and density for `[dst] doc_history`: a buffer per micro-batch that
the sparse layers add each query block's sums into (`AttnMeta.block_stats`, in
selection.BLOCK_FIELDS order), and, after the step, those sums credited to the documents
of the plan (`layout.document_sums`) for the measurement all-gather."""

from __future__ import annotations

import torch

from sb_titan.attention.layout import document_sums
from sb_titan.attention.selection import BLOCK_FIELDS
from sb_titan.balance.sab import StepPlan


class DocumentCredit:
    """The step's per-query-block buffers, by micro-batch index."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor, list[int]]] = {}

    def buffer(self, mb_index: int, doc_id: torch.Tensor, docs_per_row: list[int]) -> torch.Tensor:
        """A zeroed [len(BLOCK_FIELDS), B, NB] buffer for micro-batch `mb_index` (doc_id
        [B, L]: its full rows, so CP shards add into row coordinates), kept until the step
        is gathered."""
        nb = -(-doc_id.shape[1] // self.block_size)
        sums = doc_id.new_zeros(len(BLOCK_FIELDS), doc_id.shape[0], nb, dtype=torch.float32)
        self._buffers[mb_index] = (sums, doc_id, docs_per_row)
        return sums

    def local(self) -> dict[int, list[list[float]]]:
        """Each micro-batch this rank ran: its documents' sums (measurements' doc_sums),
        from one host copy of all the step's buffers (their shapes are the step's)."""
        if not self._buffers:
            return {}
        mbs = sorted(self._buffers)
        sums, doc_ids = (torch.stack([self._buffers[mb][i] for mb in mbs]).cpu() for i in (0, 1))
        return {
            mb: document_sums(s, d, self._buffers[mb][2], self.block_size).tolist()
            for mb, s, d in zip(mbs, sums, doc_ids, strict=True)
        }

    def reset(self) -> None:
        self._buffers = {}

    @staticmethod
    def counts(plan: StepPlan) -> list[list[int]]:
        """Documents per (DP rank, micro-batch): what the gather makes room for."""
        return [[len(mb.doc_lens) for mb in rank] for rank in plan.microbatches]
