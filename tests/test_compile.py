"""`--compile.enable`: the attention enters compiled graphs as custom ops, and compiled
training matches eager training.

Where Inductor runs. On this CPU it generates C++, not the Triton a GPU run gets, and a
cold compile of the debug model costs 70-140 CPU s per 2-rank run. What is ours (the
custom ops' schemas, fake tensors, autograd and in-place statistics) meets Inductor
here, in process, under activation checkpointing. Whole-model compiled training runs
twice under torchrun: the FSDP run below, and the richest composition (context
parallelism, full activation checkpointing, a budget that drops blocks:
test_cp_training.py). Both trace as a GPU run does (Dynamo, AOTAutograd, fullgraph
blocks) and run their graphs with `aot_eager`, which checks the trace, not a code
generator: C++ for a CPU's loops is not what a GPU user compiles. (Whole-model CPU
Inductor under CP was measured: within 2.1e-7 of eager, docs/attention.md.)

Tolerance. At budget 1.0 (`topk` keeps every allowed block, so selection cannot flip)
compiled and eager differ only by the compiler's reordering of fp32 reductions:
measured < 1e-6 on the loss over 6 steps of the debug config under Inductor, asserted
at 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from conftest import losses, torchrun
from torch.utils.checkpoint import checkpoint

from sb_titan.attention.layout import AttnMeta
from sb_titan.attention.ops import _attention_op, _select_blocks_op, select
from sb_titan.attention.recall import sample_positions
from sb_titan.attention.selection import STATS_SIZE
from sb_titan.models.attention import SBAttention


def _inputs(B=2, L=300, hq=4, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, L, hq, d, generator=g, requires_grad=True)
    k = torch.randn(B, L, hkv, d, generator=g, requires_grad=True)
    v = torch.randn(B, L, hkv, d, generator=g, requires_grad=True)
    doc_id = torch.tensor([[0] * 120 + [1] * 180, [0] * L], dtype=torch.int32)
    return q, k, v, doc_id


def test_ops_pass_opcheck():
    """Schema, fake (shapes, strides, dtypes), autograd registration and AOT dispatch."""
    q, k, v, doc_id = _inputs()
    q, k, v = (t.detach().transpose(1, 2) for t in (q, k, v))  # strided, as the model passes
    budget = torch.tensor([0.5, 0.8])
    args = (q, k, doc_id, budget, "mass", 64, 32**-0.5, "torch")
    torch.library.opcheck(_select_blocks_op, args, test_utils=("test_schema", "test_faketensor"))
    table, _ = select(q, k, doc_id, budget, policy="mass", block_size=64, scale=32**-0.5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(_attention_op, (q, k, v, doc_id, *table[:4], 64, 32**-0.5, "torch"))


class _CheckpointedAttention(torch.nn.Module):
    """SBAttention under activation checkpointing, as `activation_checkpoint.mode = full`
    wraps it: the forward runs again inside backward."""

    def __init__(self, policy: str) -> None:
        super().__init__()
        config = SBAttention.Config(policy=policy, block_size=64, true_recall_rate=1.0)
        self.attn = SBAttention(config)

    def forward(self, q, k, v, meta):
        return checkpoint(self.attn, q, k, v, attention_masks=meta, use_reentrant=False)


@pytest.mark.parametrize("policy,budget", [("topk", 1.0), ("mass", 0.5)])
def test_compiled_attention_matches_eager_and_counts_stats_once(policy, budget):
    results = {}
    for mode in ("eager", "compiled"):
        module = _CheckpointedAttention(policy)
        if mode == "compiled":
            module = torch.compile(module, fullgraph=True)  # a graph break is an error
        q, k, v, doc_id = _inputs()
        stats = torch.zeros(STATS_SIZE)
        blocks = torch.zeros(5, 2, -(-doc_id.shape[1] // 64))  # per query block
        meta = AttnMeta(doc_id, torch.full((2,), budget), torch.tensor(0), stats, None, blocks)
        out = module(q, k, v, meta)
        out.pow(2).sum().backward()
        results[mode] = (out.detach(), q.grad, k.grad, v.grad, blocks, stats)
    for eager, compiled in zip(*results.values(), strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    # [density sum, rows, ...]: one layer, two rows, counted once despite the recompute;
    # so are the sampled true-recall queries (every q head of each sampled position)
    q, _, _, doc_id = _inputs()
    at = sample_positions(doc_id, 64, 1.0) >= 0
    sampled = int(at.sum()) * q.shape[2]  # [B, L, H, D]
    for mode in ("eager", "compiled"):
        blocks, stats = results[mode][-2:]
        assert stats[1].item() == 2 and stats[6].item() == sampled > 0, (mode, stats)
        # ... and per query block: every q head of its sampled query, once; its key
        # blocks allowed (causal, own document: row 0's second document starts in block
        # 1, at token 120) and kept, per kv head, whose ratio per row is its density
        assert blocks[2].tolist() == (at * q.shape[2]).float().tolist(), mode
        torch.testing.assert_close(blocks[:3].sum(dim=(1, 2)), stats[4:7])
        sinks = [[0, 0, 1, 1, 1], [0] * 5]
        allowed = [[2.0 * (i - s + 1) for i, s in enumerate(row)] for row in sinks]
        assert blocks[4].tolist() == allowed, mode
        assert (blocks[3] >= 2).all() and (blocks[3] <= blocks[4]).all(), mode
        torch.testing.assert_close((blocks[3].sum(1) / blocks[4].sum(1)).sum(), stats[0])


# ------------------------------------------------------------------- training (torchrun)


@pytest.mark.torchrun
def test_compiled_training_matches_eager_at_full_budget(tmp_path):
    """Two FSDP ranks, three steps at budget 1.0: within 1e-5 of eager."""
    args = ["--training.seq_len", "256", "--debug.seed", "0", "--training.steps", "3"]
    args += ["--sparse_attention.policy", "topk", "--dst.beta0", "1.0"]
    torchrun(2, args, tmp_path / "eager")
    compiled = ["--compile.enable", "--compile.backend", "aot_eager"]
    proc = torchrun(2, [*args, *compiled], tmp_path / "compiled")
    assert "Compiling each TransformerBlock" in proc.stdout + proc.stderr
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert len(eager) == len(compiled) == 3
    assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) < 1e-5, (eager, compiled)
