"""KV-cached greedy decoding against full recomputation on a tiny random model."""

from __future__ import annotations

import torch

from sb_titan.eval.checkpoint import build_model
from sb_titan.eval.generate import forward_last_logits, greedy_generate, kv_cache, uniform_meta
from sb_titan.models.attention import SBAttention, SparseAttentionConfig
from sb_titan.models.dims import ModelDims

DIMS = ModelDims(64, 2, 4, 2, 16, 128, 256, False, 1024)


def _model(sparse: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    attn = SparseAttentionConfig(enabled=sparse, dense_layers=[0])
    model = build_model(DIMS, attn)
    with torch.no_grad():  # larger weights than the init, so greedy paths are not trivial
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model


def _full_logits(model, tokens: torch.Tensor, budget: float = 1.0) -> torch.Tensor:
    B, L = tokens.shape
    with torch.no_grad():
        return model(
            tokens,
            positions=torch.arange(L).expand(B, L),
            attention_masks=uniform_meta(B, L, budget, tokens.device),
        )


def test_cached_steps_match_full_recomputation():
    model = _model()
    tokens = torch.randint(0, 256, (2, 90), generator=torch.Generator().manual_seed(1))
    ref = _full_logits(model, tokens)
    with kv_cache(model):
        got = [forward_last_logits(model, tokens[:, :70], 0, 1.0)]
        for t in range(70, 80):  # one token at a time
            got.append(forward_last_logits(model, tokens[:, t : t + 1], t, 1.0))
        got.append(forward_last_logits(model, tokens[:, 80:90], 80, 1.0))  # a chunk of 10
    want = [ref[:, 69], *[ref[:, t] for t in range(70, 80)], ref[:, 89]]
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() < 1e-4


def test_greedy_tokens_match_recomputation_and_modules_are_restored():
    model = _model()
    keys = set(model.state_dict())
    seq = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    result = greedy_generate(model, seq, 16)
    for _ in range(16):
        seq = torch.cat([seq, _full_logits(model, seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert result.tokens == seq[:, 40:].tolist()
    assert all(
        isinstance(layer.attention.inner_attention, SBAttention) for layer in model.layers.values()
    )
    assert set(model.state_dict()) == keys


def test_sparse_prefill_is_the_model_forward_under_the_budget():
    model = _model(sparse=True)
    tokens = torch.randint(0, 256, (1, 400), generator=torch.Generator().manual_seed(3))
    for budget in (0.3, 1.0):
        result = greedy_generate(model, tokens, 3, budget=budget)
        ref = _full_logits(model, tokens, budget)[:, -1]
        assert (result.prefill_logits - ref).abs().max().item() < 1e-4
        assert len(result.tokens[0]) == 3
    dense_ref = _full_logits(_model(sparse=False), tokens)[:, -1]
    assert (
        greedy_generate(model, tokens, 1, budget=0.3).prefill_logits - dense_ref
    ).abs().max() > 1e-4


def test_stop_tokens_and_min_new_tokens():
    model = _model()
    prompt = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    first = greedy_generate(model, prompt, 4).tokens[0][0]
    assert greedy_generate(model, prompt, 4, stop_ids=[first]).tokens == [[]]
    forced = greedy_generate(model, prompt, 4, stop_ids=[first], min_new_tokens=1).tokens[0]
    assert forced and forced[0] != first
