"""The kernels' work plans (`plan_dkdv`, `query_order`) against brute-force checks, and
the balance they buy on a real selection table (bench/kernel_balance.py's work model).
Plain torch on the CPU: the plans are host-side tensor code, no kernel runs here."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import REPO
from sb_titan_kernels.attn_bwd_dkdv import plan_dkdv
from sb_titan_kernels.attn_common import query_order
from sb_titan_kernels.attn_tiles import attn_tiles

from sb_titan.attention.selection import counts_to_ptr, full_block_table

_spec = importlib.util.spec_from_file_location("kernel_balance", REPO / "bench/kernel_balance.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def check_plan(q_ptr: torch.Tensor, nnz: int) -> None:
    """Every invariant of a dK/dV plan, item by item in plain Python."""
    plan = plan_dkdv(q_ptr, nnz)
    ptr = q_ptr.flatten(0, -2).tolist()  # per (b, h): NB + 1 offsets
    starts = [row[j] for row in ptr for j in range(len(row) - 1)]
    ends = [row[j + 1] for row in ptr for j in range(len(row) - 1)]
    tiles = len(starts)
    cap = max(1, -(-nnz // tiles))
    assert plan.cap == cap

    items = plan.items.tolist()
    work = [hi - lo for _, lo, hi, _ in items]
    assert work == sorted(work, reverse=True), "items are launched heaviest first"
    assert all(0 <= w <= cap for w in work)
    by_tile: dict[int, list[tuple[int, int, int]]] = {}
    for tile, lo, hi, slot in items:
        by_tile.setdefault(tile, []).append((lo, hi, slot))
    assert sorted(by_tile) == list(range(tiles)), "every key block has an item"

    splits = {}
    slots_seen = []
    for t in range(tiles):
        pieces = by_tile[t]
        assert len(pieces) == max(1, -(-(ends[t] - starts[t]) // cap))
        if len(pieces) == 1:
            ((lo, hi, slot),) = pieces
            assert (lo, hi, slot) == (starts[t], ends[t], -1)
            continue
        pieces.sort(key=lambda x: x[2])  # piece order = slot order
        slots = [s for _, _, s in pieces]
        assert slots == list(range(slots[0], slots[0] + len(slots))), "contiguous slots"
        bounds = [starts[t]] + [hi for _, hi, _ in pieces]
        assert [lo for lo, _, _ in pieces] == bounds[:-1], "pieces tile the column in order"
        assert bounds[-1] == ends[t]
        splits[t] = (slots[0], len(slots))
        slots_seen += slots
    assert sorted(slots_seen) == list(range(plan.num_partials)), "each partial slot once"
    rows = plan.splits.tolist()
    assert [r[0] for r in rows] == sorted(splits)
    assert {r[0]: (r[1], r[2]) for r in rows} == splits


@pytest.mark.parametrize("seed", range(6))
def test_plan_dkdv_on_random_tables(seed):
    gen = torch.Generator().manual_seed(seed)
    B, H, nb = 2, 3, 1 + seed * 7
    count = torch.randint(0, 6, (B, H, nb), generator=gen)
    count[torch.rand(B, H, nb, generator=gen) < 0.3] = 0  # empty columns
    heavy = torch.rand(B, H, nb, generator=gen) < 0.1
    count[heavy] = torch.randint(20, 200, (int(heavy.sum()),), generator=gen)
    q_ptr = counts_to_ptr(count)
    check_plan(q_ptr, int(count.sum()))


def test_plan_dkdv_edge_cases():
    check_plan(counts_to_ptr(torch.zeros(1, 1, 5, dtype=torch.long)), 0)  # nothing kept
    check_plan(counts_to_ptr(torch.tensor([[[7]]])), 7)  # one block
    check_plan(counts_to_ptr(torch.tensor([[[100, 0, 0, 0]]])), 100)  # one sink only


@pytest.mark.parametrize("policy", ["topk", "mass"])
@pytest.mark.parametrize("layout", ["one_doc", "packed"])
def test_plan_dkdv_on_real_selections(policy, layout):
    table, _, _ = bench.make_table(4096, 64, 0.2, policy, layout, seed=1)
    check_plan(table.q_ptr, table.q_index.numel())


def test_split_balances_the_sink_at_32k():
    """The issue's bar: L=32K, beta=0.1 topk, one document, Bs=64. Without the split the
    sink's program does ~20x the mean (each query block keeps it); with it <= 2x."""
    table, _, density = bench.make_table(32768, 64, 0.1, "topk", "one_doc")
    assert abs(density - 0.1) < 0.02
    r = bench.balance(table, 32768)
    before, after = r["dkdv_before"], r["dkdv_after"]
    assert before["max"] == 512 and before["max_over_mean"] >= 10
    assert after["max_over_mean"] <= 2.0
    assert after["max"] == r["cap"] == -(-r["kept_pairs"] // before["programs"])
    # the same pairs are computed, only cut differently
    assert after["mean"] * after["programs"] == pytest.approx(r["kept_pairs"])


def test_query_order_is_heaviest_first():
    gen = torch.Generator().manual_seed(0)
    count = torch.randint(0, 9, (2, 3, 11), generator=gen)
    order = query_order(counts_to_ptr(count)).tolist()
    flat = count.flatten().tolist()
    assert order == sorted(range(len(flat)), key=lambda r: (-flat[r], r))
    table, _, _ = bench.make_table(4096, 64, 0.3, "topk", "packed")
    flat = table.kv_count.flatten().tolist()
    assert query_order(table.kv_ptr).tolist() == sorted(range(len(flat)), key=lambda r: -flat[r])


def test_subtile_census_on_a_full_table():
    """One document, L=256, Bs=64, every allowed pair kept: 4 diagonal blocks (mixed under
    the causal mask) and 6 below (interior), whatever the shipped tiles (D=64)."""
    doc_id = torch.zeros(1, 256, dtype=torch.int32)
    table = full_block_table(doc_id, 1, 64)
    census = bench.subtile_census(table, doc_id)
    fwd, dkdv = census["fwd"], census["dkdv"]
    assert fwd["pairs"] == 10 and fwd["interior"] == pytest.approx(0.6)
    assert fwd["masked"] == pytest.approx(0.4) and fwd["dead"] == 0
    # dK/dV: every sub-tile pair of a diagonal block is mixed, none dead
    t = attn_tiles(torch.bfloat16, 64, 64, bench.CENSUS_TABLE).dkdv
    assert dkdv["pairs"] == 10 * (64 // t.block_m) * (64 // t.block_n)
    assert dkdv["interior"] == pytest.approx(0.6)
    # two documents split mid-block: the second block's keys are dead for the first rows
    doc_id[:, 96:] = 1
    census = bench.subtile_census(full_block_table(doc_id, 1, 64), doc_id)
    assert census["dkdv"]["dead"] > 0
    for kind in ("fwd", "dkdv"):
        c = census[kind]
        assert c["live_cut"] == c["mixed_unmasked"] == c["dead_run"] == 0
