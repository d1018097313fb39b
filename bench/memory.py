"""Peak memory per GPU of the shipped training configs, without a GPU.

    python bench/memory.py [--configs a.toml b.toml] [--out bench/results/memory.json]

1. Trace a slice of each config under FakeTensorMode (no memory is allocated): the
   embedding, the dense layer 0, one sparse layer, final norm + lm_head + the config's
   loss, forward and backward, one micro-batch at the config's seq_len, bf16 compute
   (FSDP's mixed precision), the config's activation checkpointing; under context
   parallelism one CP rank's share of the row, with the row's K/V gathered and the
   row-sized buffers of its attention. A dispatch mode counts live tensor bytes, the
   peak between marks, and every tensor shape.
2. Scale it to every pipeline stage of the full model under 1F1B: per-layer saved
   activations x layers of the stage x micro-batches in flight, plus the largest
   transient (one layer's recompute + backward, or the chunked loss), plus parameters,
   gradients and AdamW state under FSDP + PP as torch 2.13 runs them (module docstring of
   `static_bytes`), plus the pipeline's receive buffers.
3. Print the peak of the worst stage against 80 GB (H100) and 141 GB (H200) and write
   bench/results/memory.json.

The attention's custom ops (sb_titan/attention/ops.py) have registered fakes, but the
selection op's fake gives the block tables unbacked widths (known only after selection),
which have no byte count. So the trace swaps the attention entry points for fakes with
the memory of the CUDA ops (`fake_attention`): the real estimator pooling and per-chunk
block mass on fake tensors, and block tables sized analytically at the budget.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import platform
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary, weakref
from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import sb_titan.models.attention as sb_attention  # noqa: E402
from sb_titan.attention.estimator import (  # noqa: E402
    block_mass_chunks,
    num_blocks,
    sink_blocks,
)
from sb_titan.attention.layout import AttnMeta, doc_ids_from_positions  # noqa: E402
from sb_titan.attention.selection import STATS_SIZE, AttnStats  # noqa: E402

OUT = REPO / "bench" / "results" / "memory.json"
CLUSTER_CONFIGS = (
    "qwen2.5_0.5b_64k.toml",
    "qwen2.5_3b_128k.toml",
    "qwen3_4b_128k.toml",
    "llama3_8b_64k.toml",
)
GPUS_GB = {"H100": 80.0, "H200": 141.0}  # decimal GB, as the vendors state them
GB = 1e9
SELECTION_CHUNK_BLOCKS = 256  # select_blocks' default chunk of query blocks


# ---------------------------------------------------------------------- live-bytes tracing


class MemoryTimeline(TorchDispatchMode):
    """Live bytes of every tensor storage created while active (plus those `track`ed),
    the peak, marks that close an interval (label, live, peak within the interval), and
    every distinct (shape, dtype) an op produced."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._interval_peak = 0
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.marks: list[tuple[str, int, int]] = []
        self.shapes: set[tuple[tuple[int, ...], torch.dtype]] = set()

    def track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st in self._storages:
            return
        self.shapes.add((tuple(t.shape), t.dtype))
        nbytes = st.nbytes()
        self._storages[st] = (nbytes, weakref.ref(st, lambda _: self._free(nbytes)))
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        self._interval_peak = max(self._interval_peak, self.live)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def mark(self, label: str) -> None:
        self.marks.append((label, self.live, self._interval_peak))
        self._interval_peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.shapes.add((tuple(t.shape), t.dtype))  # views included
                self.track(t)
        return out


class _Mark(torch.autograd.Function):
    """Identity whose backward marks the timeline (where a block's backward starts/ends)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, timeline: MemoryTimeline, label: str):
        ctx.timeline, ctx.label = timeline, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.timeline.mark(ctx.label)
        return grad, None, None


def mark_module(module: torch.nn.Module, timeline: MemoryTimeline, name: str) -> None:
    """Marks `<name>.fwd_start/fwd_end` around its forward and `<name>.bwd_start/bwd_end`
    where backward reaches its output / its input."""

    def before(mod, args, kwargs):
        timeline.mark(f"{name}.fwd_start")
        x = args[0]
        if torch.is_grad_enabled() and x.requires_grad:
            args = (_Mark.apply(x, timeline, f"{name}.bwd_end"), *args[1:])
        return args, kwargs

    def after(mod, args, kwargs, out):
        timeline.mark(f"{name}.fwd_end")
        if torch.is_grad_enabled() and out.requires_grad:
            return _Mark.apply(out, timeline, f"{name}.bwd_start")
        return None

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after, with_kwargs=True, prepend=True)


# ------------------------------------------------------------------ fakes of the attention ops


class _FakeAttention(torch.autograd.Function):
    """Memory of a flash-style attention op: out (q-shaped) and fp32 log-sum-exp [B, H, L]
    saved with q, k, v (and any table) for backward; backward allocates delta [B, H, L]
    fp32, dq, dk, dv, plus the extras: FlashAttention-2's fp32 dq accumulator and its
    q-head-sized dk/dv for GQA (dense); for the block-sparse Triton kernels the fp32
    dK/dV partials of split key blocks (kernels/attn_bwd_dkdv.py `plan_dkdv`), at
    most about one fp32 dK and dV (bench/kernel_balance.py measures 0.8-1.0x at cap =
    the mean), so sized as that."""

    @staticmethod
    def forward(ctx, q, k, v, flash: bool, *saved):
        B, H, L, _ = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
        ctx.flash, ctx.n_saved = flash, len(saved)
        ctx.save_for_backward(q, k, v, out, lse, *saved)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, *_ = ctx.saved_tensors
        delta = torch.empty_like(lse)
        extra = []
        if ctx.flash:
            extra.append(torch.empty_like(q, dtype=torch.float32))  # dq accumulator
            if k.shape[1] != q.shape[1]:
                extra += [torch.empty_like(q), torch.empty_like(q)]  # dk, dv per q head
        else:  # dK/dV partials of the split key blocks
            extra += [torch.empty_like(k, dtype=torch.float32) for _ in range(2)]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del delta, extra
        return (dq, dk, dv, None) + (None,) * ctx.n_saved


def block_table_shapes(batch: int, kv_heads: int, seq_len: int, block_size: int, beta: float):
    """Shapes of the BlockTable select_blocks returns for rows that are one document at
    `topk` budget `beta`: CSR offsets per block and one flat array of the kept pairs per
    side, sum over query blocks i of max(ceil(beta * (i + 1)), forced)."""
    nb = num_blocks(seq_len, block_size)
    per_row = sum(max(math.ceil(beta * (i + 1) * (1 - 1e-6)), min(i + 1, 2)) for i in range(nb))
    ptr, flat = (batch, kv_heads, nb + 1), (batch * kv_heads * per_row,)
    return {"kv_ptr": ptr, "kv_index": flat, "q_ptr": ptr, "q_index": flat}


def _fake_selection(q, k, doc_id, block_size: int, beta: float) -> list[torch.Tensor]:
    """select_blocks' memory: its real pooling and per-chunk block mass (static shapes),
    the sort buffers of `_select_chunk` as empties, and the table sized analytically."""
    B, Hkv, L, _ = k.shape
    sink = sink_blocks(doc_id, block_size)
    chunks = block_mass_chunks(
        q, k, doc_id, sink, block_size=block_size, scale=1.0, chunk_blocks=SELECTION_CHUNK_BLOCKS
    )
    for _, prob, allowed in chunks:
        work = [torch.empty_like(prob) for _ in range(3)]  # sort key, sorted mass, cumsum
        work.append(torch.empty(prob.shape, dtype=torch.int64, device=q.device))  # order
        del prob, allowed, work
    return _fake_table(B, Hkv, L, block_size, beta, q.device)


def _fake_table(batch, kv_heads, seq_len, block_size, beta, device) -> list[torch.Tensor]:
    """Empty tensors of a BlockTable's fields (`block_table_shapes`)."""
    shapes = block_table_shapes(batch, kv_heads, seq_len, block_size, beta)
    dtypes = {"kv_ptr": torch.int64, "q_ptr": torch.int64}
    return [
        torch.empty(s, dtype=dtypes.get(name, torch.int32), device=device)
        for name, s in shapes.items()
    ]


class _FakeAllGather(torch.autograd.Function):
    """Memory of CP's K/V exchange (context_parallel/attention.py): the all-gather's
    rank-major row, reordered into a second row-sized tensor; backward reduce-scatters
    the row's dK/dV (stacked, scattered back to rank-major) to the shard."""

    @staticmethod
    def forward(ctx, kv, length: int, degree: int):
        ctx.degree = degree
        gathered = kv.new_empty(*kv.shape[:3], length, kv.shape[4])
        row = torch.empty_like(gathered)  # .gather(3, order): row order
        del gathered
        return row

    @staticmethod
    def backward(ctx, grad):
        rank_major = torch.empty_like(grad)
        shard = grad.new_empty(*grad.shape[:3], grad.shape[3] // ctx.degree, grad.shape[4])
        del rank_major
        return shard, None, None


class _FakeLocalQueries(torch.autograd.Function):
    """Memory of CP's `_LocalQueries`: the shard's queries at their row positions in a
    row-sized zero query, with row-sized output and log-sum-exp, built and dropped inside
    forward and again in backward; saved: the shard's q, out and lse, the gathered K/V.
    Dense layers too run the block-sparse kernels (on a full table), so backward has
    their fp32 dK/dV partials (`_FakeAttention`)."""

    @staticmethod
    def forward(ctx, q, k_row, v_row, *saved):
        B, H, Lr, D = q.shape
        L = k_row.shape[2]
        q_row = q.new_zeros(B, H, L, D)
        out_row = torch.empty_like(q_row)
        lse_row = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
        out, lse = out_row[:, :, :Lr].clone(), lse_row[:, :, :Lr].clone()  # _from_row
        del q_row, out_row, lse_row
        ctx.n_saved = len(saved)
        ctx.save_for_backward(q, k_row, v_row, out, lse, *saved)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k_row, v_row, *_ = ctx.saved_tensors
        B, H, Lr, D = q.shape
        L = k_row.shape[2]
        rows = [q.new_zeros(B, H, L, D) for _ in range(3)]  # grad, q, out at row positions
        lse_row = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
        delta = torch.empty_like(lse_row)
        partials = [torch.empty_like(k_row, dtype=torch.float32) for _ in range(2)]
        dq_row, dk, dv = torch.empty_like(rows[0]), torch.empty_like(k_row), torch.empty_like(v_row)
        dq = dq_row[:, :, :Lr].clone()
        del rows, lse_row, delta, partials, dq_row
        return (dq, dk, dv) + (None,) * ctx.n_saved


def _fake_cp_attention(beta: float, calls: AttentionCalls):
    """context_parallel.attention.cp_attention's memory on one CP rank: gather K/V of the
    row, select this rank's blocks with the row-sized query the estimator scans (dense:
    the full table), attend the shard's queries. Tables are sized for the whole row at
    the budget: an upper bound on one rank's."""

    def cp_attention(q, k, v, doc_id, split, rank, group_name, *, budget, **_):
        L, bs = doc_id.shape[1], split.block_size
        k_row, v_row = _FakeAllGather.apply(torch.stack([k, v]), L, split.degree).unbind(0)
        with torch.no_grad():
            if budget is not None:
                calls.sparse += 1
                q_row = q.new_zeros(*q.shape[:2], L, q.shape[3])  # kept until the op returns
                table = _fake_selection(q_row, k_row, doc_id, bs, beta)
            else:
                calls.dense += 1
                table = _fake_table(q.shape[0], k.shape[1], L, bs, 1.0, q.device)
        out = _FakeLocalQueries.apply(q, k_row, v_row, doc_id, *table)
        zeros = torch.zeros(q.shape[0], device=q.device)
        stats = AttnStats.estimated(density=zeros, recall=zeros, tokens=zeros)
        return out, (stats if budget is not None else None)

    return cp_attention


@dataclass
class AttentionCalls:
    sparse: int = 0
    dense: int = 0


@contextlib.contextmanager
def fake_attention(beta: float, fake_dense: bool = True) -> Iterator[AttentionCalls]:
    """Swap the model's attention entry points (models/attention.py imports
    `sparse_attention`, `dense_document_attention` and `cp_attention`) for
    memory-faithful fakes;
    `fake_dense=False` keeps whatever `dense_document_attention` is (the tests' negative
    control puts the old L x L mask path there)."""
    calls = AttentionCalls()

    def sparse(
        q, k, v, doc_id, budget, *, policy, block_size, scale=None, backend="auto",
        scorer="mean", true_recall_rate=0.0, per_block=False,
    ):  # fmt: skip
        # selection's and true recall's working memory is transient and bounded by
        # block_scores.SCORE_ELEMENTS (64 MiB of scores at a time) whatever the length
        calls.sparse += 1
        with torch.no_grad():
            table = _fake_selection(q.detach(), k.detach(), doc_id, block_size, beta)
        out = _FakeAttention.apply(q, k, v, False, doc_id, *table)
        zeros = torch.zeros(q.shape[0], device=q.device)
        return out, AttnStats.estimated(density=zeros, recall=zeros, tokens=zeros)

    def dense(q, k, v, doc_id, scale=None):
        calls.dense += 1
        return _FakeAttention.apply(q, k, v, True)

    saved = sb_attention.sparse_attention, sb_attention.dense_document_attention
    saved_cp = sb_attention.cp_attention
    sb_attention.sparse_attention = sparse
    sb_attention.cp_attention = _fake_cp_attention(beta, calls)
    if fake_dense:
        sb_attention.dense_document_attention = dense
    try:
        yield calls
    finally:
        sb_attention.sparse_attention, sb_attention.dense_document_attention = saved
        sb_attention.cp_attention = saved_cp


# ----------------------------------------------------------------------------- the slice


@dataclass
class LayerMemory:
    """Bytes of one transformer block for one micro-batch."""

    saved: int  # kept from its forward to its backward (its output included)
    fwd_peak: int  # above the live bytes at its forward's start
    bwd_peak: int  # above the live bytes when its backward starts (incoming grad included)


@dataclass
class SliceTrace:
    seq_len: int
    rope_len: int
    layers: dict[str, LayerMemory]  # "dense", "sparse"
    static: int  # parameters, buffers and inputs when the forward starts
    embedding_out: int  # the first block's input
    head_saved: int  # norm output, and the logits when the loss is not chunked
    head_bwd_peak: int  # backward through loss and head (plain loss), above its start
    layer_buffer_bytes: int  # buffers of one block (its RoPE table)
    loss_saved: int  # kept by the loss call until backward (hidden-state gradient)
    loss_peak: int  # above the live bytes at the loss call (head + cross-entropy chunks)
    embedding_bwd_peak: int
    peak: int
    shapes: set[tuple[tuple[int, ...], torch.dtype]] = field(repr=False)
    calls: AttentionCalls = field(default_factory=AttentionCalls)

    def token_square_shapes(self, threshold: int) -> list[tuple[tuple[int, ...], str]]:
        """Shapes with two dims >= threshold (a token x token tensor, or full-row logits)."""
        return sorted(
            (s, str(d)) for s, d in self.shapes if sum(1 for x in s if x >= threshold) >= 2
        )


def slice_model_config(config: Any, rope_len: int):
    """Embedding, dense layer 0, one sparse layer, norm and head of `config`'s model."""
    from sb_titan.models.layers import decoder_config
    from sb_titan.models.registry import FAMILIES, model_dims

    dims = dataclasses.replace(
        model_dims(config), n_layers=2, tie_embeddings=False, max_seq_len=rope_len
    )
    attention = dataclasses.replace(config.sparse_attention, enabled=True, dense_layers=[0])
    return decoder_config(FAMILIES[dims.family], dims, attention)


def _loss_fn(config: Any):
    return config.loss.build(), isinstance(config.loss, ChunkedLossWrapper.Config)


def _to_compute_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters in FSDP's compute dtype; buffers (RoPE tables) stay as built, as FSDP
    leaves them."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(p.detach().to(dtype))


def trace_slice(
    config: Any,
    seq_len: int | None = None,
    rope_len: int | None = None,
    beta: float = 1.0,
    fake_dense: bool = True,
) -> SliceTrace:
    """Forward + backward of one micro-batch of the slice on fake tensors: rows of
    `seq_len` tokens (default the config's), RoPE table of `rope_len` positions (default
    seq_len, as the trainer sets it), block tables sized for budget `beta`. Under
    context parallelism (degree N) one CP rank's: its L / N tokens through the model,
    the row's K/V gathered in every attention layer."""
    seq_len = seq_len or config.training.seq_len
    rope_len = rope_len or seq_len
    batch = config.parallelism.pipeline_parallel_microbatch_size
    cp = config.parallelism.context_parallel_degree
    tokens_per_rank = seq_len // cp
    dtype = _DTYPES[config.training.mixed_precision_param]
    model_config = slice_model_config(config, rope_len)
    with FakeTensorMode(), fake_attention(beta, fake_dense) as calls:
        model = model_config.build()
        _to_compute_dtype(model, dtype)
        if cp > 1:  # every layer takes the CP path (SBAttention._context_parallel)
            for module in model.modules():
                if isinstance(module, sb_attention.SBAttention):
                    module.cp = sb_attention.CPGroup(0, "memory-trace")
        if config.activation_checkpoint is not None:
            config.activation_checkpoint.build().apply(model)
        loss_fn, chunked = _loss_fn(config)
        if chunked:
            loss_fn.set_lm_head(model.lm_head)
            model._skip_lm_head = True
        timeline = MemoryTimeline()
        for name in ("tok_embeddings", "layers.0", "layers.1"):
            mark_module(model.get_submodule(name), timeline, name)
        positions = torch.arange(tokens_per_rank).expand(batch, tokens_per_rank)
        tokens = torch.zeros(batch, tokens_per_rank, dtype=torch.int64)
        labels = torch.zeros(batch, tokens_per_rank, dtype=torch.int64)
        for t in (*model.parameters(), *model.buffers()):  # views of them are not new bytes
            timeline.track(t)
        with timeline:
            meta = AttnMeta(
                doc_id=doc_ids_from_positions(torch.arange(seq_len).expand(batch, seq_len)),
                budget=torch.full((batch,), beta),
                microbatch=torch.tensor(0),
                stats=torch.zeros(STATS_SIZE),
                cp_blocks=_cp_blocks(batch, seq_len, cp, config) if cp > 1 else None,
            )
            timeline.mark("start")
            pred = model(tokens, positions=positions, attention_masks=meta)
            timeline.mark("loss_start")
            loss, _ = loss_fn(pred, labels, torch.tensor(batch * tokens_per_rank))
            timeline.mark("loss_end")
            del pred
            timeline.mark("backward_start")
            loss.backward()
            timeline.mark("end")
        layer_buffers = sum(b.nbytes for b in model.get_submodule("layers.1").buffers())
    hidden = batch * tokens_per_rank * model_config.dim * dtype.itemsize
    return _summarize(timeline, calls, seq_len, rope_len, hidden, layer_buffers)


def _cp_blocks(batch: int, seq_len: int, cp: int, config: Any) -> torch.Tensor:
    """AttnMeta.cp_blocks of a contiguous split (which blocks a rank owns does not change
    the bytes)."""
    nb = seq_len // config.sparse_attention.block_size
    return torch.arange(nb).view(cp, nb // cp).expand(batch, cp, nb // cp)


_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def _summarize(timeline, calls, seq_len, rope_len, hidden, layer_buffers) -> SliceTrace:
    """Per-component bytes from the marks; `hidden` (one micro-batch's hidden states) is
    added to backward peaks: the incoming gradient arrives just before the mark."""
    at = {label: (live, peak) for label, live, peak in timeline.marks}

    def layer(name: str) -> LayerMemory:
        start, end = at[f"{name}.fwd_start"][0], at[f"{name}.fwd_end"]
        bwd_start, bwd_end = at[f"{name}.bwd_start"][0], at[f"{name}.bwd_end"]
        return LayerMemory(
            saved=end[0] - start,
            fwd_peak=end[1] - start,
            bwd_peak=bwd_end[1] - bwd_start + hidden,
        )

    loss_start = at["loss_start"][0]
    return SliceTrace(
        seq_len=seq_len,
        rope_len=rope_len,
        layers={"dense": layer("layers.0"), "sparse": layer("layers.1")},
        static=at["start"][0],
        embedding_out=at["tok_embeddings.fwd_end"][0] - at["tok_embeddings.fwd_start"][0],
        head_saved=loss_start - at["layers.1.fwd_end"][0],
        head_bwd_peak=at["layers.1.bwd_start"][1] - at["backward_start"][0],
        layer_buffer_bytes=layer_buffers,
        loss_saved=at["loss_end"][0] - loss_start,
        loss_peak=at["loss_end"][1] - loss_start,
        embedding_bwd_peak=at["end"][1] - at["tok_embeddings.bwd_start"][0] + hidden,
        peak=timeline.peak,
        shapes=timeline.shapes,
        calls=calls,
    )


# ---------------------------------------------------------------------- the full model


@dataclass
class StageMemory:
    stage: int
    dense_layers: int
    sparse_layers: int
    params: int
    microbatches_in_flight: int
    parts: dict[str, float]  # GB
    peak_gb: float


def in_flight(schedule: str, stages: int, stage: int, microbatches: int) -> int:
    """Micro-batches whose activations a stage holds at once: 1F1B runs P - s forwards
    before its first backward; GPipe runs them all."""
    key = schedule.lower()
    if stages == 1:
        return 1
    if key == "1f1b":
        return min(stages - stage, microbatches)
    if key == "gpipe":
        return microbatches
    raise ValueError(f"pipeline_parallel_schedule {schedule!r}: only 1F1B and GPipe are modelled")


def stage_layout(config: Any, model: Any) -> list[list[str]]:
    from sb_titan.profiler.stage import stage_module_names

    return [
        stage_module_names(config.parallelism, model, s)
        for s in range(max(1, config.parallelism.pipeline_parallel_degree))
    ]


def static_bytes(config: Any, params: int, buffers: int) -> dict[str, int]:
    """Parameter-side bytes of a stage, as FSDP2 + torch 2.13's pipeline schedules run:
    the schedule turns off FSDP's resharding and gradient reduction during the step
    (PipelineStage.backward_maybe_with_nosync), so the stage's parameters stay gathered
    in the compute dtype and its gradients accumulate unsharded in the reduce dtype
    until the step's end; the fp32 master weights, their gradients and AdamW's two
    moments are sharded over data_parallel_shard_degree x context_parallel_degree
    (TorchTitan's FSDP mesh spans both). Without PP this overstates (FSDP reshards every
    block after use)."""
    t, p = config.training, config.parallelism
    dp = max(1, p.data_parallel_shard_degree) * p.context_parallel_degree
    master = _DTYPES[t.dtype].itemsize
    return {
        "params_gathered": params * _DTYPES[t.mixed_precision_param].itemsize,
        "grads_unsharded": params * _DTYPES[t.mixed_precision_reduce].itemsize,
        "params_grads_adamw_sharded": params * master * 4 // dp,
        "buffers": buffers,
    }


def stage_memory(
    config: Any, model: Any, trace: SliceTrace, stage: int, modules: list[str]
) -> StageMemory:
    """`model`: the run's model spec's (its layers' kinds and parameters)."""
    from sb_titan.profiler.stage import layer_ids, stage_params

    p = config.parallelism
    n_stages = max(1, p.pipeline_parallel_degree)
    microbatches = config.training.local_batch_size // p.pipeline_parallel_microbatch_size
    first, last = "tok_embeddings" in modules, "lm_head" in modules
    kinds = _layer_kinds(model, layer_ids(modules))
    hidden = trace.embedding_out  # one micro-batch's hidden states [mb, L, D]
    per_mb = sum(trace.layers[k].saved for k in kinds)
    per_mb += trace.embedding_out if first else 0
    per_mb += trace.head_saved + trace.loss_saved if last else 0
    transient = [max(trace.layers[k].fwd_peak, trace.layers[k].bwd_peak) for k in set(kinds)]
    transient += [trace.embedding_bwd_peak] if first else []
    transient += [trace.loss_peak, trace.head_bwd_peak] if last else []
    k = in_flight(p.pipeline_parallel_schedule, n_stages, stage, microbatches)
    pipeline = 0
    if n_stages > 1:
        pipeline += 0 if first else 2 * microbatches * hidden  # received inputs + their grads
        pipeline += 0 if last else microbatches * hidden  # received output grads
    params = stage_params(model, modules)
    parts = {
        **static_bytes(config, params, len(kinds) * trace.layer_buffer_bytes),
        "pipeline_buffers": pipeline,
        "activations_in_flight": k * per_mb,
        "largest_transient": max(transient),
    }
    return StageMemory(
        stage=stage,
        dense_layers=kinds.count("dense"),
        sparse_layers=kinds.count("sparse"),
        params=params,
        microbatches_in_flight=k,
        parts={name: v / GB for name, v in parts.items()},
        peak_gb=sum(parts.values()) / GB,
    )


def _layer_kinds(model: Any, ids: list[int]) -> list[str]:
    layers = model.layers
    return ["sparse" if layers[i].attention.inner_attention.sparse else "dense" for i in ids]


RESERVE_GB = 4.0  # CUDA context, NCCL and cuBLAS workspaces
FRAGMENTATION = 0.10  # caching-allocator slack on top of the traced peak


def target_gpu(path: Path) -> str:
    """The GPU a config states it is for (a `# Target GPU: H100` comment line); H100, the
    smaller one, when it states none."""
    found = re.search(r"^#\s*Target GPU:\s*(\w+)", path.read_text(), re.MULTILINE)
    name = found.group(1) if found else "H100"
    if name not in GPUS_GB:
        raise ValueError(f"{path}: 'Target GPU: {name}', expected one of {sorted(GPUS_GB)}")
    return name


def _stages(config: Any, model: Any, trace: SliceTrace) -> list[StageMemory]:
    layout = stage_layout(config, model)
    return [stage_memory(config, model, trace, s, m) for s, m in enumerate(layout)]


def config_memory(path: Path, plain_loss: bool = True) -> dict[str, Any]:
    """`path`'s stages and peak; `plain_loss`: also what TorchTitan's plain loss would
    need (a second trace of a config that chunks its loss)."""
    from sb_titan.config.toml import checked_model_spec, load_config
    from sb_titan.models.registry import family_of_decoder

    config = load_config(path)
    model = checked_model_spec(config, path).model
    target = target_gpu(path)
    stages = _stages(config, model, trace := trace_slice(config))
    worst = max(stages, key=lambda st: st.peak_gb)
    unchunked = None
    if plain_loss and _loss_fn(config)[1]:  # the same run with TorchTitan's plain loss
        plain = copy.copy(config)
        plain.loss = CrossEntropyLoss.Config()
        unchunked = max(st.peak_gb for st in _stages(plain, model, trace_slice(plain)))
    needed = worst.peak_gb * (1 + FRAGMENTATION) + RESERVE_GB
    p = config.parallelism
    return {
        "config": str(path.relative_to(REPO) if path.is_relative_to(REPO) else path),
        "family": family_of_decoder(model),
        "flavor": config.model.flavor,
        "seq_len": config.training.seq_len,
        "loss": type(config.loss).__qualname__.removesuffix(".Config"),
        "loss_num_chunks": getattr(config.loss, "num_chunks", 1),
        "activation_checkpoint": type(config.activation_checkpoint).__qualname__.split(".")[0]
        if config.activation_checkpoint is not None
        else "none",
        "pp": p.pipeline_parallel_degree,
        "cp": p.context_parallel_degree,
        "schedule": p.pipeline_parallel_schedule,
        "dp_shard": p.data_parallel_shard_degree,
        "microbatches": config.training.local_batch_size // p.pipeline_parallel_microbatch_size,
        "slice": {
            "layer_saved_gb": {k: v.saved / GB for k, v in trace.layers.items()},
            "layer_peak_gb": {k: max(v.fwd_peak, v.bwd_peak) / GB for k, v in trace.layers.items()},
            "loss_peak_gb": trace.loss_peak / GB,
            "attention_fakes_called": dataclasses.asdict(trace.calls),
        },
        "stages": [dataclasses.asdict(st) for st in stages],
        "peak_gb": worst.peak_gb,
        "peak_gb_with_unchunked_loss": unchunked,
        "needed_gb": needed,
        "fits": {gpu: needed <= cap for gpu, cap in GPUS_GB.items()},
        "target": target,
        "fits_target": needed <= GPUS_GB[target],
    }


def shipped_configs() -> list[Path]:
    return sorted((REPO / "train_configs").glob("*.toml"))


def _gb(x: float) -> str:
    return f"{x:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    """Summary per config (its worst stage), then every stage of the pipelined configs."""
    lines = [
        "| config | L | loss | PP x CP x DP | worst stage | params, grads, AdamW GB | "
        "activations + buffers GB | largest transient GB | peak GB | needed GB | target "
        "| H100 80 | H200 141 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        worst = max(r["stages"], key=lambda st: st["peak_gb"])
        parts = worst["parts"]
        static = sum(parts[k] for k in _STATIC_PARTS)
        acts = parts["activations_in_flight"] + parts["pipeline_buffers"] + parts["buffers"]
        loss = r["loss"] + (f" /{r['loss_num_chunks']}" if r["loss_num_chunks"] > 1 else "")
        dp = r["dp_shard"] if r["dp_shard"] > 0 else "auto"
        lines.append(
            f"| {Path(r['config']).stem} | {r['seq_len']} | {loss} | {r['pp']} x {r['cp']} x {dp} "
            f"| {worst['stage']} ({worst['microbatches_in_flight']} in flight) | {_gb(static)} "
            f"| {_gb(acts)} | {_gb(parts['largest_transient'])} | {_gb(r['peak_gb'])} "
            f"| {_gb(r['needed_gb'])} | {r['target']} | "
            + " | ".join("fits" if r["fits"][g] else "NO" for g in GPUS_GB)
            + " |"
        )
    lines += [
        "",
        "| config | stage | layers dense+sparse | params M | in flight | "
        + " | ".join(f"{k} GB" for k in _PART_NAMES)
        + " | peak GB |",
        "|---|---|---|---|---|" + "---|" * len(_PART_NAMES) + "---|",
    ]
    for r in rows:
        if r["pp"] <= 1:
            continue
        for st in r["stages"]:
            lines.append(
                f"| {Path(r['config']).stem} | {st['stage']} "
                f"| {st['dense_layers']}+{st['sparse_layers']} | {st['params'] / 1e6:.0f} "
                f"| {st['microbatches_in_flight']} | "
                + " | ".join(_gb(st["parts"][k]) for k in _PART_NAMES)
                + f" | {_gb(st['peak_gb'])} |"
            )
    for r in rows:
        if r["peak_gb_with_unchunked_loss"] is not None:
            lines.append(
                f"\n{Path(r['config']).stem}: {_gb(r['peak_gb_with_unchunked_loss'])} GB peak "
                "with TorchTitan's plain cross-entropy (full-row fp32 logits) instead."
            )
    return "\n".join(lines)


_STATIC_PARTS = ("params_gathered", "grads_unsharded", "params_grads_adamw_sharded")
_PART_NAMES = (
    *_STATIC_PARTS,
    "buffers",
    "pipeline_buffers",
    "activations_in_flight",
    "largest_transient",
)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="*", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument(
        "--no-plain-loss",
        action="store_true",
        help="skip the second trace with TorchTitan's plain loss (the last column)",
    )
    args = parser.parse_args(argv)
    configs = args.configs or shipped_configs()
    rows = [config_memory(p.resolve(), not args.no_plain_loss) for p in configs]
    report = {
        "what": "peak memory per GPU from a FakeTensorMode trace of one slice, scaled",
        "torch": torch.__version__,
        "host": platform.node(),
        "reserve_gb": RESERVE_GB,
        "fragmentation": FRAGMENTATION,
        "gpus_gb": GPUS_GB,
        "configs": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
