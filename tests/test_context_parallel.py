"""Context parallelism: CP attention against single-process attention, with real
torchrun/gloo processes (one launch per CP degree)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, cpu_env

from sb_titan.context_parallel.split import (
    CPSplit,
    balanced_split,
    imbalance,
    rank_loads,
    zigzag_split,
)


@pytest.mark.torchrun
@pytest.mark.parametrize("degree", [2, 4])
def test_cp_attention_matches_single_process(degree, tmp_path):
    """out, dq, dk, dv of every shard equal single-process block-sparse attention on the
    same table (fp32, <= 1e-5 relative): dense and `mass`-sparse layers, zigzag and
    balanced splits, documents crossing shard boundaries and rows of many short ones;
    the shards' density adds up to the single-process density."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={degree}", "tests/cp_attention_worker.py", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    for rank in range(degree):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 8  # 2 layouts x dense/sparse x 2 splits
        for case, errs in results.items():
            for what in ("out", "dq", "dk", "dv"):
                assert errs[what] <= 1e-5, (rank, case, what, errs[what])
            assert errs["row_sized_queries_saved"] == 0, (rank, case)  # memory: a shard
            if "density" in errs:
                got, want = errs["density"]
                assert got == pytest.approx(want, rel=1e-6), (rank, case)


def _owned(split: CPSplit) -> list[list[list[int]]]:
    return [[sorted(r) for r in row] for row in split.blocks.tolist()]


def test_zigzag_is_head_tail():
    split = zigzag_split(1, 8 * 64, 2, 64)
    assert _owned(split) == [[[0, 1, 6, 7], [2, 3, 4, 5]]]


def test_balanced_split_partitions_equally_and_beats_zigzag_on_packed_rows():
    rng = np.random.default_rng(0)
    cost = rng.exponential(size=(3, 64)) + np.linspace(0, 2, 64)  # rising, like causal work
    split = balanced_split(cost, 4, 64)
    for row in split.blocks.tolist():
        flat = sorted(b for r in row for b in r)
        assert flat == list(range(64))  # every block once
        assert all(len(r) == 16 for r in row)  # equal tokens per rank
    loads = rank_loads(cost, split)
    zig = rank_loads(cost, zigzag_split(3, 64 * 64, 4, 64))
    for b in range(3):
        # brute-force check of the loads against the blocks each rank owns
        for r, blocks in enumerate(split.blocks[b].tolist()):
            assert loads[b, r] == pytest.approx(cost[b, blocks].sum())
        assert imbalance(loads[b]) < imbalance(zig[b])
        assert imbalance(loads[b]) < 1.05


def test_gather_order_inverts_the_shards():
    split = balanced_split(np.random.default_rng(1).random((2, 16)), 4, 64)
    order = split.gather_order()
    gathered = torch.cat([split.token_index(r) for r in range(4)], dim=1)  # rank-major
    assert torch.equal(gathered.gather(1, order), torch.arange(16 * 64).expand(2, -1))
