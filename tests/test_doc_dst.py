"""Per-document budgets in the balance loop ([dst] per_document): the balancer's
budgets against the cost model's own per-document predictions, the switch off against
the loop as it was, and the trainer's path from them to the [B, NB] budgets attention
reads (the loader's real packing)."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest

from sb_titan.attention.layout import block_budgets, doc_ids_from_positions
from sb_titan.balance.balancer import Balancer
from sb_titan.balance.doc_budgets import DocAllocator, DocBudgetConfig
from sb_titan.balance.dst import DSTConfig, recalled_tokens
from sb_titan.balance.sab import SABConfig
from sb_titan.balance.step_shape import StepShape
from sb_titan.data.loader import pack_microbatch
from sb_titan.data.longtail import longtail_v1
from sb_titan.simulator import Cluster, Scenario, build_simulator, simulate

SHAPE = StepShape(seq_len=4096, dp=2, microbatches=4, rows=2)
SAB = SABConfig(policy="sab", seed=0)
# long documents (>= 2048 tokens here) keep at least 0.7, above DST's floor
DST = DSTConfig(beta0=0.8, beta_min=0.5, long_tokens=2048, long_floor=0.7)
STEPS = 3


@functools.cache
def _cost_model():
    """The simulator's analytic H200 model of Qwen2.5-0.5B at 4k rows."""
    cluster = Cluster(dp=SHAPE.dp, pp=1, microbatches=SHAPE.microbatches, seq_len=4096)
    return build_simulator(cluster, Scenario(flavor="0.5b", steps=2)).models.planning


def _steps(dst: DSTConfig, pipelined: bool = True):
    lengths = longtail_v1(3000, SHAPE.seq_len, 0)
    b = Balancer(lengths, SHAPE, SAB, _cost_model(), dst, pipelined=pipelined)
    return [b.next_step() for _ in range(STEPS)]


def _doc_seconds(lens, betas) -> float:
    """Attention seconds of a micro-batch's documents at their budgets, one by one."""
    model = _cost_model()
    return math.fsum(
        float(model.document_seconds(np.array([n]), b, "mass")[0])
        for n, b in zip(lens, betas, strict=True)
    )


def _doc_recalled(lens, betas) -> float:
    """Predicted recalled tokens, every document a unit of its own (dst's prediction)."""
    units = [[[n]] for n in lens]
    return math.fsum(recalled_tokens(units, list(betas), _cost_model())[1].tolist())


@pytest.mark.parametrize("pipelined", [True, False])
def test_documents_meet_each_microbatch_target_and_beat_its_equal_split(pipelined):
    gained = 0.0
    for s in _steps(dataclasses.replace(DST, per_document=True), pipelined):
        for dp, rank in enumerate(s.plan.microbatches):
            for mb, plan in enumerate(rank):
                lens, beta = plan.doc_lens, s.budgets[dp][mb]
                betas = s.doc_budgets.budgets[dp][mb]
                assert len(betas) == len(lens)
                assert all(DST.beta_min <= b <= DST.beta_max for b in betas)
                assert all(b >= 0.7 for n, b in zip(lens, betas, strict=True) if n >= 2048)
                target = _doc_seconds(lens, [beta] * len(lens))
                assert _doc_seconds(lens, betas) <= target * (1 + 1e-12)
                equal = _doc_recalled(lens, [beta] * len(lens))
                mine = _doc_recalled(lens, betas)
                assert mine >= equal * (1 - 1e-12)
                gained += mine - equal
        assert s.doc_budgets.scale == 1.0  # the `mean` anchor: all of it as recall
    assert gained > 0


def test_recall_anchor_takes_the_gain_as_time_at_betazeros_recall():
    dst = dataclasses.replace(DST, per_document=True, anchor="recall")
    steps = _steps(dst)
    assert min(s.doc_budgets.scale for s in steps) < 1  # some time was taken back
    for s in steps:
        lens = [mb.doc_lens for rank in s.plan.microbatches for mb in rank]
        flat = [b for rank in s.budgets for b in rank]
        per_doc = [b for rank in s.doc_budgets.budgets for mb in rank for b in mb]
        all_lens = [n for mb in lens for n in mb]
        static = _doc_recalled(all_lens, [DST.beta0] * len(all_lens))
        assert _doc_recalled(all_lens, per_doc) >= static * (1 - 1e-9)
        assert 0 < s.doc_budgets.scale <= 1
        doc_betas = [mb for rank in s.doc_budgets.budgets for mb in rank]
        for n, beta, mine in zip(lens, flat, doc_betas, strict=True):
            target = _doc_seconds(n, [beta] * len(n)) * s.doc_budgets.scale
            floors = _doc_seconds(n, [0.7 if x >= 2048 else DST.beta_min for x in n])
            assert _doc_seconds(n, mine) <= max(target, floors) * (1 + 1e-12)


def test_off_plans_and_budgets_as_before():
    off, on = _steps(DST), _steps(dataclasses.replace(DST, per_document=True))
    for a, b in zip(off, on, strict=True):
        assert a.plan == b.plan and a.budgets == b.budgets
        assert a.doc_budgets is None and b.doc_budgets is not None
        assert a.row_budgets(1, 2, SHAPE.rows) == [[a.budgets[1][2]]] * SHAPE.rows


def _reference_blocks(rows, seq_len, block_size, betas) -> list[list[float]]:
    """Each query block's budget: that of the piece holding its first token, the row's
    last piece's past the pieces (padding)."""
    flat = iter(betas)
    out = []
    for row in rows:
        starts, own, at = [], [], 0
        for piece in row:
            starts.append(at)
            own.append(next(flat))
            at += piece.length
        out.append(
            [
                own[int(np.searchsorted(starts, t, "right")) - 1]
                for t in range(0, seq_len, block_size)
            ]
        )
    return out


class _Tokens:
    """Token ids by length (the loader's packing reads only these)."""

    name = "lengths"

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def read(self, sample_id: int, start: int, length: int) -> np.ndarray:
        assert start + length <= self.lengths[sample_id]
        return np.arange(start, start + length) % 97 + 1


def test_trainer_path_turns_them_into_block_budgets():
    """What SBTrainer.post_dataloading_process does with a scheduled micro-batch: the
    loader's rows -> doc_id -> ScheduledStep.row_budgets -> layout.block_budgets."""
    lengths = longtail_v1(3000, SHAPE.seq_len, 0)
    source = _Tokens(lengths)
    dst = dataclasses.replace(DST, per_document=True)
    b = Balancer(lengths, SHAPE, SAB, _cost_model(), dst, pipelined=True)
    s = b.next_step()
    seen = set()
    for dp, rank in enumerate(s.plan.microbatches):
        for mb, plan in enumerate(rank):
            _, _, positions = pack_microbatch(source, plan, SHAPE.seq_len, 0)
            doc_id = doc_ids_from_positions(positions)
            got = block_budgets(doc_id, s.row_budgets(dp, mb, doc_id.shape[0]), 64)
            want = _reference_blocks(plan.rows, SHAPE.seq_len, 64, s.doc_budgets.budgets[dp][mb])
            assert got.shape == (SHAPE.rows, SHAPE.seq_len // 64)
            assert got.tolist() == np.asarray(want, dtype=np.float32).tolist()
            seen |= set(s.doc_budgets.budgets[dp][mb])
    assert len(seen) > 1  # documents of one micro-batch took different budgets


def test_simulated_per_document_variant_is_no_slower_at_betazeros_recall():
    cluster = Cluster(dp=2, pp=2, microbatches=4, seq_len=16384)
    dst = DSTConfig(anchor="recall", per_document=True)
    rep, _ = simulate(cluster, Scenario(flavor="0.5b", steps=2, dst=dst))
    v = rep["variants"]
    assert set(v) == {"baseline", "sab", "dst", "sab_dst", "sab_dst_doc"}
    assert v["sab_dst_doc"]["step_time_s"] <= v["sab_dst"]["step_time_s"] * (1 + 1e-12)
    assert v["sab_dst_doc"]["mean_recall_proxy"] >= v["sab"]["mean_recall_proxy"] - 1e-9


def test_config_refuses_a_long_floor_above_beta_max():
    with pytest.raises(ValueError, match="long_floor"):
        DSTConfig(beta_max=0.9, long_floor=0.95)


def test_a_prepared_allocator_answers_each_target_as_a_fresh_one():
    """The step's search asks one DocAllocator for several targets, in any order."""
    rng = np.random.default_rng(0)
    grid = np.linspace(0.5, 1.0, 11)
    lengths = rng.integers(100, 20000, 12)
    seconds = np.maximum.accumulate(rng.random((12, 11)) * lengths[:, None] ** 2, axis=1)
    recall = np.maximum.accumulate(rng.random((12, 11)), axis=1)
    cfg = DocBudgetConfig(grid=tuple(grid), beta_min=0.5, long_tokens=16384, long_floor=0.7)
    prepared = DocAllocator(grid, seconds, recall, lengths, cfg)
    full = float(seconds[:, -1].sum())
    for share in (0.9, 0.6, 0.95, 0.6, 0.75):
        fresh = DocAllocator(grid, seconds, recall, lengths, cfg)(share * full)
        got = prepared(share * full)
        assert got.betas.tolist() == fresh.betas.tolist() and got.recall == fresh.recall
