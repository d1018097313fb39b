"""The `flex` backend: compiled FlexAttention over sb_titan's block table.

Forward only: FlexAttention has no CPU backward (CUDA checks: bench/gpu.py (a)). Each
output is compared with the kernels' fp64 reference on the same table
(`block_sparse_attention_ref`: an explicit masked softmax built from kv_ptr/kv_index
and doc_id, no Flex involved), over real `select_blocks` tables at two budgets and both
policies, documents shorter than a block, tiny documents and padding, a last block that
is only partly filled, and GQA 4:2 (mask repeated over q heads) and 7:1 (one mask head).
"""

from __future__ import annotations

import pytest
import torch
from sb_titan_kernels.attn_fwd_naive import block_sparse_attention_ref
from test_sparse_attention import make_doc_id

from sb_titan.attention.backends import resolve_backend
from sb_titan.attention.flex import (
    _INDEX_ATTRS,
    block_mask,
    block_mask_bytes,
    compiled_flex_attention,
    flex_attention,
    flex_kernel_options,
)
from sb_titan.attention.layout import AttnMeta
from sb_titan.attention.selection import STATS_SIZE, select_blocks
from sb_titan.attention.sparse import sparse_attention
from sb_titan.models.attention import SBAttention

torch.set_num_threads(1)
L = 650  # NB = 11 at block 64, the last block 10 tokens long
# a doc shorter than a block (40) then a long one; docs starting mid-block; tiny docs,
# a 1-token doc and padding (every pad token its own document, as the loader writes it)
ROWS = [[40, 610], [100, 300, 250], [5, 1, 1, 1, 400, 200] + [1] * 42]
SCALE = 0.2


def _qkv(hq: int, hkv: int, seed: int = 0):
    """Uneven attention: every query leans to a few "hot" keys, so the budgets and the
    two policies keep different blocks."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, hq, L, 32, generator=g)
    k, v = (torch.randn(3, hkv, L, 32, generator=g) for _ in range(2))
    u = torch.randn(32, generator=g)
    hot = torch.rand(3, hkv, L, 1, generator=g) < 0.1
    return q + u, k + 2 * hot * u, v


def _kept(table) -> set[tuple[int, ...]]:
    """The table's kept (b, h, i, j) block pairs."""
    B, H, nb = table.kv_count.shape
    return {
        (b, h, i, j)
        for b in range(B)
        for h in range(H)
        for i in range(nb)
        for j in table.kv_index[slice(*table.kv_ptr[b, h, i : i + 2].tolist())].tolist()
    }


def _pairs_inside_one_document(table, doc_id: torch.Tensor) -> torch.Tensor:
    """[B, H, NB] int32: kept pairs (i, j < i) whose tokens all lie in one document,
    counted by loops straight from the definition."""
    B, H, nb = table.kv_count.shape
    bs = table.block_size
    out = torch.zeros(B, H, nb, dtype=torch.int32)
    for b in range(B):
        docs = doc_id[b].tolist()
        for h in range(H):
            for i in range(nb):
                for j in table.kv_index[slice(*table.kv_ptr[b, h, i : i + 2].tolist())].tolist():
                    out[b, h, i] += j < i and len(set(docs[j * bs : (i + 1) * bs])) == 1
    return out


@pytest.mark.parametrize("hq,hkv,block", [(4, 2, 64), (7, 1, 128)])
def test_flex_forward_matches_fp64_reference_on_real_tables(hq, hkv, block):
    """Block 64 (0.5B config) with the mask repeated over q heads; block 128 (3B
    config) with one mask head for all seven q heads."""
    doc_id = make_doc_id(ROWS)
    q, k, v = _qkv(hq, hkv)
    nb = -(-L // block)
    tables = {}
    for policy in ("mass", "topk"):
        for budget in (0.3, 0.6):
            table, stats = select_blocks(q, k, doc_id, budget, policy=policy, block_size=block)
            assert float(stats.density.max()) < 1  # really sparse
            tables[policy, budget] = table
    # the budgets and policies give four different tables (else the grid tests less)
    assert len({frozenset(_kept(t)) for t in tables.values()}) == 4
    g = hq // hkv if hkv > 1 else 1  # Flex's GPU kernel reads mask head h % H_mask
    full_blocks = 0
    for key, table in tables.items():
        mask = block_mask(table, doc_id, hq)
        assert mask.kv_num_blocks.shape == (3, hkv * g, nb) and mask.kv_indices.shape[-1] == nb
        full = _pairs_inside_one_document(table, doc_id)
        full_blocks += int(full.sum())
        assert torch.equal(mask.full_kv_num_blocks, full.repeat_interleave(g, 1)), key
        total = mask.kv_num_blocks + mask.full_kv_num_blocks
        assert torch.equal(total, table.kv_count.repeat_interleave(g, 1)), key
        q_total = mask.q_num_blocks + mask.full_q_num_blocks  # Flex's own transpose
        assert torch.equal(q_total, table.q_count.repeat_interleave(g, 1)), key
        index = [getattr(mask, n) for n in _INDEX_ATTRS]
        assert sum(t.nbytes for t in index) == block_mask_bytes(3, hq, hkv, L, block)
        with torch.no_grad():
            got = flex_attention(q, k, v, doc_id, table, SCALE)
        want = block_sparse_attention_ref(q, k, v, doc_id, table, SCALE)  # fp64 inside
        err = float((got.double() - want.double()).abs().max())
        assert err < 1e-5, f"{key}: max abs error {err:.3g}"


def test_sparse_attention_backend_flex_equals_torch_backend():
    """`backend="flex"` selects the same table as `torch` on CPU and attends over it."""
    assert resolve_backend("flex", "cpu") == "flex"
    assert resolve_backend("auto", "cuda") == "triton"  # until a GPU measurement says so
    doc_id = make_doc_id(ROWS)
    q, k, v = _qkv(4, 2, seed=2)
    budget = torch.tensor([0.3, 0.5, 0.8])
    with torch.no_grad():
        got, got_stats = sparse_attention(q, k, v, doc_id, budget, scale=SCALE, backend="flex")
        want, want_stats = sparse_attention(q, k, v, doc_id, budget, scale=SCALE, backend="torch")
    assert torch.equal(got_stats.totals(), want_stats.totals())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_flex_refuses_cpu_backward_with_a_clear_error():
    doc_id = make_doc_id(ROWS)
    q, k, v = (t.requires_grad_() for t in _qkv(4, 2))
    with pytest.raises(ValueError, match="backend='flex' on cpu runs forward only"):
        sparse_attention(q, k, v, doc_id, 0.5, backend="flex")


def test_flex_inside_a_compiled_block_matches_eager():
    """TorchTitan compiles each block with fullgraph=True: selection (a custom op with
    unbacked table widths), the BlockMask build and Flex trace into one graph."""
    doc_id = make_doc_id(ROWS)
    q, k, v = (t.transpose(1, 2) for t in _qkv(4, 2, seed=3))  # [B, L, H, D], as the model
    outs = []
    for compiled in (False, True):  # eager: the Flex compiled above for these shapes
        module = SBAttention(SBAttention.Config(policy="mass", block_size=64, backend="flex"))
        if compiled:
            # static shapes, as in training: earlier tests' other lengths would make dynamo
            # compile this dynamic, and inductor's CPU Flex template fails to build dynamic C++
            torch.compiler.reset()
            module = torch.compile(module, fullgraph=True)  # a graph break is an error
        stats = torch.zeros(STATS_SIZE)
        meta = AttnMeta(doc_id, torch.tensor([0.3, 0.5, 0.8]), torch.tensor(0), stats)
        with torch.no_grad():
            outs.append((module(q, k, v, attention_masks=meta, scale=SCALE), stats))
    (eager, eager_stats), (comp, comp_stats) = outs
    torch.testing.assert_close(comp, eager, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(comp_stats, eager_stats)


def test_flex_tiles_fit_small_blocks_on_cuda():
    """Flex's default CUDA forward tile (128 rows on H100) does not divide a block of 64:
    the backend passes a forward tile that does, and compiles small-block Flex with
    max_autotune (its backward drops configs whose tiles do not fit). CPU and blocks of
    128 keep Flex's defaults."""
    assert flex_kernel_options(64, "cuda") == {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64}
    assert flex_kernel_options(128, "cuda") is None and flex_kernel_options(64, "cpu") is None
    for block in (16, 32, 48, 64, 96):
        tiles = flex_kernel_options(block, "cuda").values()
        assert all(block % t == 0 and t <= 64 for t in tiles), block
    assert compiled_flex_attention(64, "cuda") is not compiled_flex_attention(128, "cuda")
    assert compiled_flex_attention(128, "cuda") is compiled_flex_attention(64, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: Flex's backward")
@pytest.mark.parametrize("hq,hkv,block", [(4, 2, 64), (7, 1, 128)])
def test_flex_forward_and_backward_on_cuda_match_fp64_reference(hq, hkv, block):
    doc_id = make_doc_id(ROWS).cuda()
    q, k, v = (t.cuda() for t in _qkv(hq, hkv))
    table, _ = select_blocks(q, k, doc_id, 0.5, policy="mass", block_size=block)
    grad = torch.randn_like(q)
    results = []
    for fn, dtype in ((flex_attention, torch.float32), (block_sparse_attention_ref, None)):
        xs = [t.detach().to(dtype or torch.float64).requires_grad_() for t in (q, k, v)]
        out = fn(*xs, doc_id, table, SCALE)
        out.backward(grad.to(out.dtype))
        results.append([out.detach().double()] + [x.grad.double() for x in xs])
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        err = float((got - want).abs().max())
        assert err < 2e-3, f"{name}: max abs error {err:.3g}"  # fp32 (TF32 allowed)
