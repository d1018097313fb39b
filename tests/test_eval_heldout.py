"""Held-out recall scoring: the corpus's task annotations, and teacher-forced exact match
against greedy decoding (the definition it stands in for), on the base model
that `python bench/accuracy.py pretrain` makes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from sb_titan.data.synthetic import SyntheticCorpus
from sb_titan.eval.checkpoint import load_from_hf
from sb_titan.eval.generate import greedy_generate
from sb_titan.eval.heldout import distance_bucket, heldout_documents, score_heldout

BASE = Path(__file__).resolve().parents[1] / "bench" / "accuracy_base"


@pytest.mark.parametrize("fact_every,recalls", [(256, 2), (64, 16)])
def test_annotations_point_at_the_fact_and_the_recalled_value(fact_every, recalls):
    corpus = SyntheticCorpus(400, 2048, seed=3, fact_every=fact_every, recalls=recalls)
    tok = corpus.tokenizer
    seen = 0
    for i in range(400):
        tokens, tasks = corpus.annotated(i)
        assert np.array_equal(tokens, corpus.document(i))
        n = len(tokens)
        n_facts = max(1, n // fact_every) if n >= 48 else 0
        assert len(tasks) <= min(n_facts, recalls)
        for t in tasks:
            value = tok.decode(tokens[t.value_at : t.value_at + t.value_len].tolist())
            query = tok.decode(tokens[t.value_at - 8 : t.value_at].tolist())
            key = query.split(" recall key ")[-1].split(" :")[0].strip()
            fact = tok.decode(tokens[t.fact_at : t.value_at].tolist())
            assert fact.startswith(f" key {key} : {value.strip()} .")
            assert (
                tokens[t.value_at : t.value_at + t.value_len].tolist()
                == tok.encode(f" {value.strip()}", add_special_tokens=False).ids
            )
            assert 0 < t.distance < n
            seen += 1
    assert seen > 100


def test_recall_dense_mix_asks_more():
    plain = SyntheticCorpus(300, 1024, seed=0)
    dense = SyntheticCorpus(300, 1024, seed=0, fact_every=64, recalls=16)
    count = lambda c: sum(len(c.annotated(i)[1]) for i in range(300))  # noqa: E731
    assert count(dense) > 2 * count(plain)
    with pytest.raises(ValueError, match="fact_every"):
        SyntheticCorpus(10, 1024, fact_every=0)


def test_distance_buckets():
    assert distance_bucket(0) == "0-256" and distance_bucket(255) == "0-256"
    assert distance_bucket(256) == "256-1024" and distance_bucket(4095) == "2048-4096"
    assert distance_bucket(5000) == ">=4096"


@pytest.mark.skipif(
    not (BASE / "model.safetensors").is_file(),
    reason="no base model: python bench/accuracy.py pretrain makes it",
)
def test_teacher_forced_exact_match_equals_greedy_decoding_on_the_base_model():
    torch.manual_seed(0)
    model = load_from_hf(BASE, "dense").model
    docs = heldout_documents([512] * 6 + [1024] * 2, seed=4242)
    report = score_heldout(model, docs)
    assert len(report.items) >= 8
    flat = [(i, r) for i, (_, tasks) in enumerate(docs) for r in tasks]
    for item, (i, r) in zip(report.items, flat, strict=True):
        tokens = torch.as_tensor(docs[i][0][: r.value_at])[None]
        got = greedy_generate(model, tokens, r.value_len).tokens[0]
        truth = docs[i][0][r.value_at : r.value_at + r.value_len].tolist()
        assert item.exact == (got == truth)
    # the base has learned the task within its pretraining context
    assert report.exact_match() >= 0.5
