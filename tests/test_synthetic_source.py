"""The loader's synthetic source: longtail-v1 lengths, or fixed-length documents."""

from __future__ import annotations

import pytest

from sb_titan.data.loader import SBDataLoader, build_source


def test_fixed_length_documents_for_a_curriculum_stage():
    config = SBDataLoader.Config(synthetic_docs=50, synthetic_doc_len=128, synthetic_fact_every=32)
    source = build_source(config, seq_len=256)
    assert source.lengths.tolist() == [128] * 50 and "fixed-128" in source.name
    for i in range(5):
        doc, recalls = source.annotated(i)
        assert len(doc) == 128 and len(recalls) == 2  # 4 facts, the default 2 recalled
    longtail = build_source(SBDataLoader.Config(synthetic_docs=50), seq_len=256)
    assert len(set(longtail.lengths.tolist())) > 10 and "longtail-v1" in longtail.name


def test_document_longer_than_the_row_is_refused():
    config = SBDataLoader.Config(synthetic_docs=10, synthetic_doc_len=512)
    with pytest.raises(ValueError, match=r"synthetic_doc_len: 512 .* <= training.seq_len \(256\)"):
        build_source(config, seq_len=256)
