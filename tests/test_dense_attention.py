"""Dense document-causal attention without a token x token tensor.

Every path is checked against an explicit fp64 softmax(QK^T)V whose mask is written
here from the definition (key s <= query t, same document); the full block table
against `select_blocks` at budget 1 and against the [sink(i), i] contract in loops; and
the CPU path is run at L=4096 under a dispatch mode that records every tensor created,
which must see no token x token shape (and does see one for the old [B,1,L,L] mask).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sb_titan.attention.block_sparse import (
    block_sparse_backward,
    block_sparse_forward,
    check_table,
)
from sb_titan.attention.dense import (
    CPU_BLOCK_SIZE,
    DenseSupport,
    choose_dense_kernel,
    cu_seqlens,
    dense_document_attention,
    device_support,
    varlen_kwargs,
)
from sb_titan.attention.flex import block_mask
from sb_titan.attention.layout import doc_lens_from_doc_id, document_causal_mask
from sb_titan.attention.selection import full_block_table, select_blocks, transpose_table

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
# Row lengths 650 (a multiple of neither block size); the third row ends in padding,
# where every pad token is its own document (as the loader writes it).
ROWS = [[100, 300, 250], [650], [5, 1, 1, 1, 400, 200] + [1] * 42]


def make_doc_id(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]
    ).to(torch.int32)


def reference(q, k, v, doc_id, scale=None) -> torch.Tensor:
    """fp64 softmax(scale * QK^T + mask) V, mask from the definition, GQA by repetition."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    L = q.shape[2]
    pos = torch.arange(L, device=doc_id.device)
    ok = (pos[None, :] <= pos[:, None]) & (doc_id[:, :, None] == doc_id[:, None, :])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~ok[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v


def inputs(B, Hq, Hkv, L, D, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, L, D, generator=g) for h in (Hq, Hkv, Hkv))
    k[:, :, : L // 3] += 0.5 * torch.randn(B, Hkv, 1, D, generator=g)  # uneven attention
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]


def out_and_grads(fn, q, k, v, grad):
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))]


def reference_and_grads(q, k, v, grad, doc_id, scale=None):
    """The fp64 reference's output and gradients, taken in fp64 (not cast back)."""
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    return out_and_grads(lambda *x: reference(*x, doc_id, scale), *x64, grad.double())


# ------------------------------------------------------------------ CPU path, values


@pytest.mark.parametrize(
    "dtype,heads,tol",
    [(torch.float64, (6, 2), 1e-10), (torch.float32, (7, 1), 1e-5), (torch.float32, (4, 4), 1e-5)],
)
def test_cpu_path_matches_fp64_reference(dtype, heads, tol):
    doc_id = make_doc_id(ROWS)
    q, k, v = inputs(3, *heads, 650, 32, dtype)
    grad = torch.randn(3, heads[0], 650, 32, dtype=dtype)
    want = reference_and_grads(q, k, v, grad, doc_id, 0.2)
    got = out_and_grads(lambda *x: dense_document_attention(*x, doc_id, 0.2), q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == dtype
        err = float((a.double() - b).abs().max())
        assert err <= tol * (1 + float(b.abs().max())), f"{name}: max abs error {err:.3g}"


def test_flex_path_matches_reference_forward():
    """The Flex path (compiled: eager Flex ignores the block mask), forward only: CPU
    Flex has no backward. Also checks the block mask is the full table."""
    doc_id = make_doc_id(ROWS)
    q, k, v = (t.detach() for t in inputs(3, 6, 2, 650, 32, torch.float32))
    got = dense_document_attention(q, k, v, doc_id, kernel="flex")
    err = float((got.double() - reference(q, k, v, doc_id)).abs().max())
    assert err < 1e-5, err


def test_flex_block_mask_is_the_table():
    """attention/flex.py's block_mask on a selected table (MAXK < NB, L not a block
    multiple) keeps exactly the table's block pairs (Flex's own transpose included)."""
    doc_id = make_doc_id(ROWS)
    q, k, _ = (t.detach() for t in inputs(3, 4, 2, 650, 32, torch.float32))
    table, _ = select_blocks(q, k, doc_id, 0.3, policy="topk", block_size=64)
    kv_count, kv_index = table.padded_kv()
    assert kv_index.shape[-1] < 11
    mask = block_mask(table, doc_id, num_q_heads=2)
    want = torch.zeros(3, 2, 11, 11, dtype=torch.bool)
    for b, h, i in torch.cartesian_prod(torch.arange(3), torch.arange(2), torch.arange(11)):
        lo, hi = table.kv_ptr[b, h, i : i + 2].tolist()
        want[b, h, i, table.kv_index[lo:hi].long()] = True
    assert torch.equal(mask.to_dense().bool(), want)
    assert mask.seq_lengths == (650, 650)
    assert torch.equal(mask.q_num_blocks + mask.full_q_num_blocks, table.q_count)


def test_triton_path_in_interpreter():
    """The Triton kernels on the full table, fwd + bwd, under TRITON_INTERPRET=1 (a
    child process: the interpreter is chosen when Triton is first imported). L = 200 at
    the Triton path's Bs = 128: a partial last block whose first document starts in
    block 0 (sink 0), GQA 2:1."""
    code = f"""
import importlib.util, json, sys, torch
sys.path[:0] = {[str(REPO), str(REPO / ".shim")]!r}
spec = importlib.util.spec_from_file_location("dense_test", {__file__!r})
t = importlib.util.module_from_spec(spec)
spec.loader.exec_module(t)
doc_id = t.make_doc_id([[100, 70, 30], [200]])
q, k, v = t.inputs(2, 4, 2, 200, 64, torch.float32)
grad = torch.randn(2, 4, 200, 64)
want = t.reference_and_grads(q, k, v, grad, doc_id)
triton = lambda *x: t.dense_document_attention(*x, doc_id, kernel="triton")
got = t.out_and_grads(triton, q, k, v, grad)
print(json.dumps([float((a.double() - b).abs().max()) for a, b in zip(got, want)]))
"""
    env = dict(os.environ, TRITON_INTERPRET="1", SB_TRITON_UPCAST="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert max(errors) < 1e-5, errors


# ------------------------------------------------------------------ the full table


def test_full_table_equals_selection_at_budget_one():
    doc_id = make_doc_id(ROWS)
    q, k, _ = (t.detach() for t in inputs(3, 4, 2, 650, 16, torch.float32))
    for bs in (64, 128):
        full = full_block_table(doc_id, 2, bs)
        sel, stats = select_blocks(q, k, doc_id, 1.0, policy="topk", block_size=bs)
        assert torch.equal(stats.density, torch.ones(3))
        for name, a, b in zip(full._fields[:4], full[:4], sel[:4], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (bs, name)
        assert full.block_size == bs


def test_full_table_is_the_contract():
    """Row i keeps exactly [sink(i), i]; sink(i) = first block of block i's first
    document; the q part is the transpose. Loops over the definition."""
    rows = [[64, 64, 3, 125, 100], [1] * 100 + [256], [356]]
    doc_id = make_doc_id(rows)
    table = full_block_table(doc_id, 3, 64)
    doc = doc_id.tolist()
    nb = 6
    for b in range(3):
        sink = [doc[b].index(doc[b][i * 64]) // 64 for i in range(nb)]
        for h in range(3):
            for i in range(nb):
                lo, hi = table.kv_ptr[b, h, i : i + 2].tolist()
                assert table.kv_index[lo:hi].tolist() == list(range(sink[i], i + 1))
            for j in range(nb):
                lo, hi = table.q_ptr[b, h, j : j + 2].tolist()
                want = [i for i in range(nb) if sink[i] <= j <= i]
                assert table.q_index[lo:hi].tolist() == want
    q_ptr, q_index = transpose_table(table.kv_ptr, table.kv_index)
    assert torch.equal(q_ptr, table.q_ptr) and torch.equal(q_index, table.q_index)


@pytest.mark.parametrize("policy", ["topk", "mass"])
def test_nan_queries_still_give_a_valid_table(policy):
    """torch's pipeline shape inference runs a later stage's forward on uninitialized
    buffers, which may hold NaN: the NaN query blocks still keep their sink and
    diagonal, in order (the kernels' contract), and every other query block keeps
    exactly what it keeps on clean input."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 512, 16, generator=g), torch.randn(1, 2, 512, 16, generator=g)
    doc_id = make_doc_id([[512]])
    clean, _ = select_blocks(q, k, doc_id, 0.3, policy=policy, block_size=64)
    q[0, :, 300:310] = float("nan")  # in query block 4
    table, _ = select_blocks(q, k, doc_id, 0.3, policy=policy, block_size=64)
    check_table(table, 1, 2, 512)
    for h in range(2):
        for i in range(8):
            lo, hi = table.kv_ptr[0, h, i : i + 2].tolist()
            kept = table.kv_index[lo:hi].tolist()
            assert kept[0] == 0 and kept[-1] == i, (h, i, kept)
            if i != 4:
                a, b = clean.kv_ptr[0, h, i : i + 2].tolist()
                assert kept == clean.kv_index[a:b].tolist(), (h, i)


def test_full_table_rejects_bad_input():
    with pytest.raises(ValueError, match="block_size"):
        full_block_table(torch.zeros(1, 10, dtype=torch.int32), 1, 32)
    with pytest.raises(ValueError, match=r"\[B, L\]"):
        full_block_table(torch.zeros(10, dtype=torch.int32), 1, 64)


# ------------------------------------------------------------------ no L x L tensor


class ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor any aten op returns (views included)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out

    def token_by_token(self, L: int) -> list[tuple[str, tuple[int, ...]]]:
        """Tensors with two dims >= L, or L*L elements or more (a flattened L x L)."""
        return [
            (f, s)
            for f, s in self.shapes
            if sum(d >= L for d in s) >= 2 or torch.Size(s).numel() >= L * L
        ]


def test_no_token_by_token_tensor_at_4096():
    L = 4096
    doc_id = make_doc_id([[1000, 3000, 96]])
    q, k, v = inputs(1, 2, 1, L, 64, torch.float32)
    assert q.numel() < L * L  # the criterion leaves room for every legitimate tensor
    grad = torch.randn(1, 2, L, 64)
    with ShapeRecorder() as rec:  # at the boundaries of the custom ops
        out_and_grads(lambda *x: dense_document_attention(*x, doc_id), q, k, v, grad)
    assert any("sb_titan.block_sparse_attention" in f for f, _ in rec.shapes)
    assert rec.token_by_token(L) == []
    q, k, v = (t.detach() for t in (q, k, v))
    with ShapeRecorder() as rec:  # inside them: what the ops run on CPU
        table = full_block_table(doc_id, 1, CPU_BLOCK_SIZE)
        out, lse = block_sparse_forward(q, k, v, doc_id, table, 64**-0.5)
        block_sparse_backward(grad, q, k, v, out, lse, doc_id, table, 64**-0.5)
    assert len(rec.shapes) > 100  # the recorder saw the kernel's ops
    assert rec.token_by_token(L) == []
    with ShapeRecorder() as old:  # the detector fires on the mask approach it replaced
        F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(doc_id))
    assert old.token_by_token(L)


# ------------------------------------------------------------------ CUDA kernel choice

ALL = DenseSupport(varlen=True, flash=True, flex=True, triton=True)


@pytest.mark.parametrize(
    "device,dtype,head_dim,support,want",
    [
        ("cpu", torch.bfloat16, 64, ALL, "torch"),
        ("cpu", torch.float32, 128, ALL, "torch"),
        ("cuda", torch.bfloat16, 128, ALL, "varlen"),
        ("cuda", torch.float16, 64, ALL, "varlen"),
        ("cuda", torch.float32, 64, ALL, "flex"),  # flash has no fp32
        ("cuda", torch.bfloat16, 512, ALL, "flex"),  # flash stops at head_dim 256
        ("cuda", torch.bfloat16, 64, ALL._replace(flash=False), "flex"),  # pre-sm80
        ("cuda", torch.bfloat16, 64, ALL._replace(varlen=False), "flex"),  # older torch
        ("cuda", torch.bfloat16, 64, DenseSupport(False, True, False, True), "triton"),
        ("cuda", torch.bfloat16, 96, DenseSupport(False, True, False, True), "torch"),
        ("cuda", torch.float32, 64, DenseSupport(True, True, False, False), "torch"),
    ],
)
def test_kernel_choice(device, dtype, head_dim, support, want):
    assert choose_dense_kernel(device, dtype, head_dim, support) == want


def test_cpu_support_has_no_flash():
    support = device_support(torch.device("cpu"))
    assert not support.flash
    assert choose_dense_kernel("cpu", torch.float32, 64, support) == "torch"


def test_unknown_kernel_is_rejected():
    q, k, v = (t.detach() for t in inputs(1, 2, 1, 64, 16, torch.float32))
    with pytest.raises(ValueError, match="unknown dense kernel"):
        dense_document_attention(q, k, v, torch.zeros(1, 64, dtype=torch.int32), kernel="sdpa")


def _signature(*names: str):
    params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names]
    return inspect.Signature(params).parameters


def test_varlen_kwargs_for_each_torch_signature():
    old = _signature("is_causal", "return_aux")  # torch ~2.9: no scale, no GQA flag
    kwargs, factor = varlen_kwargs(old, 0.2, 64, gqa=True)
    assert kwargs == {"is_causal": True} and factor == pytest.approx(0.2 * 8)
    mid = _signature("return_aux", "scale", "window_size")  # ~2.10-2.11
    assert varlen_kwargs(mid, 0.2, 64, gqa=True) == ({"window_size": (-1, 0), "scale": 0.2}, 1.0)
    new = _signature("return_aux", "scale", "window_size", "enable_gqa")  # >= 2.12
    kwargs, factor = varlen_kwargs(new, 0.2, 64, gqa=True)
    assert kwargs == {"window_size": (-1, 0), "scale": 0.2, "enable_gqa": True} and factor == 1
    assert "enable_gqa" not in varlen_kwargs(new, 0.2, 64, gqa=False)[0]
    with pytest.raises(RuntimeError, match="neither"):
        varlen_kwargs(_signature("scale"), 0.2, 64, gqa=False)
    try:  # and this torch's own signature is one of them
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return
    kwargs, _ = varlen_kwargs(inspect.signature(varlen_attn).parameters, 0.2, 64, gqa=True)
    assert kwargs.get("window_size") == (-1, 0) or kwargs.get("is_causal") is True


def test_cu_seqlens_are_the_documents_of_every_row():
    doc_id = make_doc_id([[3, 5, 2], [10], [1] * 10])  # rows 1 and 2 both start doc 0
    cu, longest = cu_seqlens(doc_id)
    lens = [n for row in doc_lens_from_doc_id(doc_id) for n in row]
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
    assert longest == max(lens) == 10


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: checks the varlen, Flex and Triton paths")
@pytest.mark.parametrize("kernel", ["varlen", "flex", "triton", "auto"])
def test_cuda_kernels_match_reference(kernel):
    if kernel == "varlen" and not device_support(torch.device("cuda")).flash:
        pytest.skip("flash attention is not available on this GPU / torch build")
    doc_id = make_doc_id(ROWS).cuda()
    q, k, v = inputs(3, 14, 2, 650, 64, torch.bfloat16, "cuda")
    grad = torch.randn(3, 14, 650, 64, device="cuda")
    want = reference_and_grads(q, k, v, grad, doc_id)
    fn = lambda *x: dense_document_attention(*x, doc_id, kernel=kernel)  # noqa: E731
    got = out_and_grads(fn, q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        err = float((a.double() - b).abs().max())
        assert err < 3e-2, f"{kernel} {name}: max abs error {err:.3g}"
