"""bench/attention.py's Flex peer: it runs (--dry-run, tiny shapes; its `main` in this
process) and computes the same attention as sb_titan's block-sparse path on the same
table. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from conftest import REPO
from test_sparse_attention import make_doc_id, make_qkv, random_table, reference_attention

from sb_titan.attention.block_sparse import block_sparse_forward
from sb_titan.attention.flex import block_mask, compiled_flex_attention

if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 6):
    pytest.skip("FlexAttention on CPU needs torch >= 2.6", allow_module_level=True)
pytest.importorskip("torch.nn.attention.flex_attention", reason="torch without FlexAttention")

_spec = importlib.util.spec_from_file_location("attention_bench", REPO / "bench" / "attention.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_dry_run_reports_flex_beside_dense_and_ours(
    tmp_path, monkeypatch, capsys, keep_torch_threads
):
    out = tmp_path / "attention.json"
    args = ["--dry-run", "--threads", "1", "--blocks", "64", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["bench/attention.py", *args])
    bench.main()
    stdout = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    by_impl = {r["impl"]: r for r in rows}
    assert set(by_impl) == {"dense_sdpa", "block_sparse_cpu", "flex_cpu"}
    flex, ours = by_impl["flex_cpu"], by_impl["block_sparse_cpu"]
    assert "error" not in flex, flex.get("error")
    assert flex["max_abs_diff_vs_block_sparse"] < bench.FLEX_TOL
    assert flex["fwd_s"] > 0 and "fwd_bwd_s" not in flex  # Flex has no CPU backward
    assert ours["fwd_s"] > 0 and ours["fwd_bwd_s"] > 0 and ours["fwd_speedup_vs_flex"] > 0
    assert (flex["block"], flex["density"]) == (ours["block"], ours["density"])
    assert "flex_cpu" in stdout and "max|flex-ours|" in stdout


def test_flex_block_mask_is_the_table_with_documents():
    """Several documents starting mid-block and an arbitrary table (pairs before a
    document's start included): Flex on the shared block_mask equals the fp64 reference, and
    exactly the pairs inside one document are full blocks."""
    doc_id = make_doc_id([[40, 100, 116]])
    q, k, v = make_qkv(1, 14, 2, 256, 64)
    table = random_table(1, 2, 4, 0.6, seed=2)
    mask = block_mask(table, doc_id, 14)
    docs = doc_id[0].tolist()
    full = torch.zeros(1, 2, 4, dtype=torch.int32)
    for h in range(2):
        for i in range(4):
            lo, hi = table.kv_ptr[0, h, i : i + 2].tolist()
            for j in table.kv_index[lo:hi].tolist():
                full[0, h, i] += j < i and len(set(docs[j * 64 : (i + 1) * 64])) == 1
    assert torch.equal(mask.full_kv_num_blocks, full.repeat_interleave(7, 1))
    assert torch.equal(
        mask.kv_num_blocks + mask.full_kv_num_blocks, table.kv_count.repeat_interleave(7, 1)
    )
    # the bench's compiled Flex: the dry run above compiled it for these shapes
    got = compiled_flex_attention(64, "cpu")(q, k, v, block_mask=mask, scale=0.125, enable_gqa=True)
    ref = reference_attention(q, k, v, doc_id, table, scale=0.125)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    ours, _ = block_sparse_forward(q, k, v, doc_id, table, 0.125)
    assert float((got - ours).abs().max()) < bench.FLEX_TOL
