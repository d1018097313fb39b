"""Linear memory in L, shown without a GPU (bench/memory.py traces on fake tensors).

For the Qwen2.5 cluster configs (64K, 128K): forward + backward of a slice (embedding,
dense layer 0, one sparse layer, final norm + head + the config's loss) at its seq_len L
and at L/2, both with the RoPE table of L positions the trainer builds (at L/2, a table
twice the row). No tensor may have two dims >= L/4 (a token x token tensor, or full-row
logits), and the activation peak must scale as L. The attention entry points are
memory-faithful fakes (bench/memory.py says why); the negative controls show the check
catches an L x L dense mask and an unchunked loss. A CP = 2 rank keeps half a block's
activations. Every shipped config fits its target GPU (its trace at L is the linearity
test's, memoized). Block tables are measured on real selections.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO
from torchtitan.components.loss import CrossEntropyLoss

from sb_titan.attention.layout import document_causal_mask
from sb_titan.attention.selection import select_blocks
from sb_titan.config.toml import load_config
from sb_titan.models.registry import derive_model_spec

_spec = importlib.util.spec_from_file_location("bench_memory", REPO / "bench" / "memory.py")
memory = importlib.util.module_from_spec(_spec)
sys.modules["bench_memory"] = memory  # dataclasses look their module up
_spec.loader.exec_module(memory)

CLUSTER = [c.removesuffix(".toml") for c in memory.CLUSTER_CONFIGS]
# Tracing a config twice at full length costs about a minute of CPU for a 128K row: the
# linearity checks run on the Qwen2.5 configs (64K and 128K); the other families' configs
# are the same slice with other widths, and the fit test below traces every config.
LINEARITY = ["qwen2.5_0.5b_64k", "qwen2.5_3b_128k"]


def _config(name: str):
    return load_config(REPO / "train_configs" / f"{name}.toml")


@pytest.fixture(scope="module")
def slices():
    """memory.trace_slice, memoized per (config, length, RoPE length, options): a config's
    trace at its own length is both a linearity trace and the fit test's."""
    cache, trace_slice = {}, memory.trace_slice  # the fit test patches memory.trace_slice

    def trace(config, seq_len=None, rope_len=None, **options):
        n = seq_len or config.training.seq_len
        key = (repr(config), n, rope_len or n, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = trace_slice(config, n, rope_len or n, **options)
        return cache[key]

    return trace


@pytest.fixture(scope="module", params=LINEARITY)
def traces(request, slices):
    config = _config(request.param)
    L = config.training.seq_len
    dims = derive_model_spec(config).model
    # the shape check below needs L/4 (at L/2) above every model width but the vocabulary
    assert L // 8 > max(dims.dim, dims.layers[0].feed_forward.w1.out_features)
    return config, {n: slices(config, seq_len=n, rope_len=L) for n in (L, L // 2)}


def test_no_token_by_token_tensor(traces):
    config, by_len = traces
    L = config.training.seq_len
    for n, trace in by_len.items():
        assert trace.calls.sparse >= 1 and trace.calls.dense >= 1  # the fakes ran
        assert trace.token_square_shapes(n // 4) == [], n
        rope = derive_model_spec(config).model.layers[0].attention.rope
        assert ((L, 2 * rope.dim), torch.float32) in trace.shapes  # at L/2: 2n positions


def test_activation_memory_is_linear_in_length(traces):
    _, by_len = traces
    long, half = sorted(by_len.values(), key=lambda t: -t.seq_len)
    for kind in ("dense", "sparse"):
        a, b = long.layers[kind], half.layers[kind]
        assert a.saved <= 2.0 * b.saved and a.bwd_peak <= 2.01 * b.bwd_peak, kind
    assert long.loss_peak <= 2.01 * half.loss_peak
    assert long.peak - long.static <= 2.01 * (half.peak - half.static)


def _masked_sdpa(q, k, v, doc_id, scale=None):
    """The dense path before linear memory: SDPA with an explicit [B, 1, L, L] mask."""
    mask = document_causal_mask(doc_id)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def test_shape_check_catches_the_dense_mask_and_the_unchunked_loss(monkeypatch):
    """Negative controls at 32K (0.5B): the old dense path (an L x L mask) and TorchTitan's
    plain cross-entropy ([B, L, V] fp32 logits) both fail the check above. One trace runs
    both (each assertion names its own tensor)."""
    config = _config("qwen2.5_0.5b_64k")
    n = 32768
    monkeypatch.setattr(memory.sb_attention, "dense_document_attention", _masked_sdpa)
    config.loss = CrossEntropyLoss.Config()
    trace = memory.trace_slice(config, seq_len=n, fake_dense=False)
    square = trace.token_square_shapes(n // 4)
    assert ((1, 1, n, n), "torch.bool") in square
    assert ((n, 151936), "torch.float32") in square


def test_a_cp_rank_keeps_its_share_and_gathers_the_row():
    """Context parallelism (0.5B, L = 8K): a CP = 2 rank runs L/2 tokens, so each block
    keeps half the activations (full AC: its input); its attention gathers the row's
    K/V and builds row-sized query and output inside the op (context_parallel/
    attention.py); and the fp32 state shards over DP x CP, TorchTitan's FSDP mesh. The
    blocks are what is read here, so both traces take the plain loss (one chunk, where
    the config's loss would trace 32)."""
    n, path = 8192, REPO / "train_configs" / "qwen2.5_0.5b_64k.toml"
    cp = [
        "--parallelism.context_parallel_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
    ]
    one, two = load_config(path), load_config(path, cp)
    one.loss = two.loss = CrossEntropyLoss.Config()
    t1, t2 = (memory.trace_slice(c, seq_len=n) for c in (one, two))
    for kind in ("dense", "sparse"):
        assert 2 * t2.layers[kind].saved == t1.layers[kind].saved, kind
    assert t2.calls.sparse >= 1 and t2.calls.dense >= 1
    bf16 = torch.bfloat16
    assert {((1, n // 2, 896), bf16), ((1, 14, n, 64), bf16), ((1, 2, n, 64), bf16)} <= t2.shapes
    assert memory.static_bytes(two, 10**6, 0)["params_grads_adamw_sharded"] == 16 * 10**6 // 4


def _doc_id(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]


LAYOUTS = {
    "one document": [4096],
    "halving": [2048, 1024, 512, 256, 128, 64, 64],
    "long tail": [1024] + [192] * 16,
    "short": [256] * 16,
    "one long, many one-block": [512] + [64] * 56,
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_block_tables_are_linear_in_kept_pairs(layout):
    """Real selections (4/2 heads, block 64) at L = 2048 and 8192: the whole table (both
    CSR sides with their offsets) costs 8 bytes per kept pair plus 16 per block, so at
    most ~24 bytes per pair, and no more at the longer length. Both padded layouts fail
    this: the transposed side is NB wide (every query block keeps its document's first
    block), and one long document widens every row of the kv side."""
    torch.manual_seed(0)
    for policy in ("mass", "topk"):
        for beta in (0.1, 0.5, 1.0):
            per_pair = {}
            for length in (2048, 8192):
                q, k = torch.randn(1, 4, length, 64), torch.randn(1, 2, length, 64)
                lengths = [n * length // 4096 for n in LAYOUTS[layout]]
                table, _ = select_blocks(q, k, _doc_id(lengths), beta, policy=policy, block_size=64)
                kept = int(table.kv_count.sum())
                nbytes = sum(t.nbytes for t in table[:4])
                per_pair[length] = nbytes / kept
            assert max(per_pair.values()) <= 24.5, (policy, beta, per_pair)
            assert per_pair[8192] <= per_pair[2048] * 1.05, (policy, beta, per_pair)


def test_fake_tables_match_real_selection_on_one_document():
    """The bench's analytic table shapes are what select_blocks returns for a row that is
    one document (at budget 1 and, for the kv side, at 0.5)."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 2048, 64), torch.randn(1, 2, 2048, 64)
    for beta in (0.5, 1.0):
        table, _ = select_blocks(q, k, _doc_id([2048]), beta, policy="topk", block_size=64)
        shapes = memory.block_table_shapes(1, 2, 2048, 64, beta)
        for name, shape in shapes.items():
            assert tuple(getattr(table, name).shape) == shape, (beta, name)


def test_shipped_configs_fit_their_target_gpu(tmp_path, slices, monkeypatch):
    monkeypatch.setattr(memory, "trace_slice", slices)  # the linearity traces at L reused
    rows = memory.main(["--out", str(tmp_path / "memory.json"), "--no-plain-loss"])
    by_name = {row["config"]: row for row in rows}
    for name in CLUSTER:
        row = by_name[f"train_configs/{name}.toml"]
        assert row["target"] in memory.GPUS_GB, name
        assert row["fits_target"], (name, row["needed_gb"], row["target"])
        assert row["loss"] == "ChunkedLossWrapper" and row["stages"]  # the loss is counted
    assert all(row["fits_target"] for row in rows)
