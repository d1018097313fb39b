"""Held-out recall of the synthetic corpus: exact match of every recalled value, by distance.

Documents come from the corpus's own generator under a seed training never reads, at
chosen lengths, so the recall tasks (" recall key K : V .", with the fact " key K maps
to V ." somewhere before) are exactly the training distribution's. One forward per
document scores all of its recalls: the value is an exact match when the argmax at
every value position is the value's token. Under teacher forcing this equals greedy
decoding of the value (each correct token makes the next context the same as greedy's),
and it costs one forward instead of one per generated token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from sb_titan.data.synthetic import Recall, SyntheticCorpus
from sb_titan.eval.generate import uniform_meta

DISTANCE_BUCKETS = (0, 256, 1024, 2048, 4096)
"""Fact-to-recall distance buckets (tokens): [0, 256), [256, 1024), [1024, 2048), ..."""


@dataclass
class HeldoutItem:
    """One recall task of one held-out document, scored."""

    doc: int
    distance: int
    exact: bool


@dataclass
class HeldoutReport:
    items: list[HeldoutItem]
    loss: float  # token-mean next-token loss over all held-out tokens
    value_loss: float  # token-mean loss on the recalled values only
    tokens: int

    def exact_match(self, lo: int = 0, hi: int | None = None) -> float:
        picked = [
            it.exact for it in self.items if lo <= it.distance and (hi is None or it.distance < hi)
        ]
        return float(np.mean(picked)) if picked else float("nan")


def heldout_documents(
    lengths: list[int], seed: int, **mix: int
) -> list[tuple[np.ndarray, list[Recall]]]:
    """Documents of the given lengths from corpus seed `seed`, with their recall tasks;
    `mix`: the corpus's fact_every / recalls (default: the default mix)."""
    n = len(lengths)
    corpus = SyntheticCorpus(n, max(lengths), seed=seed, lengths=np.array(lengths), **mix)
    return [corpus.annotated(i) for i in range(n)]


def distance_bucket(distance: int, edges: tuple[int, ...] = DISTANCE_BUCKETS) -> str:
    for lo, hi in itertools.pairwise(edges):
        if lo <= distance < hi:
            return f"{lo}-{hi}"
    return f">={edges[-1]}"


@torch.no_grad()
def score_heldout(model, documents, budget: float = 1.0) -> HeldoutReport:
    """Loss and per-recall exact match of `model` on annotated documents (one per row)."""
    device = next(model.parameters()).device
    items: list[HeldoutItem] = []
    total = value_total = 0.0
    count = value_count = 0
    for index, (tokens, recalls) in enumerate(documents):
        ids = torch.as_tensor(tokens, dtype=torch.long, device=device)[None]
        L = ids.shape[1]
        logits = model(
            ids,
            positions=torch.arange(L, device=device)[None],
            attention_masks=uniform_meta(1, L, budget, device),
        )[0].float()
        losses = F.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")
        total += float(losses.sum())
        count += L - 1
        predicted = logits.argmax(-1)
        for r in recalls:
            span = slice(
                r.value_at - 1, r.value_at - 1 + r.value_len
            )  # logits predicting the value
            exact = bool((predicted[span] == ids[0, r.value_at : r.value_at + r.value_len]).all())
            items.append(HeldoutItem(index, r.distance, exact))
            value_total += float(losses[span].sum())
            value_count += r.value_len
    return HeldoutReport(items, total / count, value_total / max(value_count, 1), count)
