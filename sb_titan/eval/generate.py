"""Greedy decoding with a KV cache, reusing the model's own modules.

Each layer's inner attention (the recipe's SBAttention) is wrapped for the duration of
a generation: the prefill runs the unmodified model forward over the whole prompt —
dense, or sparse under the AttnMeta budget exactly as in training — and stores every
layer's post-RoPE keys and values; each decode step then runs the same forward on the
new token only (embedding, norms, projections, RoPE at its true position, FFN, head)
while the wrapper attends *densely* to the cached keys. So `--attention sparse` means a
sparse prefill; decode steps (at most a few hundred tokens) are always dense.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from sb_titan.attention.layout import AttnMeta
from sb_titan.compat.models import hidden_states_only


class CachedAttention(nn.Module):
    """Inner attention with a KV cache: prefill via the wrapped module, then dense."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "inner", inner)  # not a submodule: the state dict is unchanged
        self.k: torch.Tensor | None = None  # [B, T, Hkv, D]
        self.v: torch.Tensor | None = None

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False):
        if self.k is None:
            self.k, self.v = k, v
            return self.inner(
                q, k, v, attention_masks=attention_masks, scale=scale, enable_gqa=enable_gqa
            )
        offset = self.k.shape[1]
        self.k = torch.cat([self.k, k], dim=1)
        self.v = torch.cat([self.v, v], dim=1)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, self.k, self.v))
        mask = None
        if q.shape[1] > 1:  # several new tokens: causal within them
            i = torch.arange(q.shape[1], device=q.device)[:, None] + offset
            mask = torch.arange(kt.shape[2], device=q.device)[None, :] <= i
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=qt.shape[1] != kt.shape[1]
        )
        return out.transpose(1, 2)


@contextlib.contextmanager
def kv_cache(model: nn.Module) -> Iterator[list[CachedAttention]]:
    """Swap every layer's inner attention for a CachedAttention, restore on exit."""
    swapped = []
    try:
        for layer in model.layers.values():
            inner = layer.attention.inner_attention
            wrapper = CachedAttention(inner)
            layer.attention.inner_attention = wrapper
            swapped.append((layer.attention, inner, wrapper))
        yield [w for _, _, w in swapped]
    finally:
        for attn, inner, _ in swapped:
            attn.inner_attention = inner


def uniform_meta(batch: int, length: int, budget: float, device: torch.device) -> AttnMeta:
    """One document per row covering the whole prompt, at a uniform budget."""
    return AttnMeta(
        doc_id=torch.zeros(batch, length, dtype=torch.int32, device=device),
        budget=torch.full((batch,), float(budget), device=device),
    )


@torch.no_grad()
def forward_last_logits(
    model: nn.Module, tokens: torch.Tensor, start: int, budget: float
) -> torch.Tensor:
    """Logits of the last position of `tokens` ([B, L] at positions start..start+L-1),
    without materialising [B, L, vocab] (the head runs on the last hidden state only)."""
    B, L = tokens.shape
    positions = torch.arange(start, start + L, device=tokens.device).expand(B, L)
    with hidden_states_only(model):
        meta = uniform_meta(B, L, budget, tokens.device)
        h = model(tokens, positions=positions, attention_masks=meta)
    return model.lm_head(h[:, -1]).float()


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per row, stop token excluded
    prefill_logits: torch.Tensor = field(repr=False)  # [B, vocab] at the last prompt position


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    stop_ids: list[int] | tuple[int, ...] = (),
    min_new_tokens: int = 0,
    budget: float = 1.0,
) -> GenerationResult:
    """Greedy continuation of equal-length prompts [B, L]; a row ends at a stop token.

    Stop tokens are suppressed for the first `min_new_tokens` steps (HF min_length).
    """
    B, L = prompt.shape
    max_pos = _max_positions(model)
    if max_pos is not None and L + max_new_tokens > max_pos:
        raise ValueError(
            f"generate: prompt ({L}) + new tokens ({max_new_tokens}) exceed the model's "
            f"{max_pos} RoPE positions; lower --max-length"
        )
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=prompt.device)
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=prompt.device)
    with kv_cache(model):
        logits = forward_last_logits(model, prompt, 0, budget)
        prefill = logits.clone()
        for step in range(max_new_tokens):
            if step < min_new_tokens and stop.numel():
                logits[:, stop] = float("-inf")
            nxt = logits.argmax(-1)
            finished = torch.isin(nxt, stop) if stop.numel() else torch.zeros_like(done)
            for b in range(B):
                if not done[b] and not finished[b]:
                    out[b].append(int(nxt[b]))
            done |= finished
            if bool(done.all()) or step + 1 == max_new_tokens:
                break
            logits = forward_last_logits(model, nxt[:, None], L + step, budget)
    return GenerationResult(out, prefill)


def _max_positions(model: nn.Module) -> int | None:
    rope = getattr(next(iter(model.layers.values())).attention, "rope", None)
    cache = getattr(rope, "cache", None)
    return None if cache is None else int(cache.shape[0])


@dataclass
class Generator:
    """A model, its tokenizer and attention settings: what the evaluations decode with."""

    model: nn.Module
    tokenizer: object  # tokenizers.Tokenizer
    eos_ids: list[int]
    budget: float = 1.0

    def generate(
        self,
        ids: list[int],
        max_new_tokens: int,
        stop_ids: list[int] | None = None,
        min_new_tokens: int = 0,
    ) -> list[int]:
        device = next(self.model.parameters()).device
        prompt = torch.tensor([ids], dtype=torch.long, device=device)
        result = greedy_generate(
            self.model,
            prompt,
            max_new_tokens,
            stop_ids=self.eos_ids if stop_ids is None else stop_ids,
            min_new_tokens=min_new_tokens,
            budget=self.budget,
        )
        return result.tokens[0]
