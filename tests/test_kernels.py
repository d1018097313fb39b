"""Triton kernels checked without a GPU: numerics under TRITON_INTERPRET=1, and AOT builds.

Both run in child processes. `triton.jit` decides at decoration time whether a kernel is
interpreted, from the environment of the process that first imports the kernel module.
Setting TRITON_INTERPRET at the top of this file would do nothing if another test module
imported the kernels first, and would leak interpreter mode into every test collected
after it (and into the AOT check, whose ASTSource needs real, non-interpreted kernels).
So the numerics child gets TRITON_INTERPRET=1 + SB_TRITON_UPCAST=1 (the interpreter's
bf16 `tl.dot` is wrong), the AOT child gets neither, and both start together so they
overlap on a 2-core machine. Each child prints one JSON document; the parametrized tests
below then pass or fail case by case.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


class Table(NamedTuple):
    kv_ptr: torch.Tensor
    kv_index: torch.Tensor
    q_ptr: torch.Tensor
    q_index: torch.Tensor


def _csr(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force: keep [B, H, rows, cols] bool -> (ptr [B, H, rows + 1], flat ids)."""
    ptr = [0]
    ids: list[int] = []
    for row in keep.flatten(0, 2):
        cols = row.nonzero().flatten().tolist()
        ids += cols
        ptr.append(len(ids))
    flat_ptr = torch.tensor(ptr, dtype=torch.int64)
    B, H, n, _ = keep.shape
    starts = flat_ptr[:-1].view(B, H, n)
    ends = flat_ptr[1:].view(B, H, n)
    return torch.cat([starts, ends[..., -1:]], -1), torch.tensor(ids, dtype=torch.int32)


def build_table(keep: torch.Tensor) -> Table:
    """keep [B, Hkv, NB, NB] bool -> CSR kv table and its transpose."""
    return Table(*_csr(keep), *_csr(keep.transpose(-1, -2)))


def random_keep(B: int, H: int, NB: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """Causal random block pattern, diagonal always kept (as the selection guarantees)."""
    keep = torch.rand(B, H, NB, NB, generator=gen) < density
    return keep.tril(-1) | torch.eye(NB, dtype=torch.bool)


def doc_ids(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]
    ).to(torch.int32)


# ------------------------------------------------------------------ numerics (child side)

# Two rows of L=200: three documents incl. one shorter than a block, and two documents.
DOCS_200 = [[90, 30, 80], [150, 50]]
# GPU only (too slow for the interpreter): L=4096, a 50-token document mid-row.
DOCS_4K = [[1000, 50, 3046], [4096]]
# Many short documents (some shorter than a tile, some starting mid-tile): dead sub-tiles
# are skipped and interior ones unmasked, so every tile class is exercised.
DOCS_SHORT = [[20, 5, 40, 64, 71], [130, 1, 1, 68]]
DOCS = {"200": DOCS_200, "4k": DOCS_4K, "short": DOCS_SHORT, "short1": DOCS_SHORT[:1]}


class AttnCase(NamedTuple):
    dtype: str
    head_dim: int
    block: int
    hq: int
    hkv: int
    table: str  # "random" | "full" | "diag" | "holes" (some query blocks keep nothing)
    strided_q: bool = False
    docs: str = "200"
    # run with both partial-tile masks (SB_TRITON_MASK=doc_id, then bounds), each against
    # the references and against each other (bitwise); else the table's mask only
    both_masks: bool = False


ATTN_CASES: dict[str, AttnCase] = {
    # strided q, GQA 2:1 over two kv heads and two rows; split dK/dV items
    "fp32-d64-bs64-gqa2-random-strided": AttnCase("float32", 64, 64, 4, 2, "random", True),
    # split dK/dV items summed by the reduce kernel at the wide head
    "fp32-d128-bs64-mha-full": AttnCase("float32", 128, 64, 2, 2, "full"),
    "fp32-d64-bs128-gqa2-diag": AttnCase("float32", 64, 128, 4, 2, "diag"),
    "fp32-d64-bs64-mha-holes": AttnCase("float32", 64, 64, 2, 2, "holes"),
    # bf16's casts; dQ's query sub-tiles (64x128 at Bs=128) decoded with GQA
    "bf16-d128-bs128-gqa2-random": AttnCase("bfloat16", 128, 128, 4, 2, "random"),
    "fp16-d64-bs128-mha-full": AttnCase("float16", 64, 128, 2, 2, "full"),
    # a GQA group that is no power of two (the grid's head decode), short documents, a
    # full table (split dK/dV items)
    "fp32-d64-bs64-gqa3-full-short": AttnCase("float32", 64, 64, 3, 1, "full", docs="short"),
}

# Real-GPU extras: Qwen2.5-7B's GQA 7:1, long rows, every shipped (dtype, D, Bs); one
# with both masks (compiled code of each, bitwise equal: the mask is the same tile)
GPU_CASES: dict[str, AttnCase] = {
    f"gpu-{dt}-d{d}-bs{bs}-gqa7-4k": AttnCase(
        full, d, bs, 7, 1, "random", True, "4k", both_masks=(dt, d, bs) == ("bf16", 128, 64)
    )
    for dt, full in (("bf16", "bfloat16"), ("fp16", "float16"))
    for d in (64, 128)
    for bs in (64, 128)
}
# Small cases on CUDA only: the interpreter cases above run their code paths, but
# compiled kernels differ per dtype and shape (fp32 at D=128, Bs=128; GQA 7:1 there)
GPU_CASES |= {
    "bf16-d64-bs64-gqa2-random": AttnCase("bfloat16", 64, 64, 4, 2, "random"),
    "bf16-d128-bs64-mha-random": AttnCase("bfloat16", 128, 64, 2, 2, "random"),
    "fp32-d64-bs64-gqa7-full-short": AttnCase("float32", 64, 64, 7, 1, "full", docs="short"),
    "fp32-d128-bs128-gqa3-random-short": AttnCase(
        "float32", 128, 128, 6, 2, "random", docs="short"
    ),
}

# relative tolerance on max|err| / max|ref|: fp32 is exact up to summation order,
# half types round P and the outputs (bf16 has 8 mantissa bits).
REL_TOL = {"float32": 2e-5, "bfloat16": 2.5e-2, "float16": 4e-3}


#: keys of an _attn_case result that compare the two masks' outputs: must be 0
SAME = " bounds-vs-doc_id"


def _attn_case(name: str, case: AttnCase, device: str = "cpu") -> dict[str, list[float]]:
    """max |err| and max |ref| of out, dQ, dK, dV against the fp64 references; with
    `both_masks` per mask ("out", "out bounds") and between them ("out" + SAME)."""
    import os

    from sb_titan_kernels import (
        attention_dkdv_ref,
        attention_dq_ref,
        block_sparse_attention_ref,
        block_sparse_attention_triton,
    )
    from sb_titan_kernels.attn_tiles import MASK_ENV

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    dtype = getattr(torch, case.dtype)
    doc = doc_ids(DOCS[case.docs])
    (B, L), D = doc.shape, case.head_dim
    NB = math.ceil(L / case.block)
    keep = {
        "random": lambda: random_keep(B, case.hkv, NB, 0.5, gen),
        "full": lambda: torch.ones(B, case.hkv, NB, NB, dtype=torch.bool).tril(),
        "diag": lambda: torch.eye(NB, dtype=torch.bool).expand(B, case.hkv, NB, NB).clone(),
        "holes": lambda: random_keep(B, case.hkv, NB, 0.5, gen) & (torch.arange(NB) != 1)[:, None],
    }[case.table]()
    table = Table(*(t.to(device) for t in build_table(keep)))
    doc = doc.to(device)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    if case.strided_q:  # [B, L, H, D] viewed as [B, H, L, D], as a model's projections give
        q = rand(B, L, case.hq, D).transpose(1, 2).requires_grad_()
    else:
        q = rand(B, case.hq, L, D).requires_grad_()
    k, v = rand(B, case.hkv, L, D).requires_grad_(), rand(B, case.hkv, L, D).requires_grad_()
    dout = rand(B, case.hq, L, D)

    runs = {}
    for mask in ("doc_id", "bounds") if case.both_masks else ("auto",):
        os.environ[MASK_ENV] = mask
        try:
            out = block_sparse_attention_triton(q, k, v, doc, table)
            runs[mask] = (out, *torch.autograd.grad(out, (q, k, v), dout))
        finally:
            del os.environ[MASK_ENV]
    # each kernel family against its own naive reference (written out, not autograd)
    ref = block_sparse_attention_ref(q, k, v, doc, table)
    ref_grads = (
        attention_dq_ref(dout, q, k, v, doc, table),
        *attention_dkdv_ref(dout, q, k, v, doc, table),
    )
    result = {}
    for mask, got_all in runs.items():
        suffix = " bounds" if mask == "bounds" else ""
        pairs = zip(("out", "dq", "dk", "dv"), got_all, (ref, *ref_grads), strict=True)
        for what, got, want in pairs:
            got, want = got.double(), want.double()
            finite = bool(torch.isfinite(got).all())
            err = (got - want).abs().max().item() if finite else math.inf
            result[what + suffix] = [err, want.abs().max().item()]
    if case.both_masks:
        pairs = zip(("out", "dq", "dk", "dv"), runs["doc_id"], runs["bounds"], strict=True)
        for what, a, b in pairs:
            same = torch.equal(a, b) and bool(torch.isfinite(a).all())
            result[what + SAME] = [0.0 if same else math.inf, 1.0]
    return result


def _estimator_case(
    dtype: str,
    head_dim: int,
    lengths: list[list[int]],
    block: int,
    hq: int,
    hkv: int,
    end_to_end: bool = True,
    device: str = "cpu",
) -> dict:
    from sb_titan_kernels import estimator as est
    from sb_titan_kernels import estimator_naive as naive

    gen = torch.Generator().manual_seed(7)
    doc = doc_ids(lengths).to(device)
    B, L = doc.shape
    NB = math.ceil(L / block)
    dt = getattr(torch, dtype)
    q = (3 * torch.randn(B, hq, L, head_dim, generator=gen)).to(device=device, dtype=dt)
    k = (3 * torch.randn(B, hkv, L, head_dim, generator=gen)).to(device=device, dtype=dt)
    qp, kp = est.pool_blocks_triton(q, k, block)
    qp_ref, kp_ref = naive.pool_blocks_ref(q, k, block)
    result = {
        "qp": [(qp - qp_ref).abs().max().item(), 1.0],
        "kp": [(kp - kp_ref).abs().max().item(), 1.0],
    }
    for i0, i1 in ((0, NB), (NB // 2, NB), (1, 2)):
        got = est.block_probs_triton(qp, kp, doc, block, i0, i1, dtype=q.dtype)
        want = naive.block_probs_ref(qp_ref, kp_ref, doc, block, i0, i1)
        err = (got - want).abs().max().item() if bool(torch.isfinite(got).all()) else math.inf
        result[f"prob[{i0}:{i1}]"] = [err, 1.0]
    if end_to_end:
        got = est.estimate_block_mass_triton(q, k, doc, block)
        err = (got - naive.estimate_block_mass_ref(q, k, doc, block)).abs().max().item()
        result["end-to-end"] = [err, 1.0]
    return result


EST_CASES: dict[str, Callable[[str], dict]] = {
    "est-bf16-d64-bs64-L200-gqa2": lambda dev: _estimator_case(
        "bfloat16", 64, DOCS_200, 64, 4, 2, device=dev
    ),
    # NB=70 spans several query tiles and key chunks; documents start mid-block
    "est-fp32-d128-bs64-L4480-gqa2": lambda dev: _estimator_case(
        "float32", 128, [[1000, 33, 3447]], 64, 2, 1, end_to_end=False, device=dev
    ),
    "est-fp16-d64-bs128-L200-mha": lambda dev: _estimator_case(
        "float16", 64, DOCS_200, 128, 2, 2, device=dev
    ),
}


def _tiles_used(table: str, d: int, bs: int) -> set[tuple]:
    """(kernel, D, Bs, BLOCK_M, BLOCK_N) of the tiled kernels at one shape: what the
    interpreter's result depends on (warps and stages do not reach it)."""
    from sb_titan_kernels.attn_tiles import TILE_TABLES

    tiles = TILE_TABLES[table][(d, bs)]
    kinds = zip(("fwd", "dq", "dkdv"), (tiles.fwd, tiles.dq, tiles.dkdv), strict=True)
    return {(k, d, bs, t.block_m, t.block_n) for k, t in kinds}


def _tile_table_case(d: int, bs: int) -> AttnCase:
    """One small fp32 case: one head (GQA runs in ATTN_CASES), random table, one row of
    short documents (L=200: partial tiles, document edges inside tiles, padding past L)."""
    return AttnCase("float32", d, bs, 1, 1, "random", docs="short1", both_masks=True)


def _tile_table_cases() -> dict[str, dict]:
    """Every tile table (SB_TRITON_TILES), at each (D, Bs) where it has a tile the runs
    so far have not, with both masks (`_tile_table_case`)."""
    import os

    from sb_titan_kernels.attn_tiles import TILE_TABLES, TILES_ENV

    out, covered = {}, set()
    for table, by_shape in TILE_TABLES.items():
        for d, bs in by_shape:
            used = _tiles_used(table, d, bs)
            if used <= covered:
                continue
            name = f"tiles-{table}-fp32-d{d}-bs{bs}-mha-random-short1"
            os.environ[TILES_ENV] = table
            try:
                result = _attn_case(name, _tile_table_case(d, bs))
            finally:
                del os.environ[TILES_ENV]
            covered |= used
            out[name] = {"errors": result, "tiles": sorted(used), "shape": [d, bs]}
    return out


def _child_numerics() -> dict:
    torch.set_num_threads(1)
    out = {name: _attn_case(name, case) for name, case in ATTN_CASES.items()}
    out.update({name: fn("cpu") for name, fn in EST_CASES.items()})
    out["tile_tables"] = _tile_table_cases()
    return out


def _child_gpu() -> dict:
    """Same checks on CUDA with compiled kernels (no interpreter, no upcast) + GPU_CASES."""
    cases = {**ATTN_CASES, **GPU_CASES}
    out = {name: _attn_case(name, case, "cuda") for name, case in cases.items()}
    out.update({name: fn("cuda") for name, fn in EST_CASES.items()})
    return out


LIVE_AOT = ("bf16", 128, 128, "sm_90a")
"""(dtype, head_dim, block size, arch) compiled live: every kernel of every table that
runs on Hopper (the users' GPUs) once, at the widest head (the most registers). A
kernel change shows in every config and arch, so one config per kernel and table finds
a stale report; a table whose tiles or masks changed since the report shows in the
plain test of every committed report, which holds every shipped config (232, checked
below against every rule and the tables). Compiling all of them from a cold cache, as
on a fresh CI machine, took 208 CPU s."""


def _child_aot() -> dict:
    import triton
    from sb_titan_kernels import aot

    # `ptxas -v` spill counts are left to bench/kernels_report.py; here LOCAL and STACK
    # from cuobjdump (0 and 0 means no spills) keep the warm run at a few seconds.
    tool = aot.cuobjdump_path()
    jobs = [
        (spec, arch)
        for arch in aot.ARCHS
        for i, table in enumerate(aot.arch_tables(arch))
        for spec in aot.shipped_specs(table, estimator=i == 0)
        if (spec.dtype, spec.head_dim, spec.block_size, arch) == LIVE_AOT
    ]
    rows = [aot.report(spec, arch, tool, spills=False).as_dict() for spec, arch in jobs]
    return {"cuobjdump": tool, "triton": triton.__version__, "rows": rows}


# ------------------------------------------------------------------ parent side


def _start_child(mode: str, env: dict[str, str]) -> subprocess.Popen:
    from conftest import start_kernel_child  # not at the top: a child runs this file bare

    return start_kernel_child(__file__, mode, env)


def _collect(proc: subprocess.Popen) -> dict:
    from conftest import collect_kernel_child

    return collect_kernel_child(proc)


@pytest.fixture(scope="module")
def children() -> dict[str, subprocess.Popen]:
    procs = {
        "numerics": _start_child("numerics", {"TRITON_INTERPRET": "1", "SB_TRITON_UPCAST": "1"}),
        "aot": _start_child("aot", {}),
    }
    yield procs
    from conftest import stop_kernel_children

    stop_kernel_children(procs)


@pytest.fixture(scope="module")
def numerics(children) -> dict:
    return _collect(children["numerics"])


@pytest.fixture(scope="module")
def aot_rows(children) -> dict:
    return _collect(children["aot"])


@pytest.fixture(scope="module")
def gpu_numerics() -> dict:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the interpreter checks above run everywhere)")
    return _collect(_start_child("gpu", {}))


def _check_attn(results: dict, name: str, case: AttnCase) -> None:
    for what, (err, scale) in results[name].items():
        tol = 0.0 if what.endswith(SAME) else REL_TOL[case.dtype]
        assert err <= tol * max(scale, 1.0), f"{name} {what}: err {err:.3g} scale {scale:.3g}"
    if case.both_masks:  # both masks ran, each checked, and their results compared
        assert {"dv bounds", "dv" + SAME} <= set(results[name]), sorted(results[name])


def _check_est(results: dict, name: str) -> None:
    for what, (err, _) in results[name].items():
        assert err <= 1e-5, f"{name} {what}: err {err:.3g}"


@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_attention_matches_reference(numerics: dict, name: str) -> None:
    _check_attn(numerics, name, ATTN_CASES[name])


@pytest.mark.parametrize("name", list(EST_CASES))
def test_estimator_matches_reference(numerics: dict, name: str) -> None:
    _check_est(numerics, name)


def test_every_tile_table_matches_reference(numerics: dict) -> None:
    """The interpreter runs every (BLOCK_M, BLOCK_N) of every tile table at its shape
    with both masks (document ids and document bounds), one small case per table and
    shape where they differ; each against the references like ATTN_CASES, and the two
    masks' results bitwise equal. (ATTN_CASES run the default table's shipped masks.)"""
    from sb_titan_kernels.attn_tiles import TILE_TABLES

    runs = numerics["tile_tables"]
    want = {
        (k, d, bs, t.block_m, t.block_n)
        for by_shape in TILE_TABLES.values()
        for (d, bs), tiles in by_shape.items()
        for k, t in zip(("fwd", "dq", "dkdv"), (tiles.fwd, tiles.dq, tiles.dkdv), strict=True)
    }
    got = {tuple(t) for run in runs.values() for t in run["tiles"]}
    assert want <= got, f"tiles no interpreter case ran: {sorted(want - got)}"
    assert len(TILE_TABLES) >= 3 and runs  # sm_80, sm_90a, common: some differ
    for name, run in runs.items():
        d, bs = run["shape"]
        _check_attn({name: run["errors"]}, name, _tile_table_case(d, bs))


@pytest.mark.parametrize("name", [*ATTN_CASES, *GPU_CASES, *EST_CASES])
def test_on_gpu(gpu_numerics: dict, name: str) -> None:
    if name in EST_CASES:
        _check_est(gpu_numerics, name)
    else:
        _check_attn(gpu_numerics, name, {**ATTN_CASES, **GPU_CASES}[name])


DOT_KERNELS = {"fwd", "bwd_dq", "bwd_dkdv", "est_probs"}
ARCHS = ("sm_80", "sm_90a")


def _label(r: dict) -> str:
    tile = f"{r['block_m']}x{r['block_n']} w{r['num_warps']} s{r['num_stages']}"
    return f"{r['kernel']} {r['dtype']} D={r['head_dim']} Bs={r['block_size']} {r['arch']} {tile}"


def _rule_breaks(rows: list[dict]) -> list[str]:
    """What a compiled config must not do: exceed the arch's shared memory, spill,
    use more than 255 registers, issue an MMA twice per iteration, fail to compile, or
    fall back from the MMA its table promises; nor may a report hold a tile its table
    no longer has."""
    out = [
        f"{_label(r)}: shared memory over the limit"
        for r in rows
        if r["shared"] > r["shared_limit"]
    ]
    out += [f"{_label(r)}: spills" for r in rows if not (r["local"] == 0 and r["stack"] == 0)]
    out += [f"{_label(r)}: {r['regs']} registers" for r in rows if not 0 < r["regs"] <= 255]
    # every dot kernel's tensor-core work per loop iteration, read from its PTX, equals
    # what the tile needs: no MMA issued twice by warps that share a tile
    out += [f"{_label(r)}: mma ratio {r['mma_ratio']}" for r in rows
            if (r["mma_ratio"] is None) != (r["kernel"] not in DOT_KERNELS)
            or r["mma_ratio"] not in (None, 1.0)]  # fmt: skip
    out += [f"{_label(r)}: not ok" for r in rows if not r["ok"]]
    return out + _stale_tiles(rows) + _mma_fallbacks(rows)


def _key(row: dict) -> tuple:
    return tuple(row[k] for k in ("kernel", "dtype", "head_dim", "block_size", "arch", "table"))


_COMPILED = ("block_m", "block_n", "num_warps", "num_stages", "regs", "shared", "local", "stack")
_COMPILED += ("mma_count", "mask", "ok")


def test_aot_compiles_the_tables_as_the_committed_report_says(aot_rows: dict) -> None:
    """The live compile (LIVE_AOT's configs) keeps every rule, and with the Triton a
    committed report was made with, reproduces that report's rows exactly: code that
    changed since the report was made shows here."""
    rows = aot_rows["rows"]
    kernels = {"fwd", "bwd_preprocess", "bwd_dq", "bwd_dkdv", "bwd_dkdv_reduce"}
    kernels |= {"est_pool", "est_probs"}
    assert {r["kernel"] for r in rows} == kernels
    live = {(r["dtype"], r["head_dim"], r["block_size"], r["arch"]) for r in rows}
    assert live == {LIVE_AOT}
    # the arch's own tile table, and the common one where it differs
    assert {r["table"] for r in rows} >= {"sm_90a", "common"}
    # 5 attention kernels per table, the estimator's 2 once
    tables = len({r["table"] for r in rows if r["table"]})
    assert len(rows) == 5 * tables + 2
    assert aot_rows["cuobjdump"], "no cuobjdump: only shared memory could be checked"
    assert not _rule_breaks(rows), _rule_breaks(rows)
    made_with = {p: json.loads(p.read_text())["setup"]["triton"] for p in REPORTS}
    same_triton = [p for p, version in made_with.items() if version == aot_rows["triton"]]
    if not same_triton:
        pytest.skip(f"no committed report was made with Triton {aot_rows['triton']}")
    committed = {_key(r): r for r in json.loads(same_triton[0].read_text())["rows"]}
    changed = [
        f"{_label(r)} {k}: {committed[_key(r)][k]} in {same_triton[0].name}, {r[k]} now"
        for r in rows
        for k in _COMPILED
        if committed[_key(r)].get(k) != r[k]
    ]
    assert not changed, changed


REPORTS = sorted((ROOT / "bench" / "results").glob("kernels_report*.json"))
_FIELDS = {"fwd": "fwd", "bwd_dq": "dq", "bwd_dkdv": "dkdv"}  # report kernel -> AttnTiles


def _stale_tiles(rows: list[dict]) -> list[str]:
    """Rows of a tiled attention kernel whose tile is not its table's now (a report
    older than the table), on every arch and table."""
    from sb_titan_kernels.attn_tiles import TILE_TABLES

    bad = []
    for r in (r for r in rows if r["kernel"] in _FIELDS):
        t = getattr(TILE_TABLES[r["table"]][(r["head_dim"], r["block_size"])], _FIELDS[r["kernel"]])
        if (r["block_m"], r["block_n"], r["num_warps"], r["num_stages"]) != tuple(t):
            bad.append(f"{r['table']} {_label(r)}: the table now has {tuple(t)}")
    return bad


def _mma_fallbacks(rows: list[dict]) -> list[str]:
    """sm_90a rows of each table that makes a promise there (attn_tiles.SM90A_MMA_SYNC)
    whose MMA instruction is not the promised one: wgmma, except the configs that table
    runs on mma.sync on purpose; and a promising table without rows."""
    from sb_titan_kernels.attn_tiles import SM90A_MMA_SYNC

    bad = []
    for table, mma_sync in SM90A_MMA_SYNC.items():
        mine = [r for r in rows if r["arch"] == "sm_90a" and r["table"] == table]
        if not mine:
            bad.append(f"no sm_90a rows of the {table} table")
        for r in (r for r in mine if r["kernel"] in _FIELDS):
            key = (_FIELDS[r["kernel"]], r["head_dim"], r["block_size"])
            promised = "mma.sync" if key in mma_sync else "wgmma"
            if r["mma_instr"] != promised:
                bad.append(f"{table} {_label(r)}: {r['mma_instr']}, the table promises {promised}")
    return bad


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: p.name)
def test_committed_report_keeps_every_rule(path: Path) -> None:
    """Every committed kernel report (one per Triton version) holds every shipped config
    of every table and arch, compiled as the tables are now: no spill, shared memory
    within the arch, no duplicated MMA, and the MMA each sm_90a table promises; every
    tiled attention row with the mask its table ships."""
    from sb_titan_kernels.attn_tiles import table_mask

    report = json.loads(path.read_text())
    shipped = [r for r in report["rows"] if r["kernel"] != "block_max"]  # its own test's
    kinds = {(r["arch"], r["table"]) for r in shipped if r["table"]}
    assert len(shipped) == (5 * len(kinds) + 2 * len(ARCHS)) * 2 * 2 * 2
    assert not _rule_breaks(shipped), (report["setup"]["triton"], _rule_breaks(shipped))
    rows = [r for r in shipped if r["kernel"] in _FIELDS]
    stale = [
        f"{_label(r)} {r.get('mask')}"
        for r in rows
        if r.get("mask")
        != table_mask(r["table"], _FIELDS[r["kernel"]], r["head_dim"], r["block_size"])
    ]
    assert rows and not stale, stale


def _kernels_report():
    """bench/kernels_report.py as a module (its pick rules)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kr", ROOT / "bench" / "kernels_report.py")
    kr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kr)
    return kr


def test_bounds_mask_ships_where_it_costs_nothing() -> None:
    """The mask rule on hand-made compiles (bounds vs doc-id of one config): fewer CTAs
    per SM, more spill bytes, another MMA instruction or a failure cost; more CTAs or
    an equal spill do not. Then attn_tiles.DOC_ID_MASK is exactly what the rule derives
    from the committed --masks runs of both Tritons."""
    from sb_titan_kernels.attn_tiles import DOC_ID_MASK

    kr = _kernels_report()
    base = {"ok": True, "stack": 0, "local": 0, "mma_instr": "wgmma", "occupancy": {"ctas": 2}}
    spills = {**base, "stack": 8, "ok": False}
    assert not kr.bounds_costs(base, base)
    assert not kr.bounds_costs({**base, "occupancy": {"ctas": 3}}, base)
    assert not kr.bounds_costs(spills, spills)
    assert kr.bounds_costs({**base, "occupancy": {"ctas": 1}}, base)
    assert kr.bounds_costs(spills, base)
    assert kr.bounds_costs({**spills, "stack": 16}, spills)
    assert kr.bounds_costs({**base, "mma_instr": "mma.sync"}, base)
    assert kr.bounds_costs({**base, "ok": False}, base)  # e.g. shared memory over the limit
    paths = sorted((ROOT / "bench" / "results").glob("kernels_masks*.json"))
    assert len(paths) == 2, paths  # our Triton and the GPU machine's
    reports = [json.loads(p.read_text())["rows"] for p in paths]
    assert kr.doc_id_configs(*reports) == DOC_ID_MASK


def test_sm90a_tables_promise_what_their_tiles_can_issue() -> None:
    """Where an sm_90a table promises wgmma its tile gives each warp group 64 resident
    rows (wgmma's M; any other tile runs mma.sync or repeats MMAs), and where it
    promises mma.sync it does not: the sm_90a table promises wgmma everywhere, and the
    mma.sync alternative differs from it exactly in its mma.sync tiles."""
    from sb_titan_kernels.attn_tiles import SM90A_MMA_SYNC, TILE_TABLES

    kr = _kernels_report()
    assert SM90A_MMA_SYNC["sm_90a"] == frozenset()
    for table, mma_sync in SM90A_MMA_SYNC.items():
        for (d, bs), tiles in TILE_TABLES[table].items():
            for kernel, field in _FIELDS.items():
                t = getattr(tiles, field)
                assert kr.wgmma_shaped(kernel, t) == ((field, d, bs) not in mma_sync), (
                    table,
                    field,
                    d,
                    bs,
                    t,
                )
    differ = {
        (field, d, bs)
        for (d, bs), tiles in TILE_TABLES["sm_90a"].items()
        for field in _FIELDS.values()
        if getattr(tiles, field) != getattr(TILE_TABLES["sm_90a_mma_sync"][(d, bs)], field)
    }
    assert differ == SM90A_MMA_SYNC["sm_90a_mma_sync"] != frozenset()


def _sweep_row(kernel, tile, instr, ctas, ok=True, arch="sm_90a") -> dict:
    return {"kernel": kernel, "head_dim": 64, "block_size": 128, "arch": arch, "ok": ok,
            "source": "cuobjdump", "mma_instr": instr, "occupancy": {"ctas": ctas},
            **tile._asdict()}  # fmt: skip


def test_sm90a_sweep_prefers_wgmma_then_area_then_ctas() -> None:
    """The pick rule on hand-made sweep rows of two Tritons: a tile must pass in both;
    wgmma beats a larger mma.sync tile; at equal shape more CTAs per SM (the fewer of
    the two sweeps') beats more stages."""
    from sb_titan_kernels.common import Tile

    kr = _kernels_report()
    big, small2, small3, spills = (
        Tile(128, 128, 8, 3), Tile(64, 128, 8, 2), Tile(64, 128, 8, 3), Tile(32, 128, 4, 3)
    )  # fmt: skip
    ours = [
        _sweep_row("bwd_dkdv", big, "mma.sync", 1),
        _sweep_row("bwd_dkdv", small2, "wgmma", 2),
        _sweep_row("bwd_dkdv", small3, "wgmma", 2),
        _sweep_row("bwd_dkdv", spills, "wgmma", 1),
    ]
    other = [
        _sweep_row("bwd_dkdv", big, "mma.sync", 1),
        _sweep_row("bwd_dkdv", small2, "wgmma", 2),
        _sweep_row("bwd_dkdv", small3, "wgmma", 1),  # fewer CTAs on the other Triton
        _sweep_row("bwd_dkdv", spills, "wgmma", 1, ok=False),  # spills there
    ]
    ok = kr.passing(ours)[("bwd_dkdv", 64, 128)]
    both = [t for t in ok if t in kr.passing(other)[("bwd_dkdv", 64, 128)]]
    assert spills in ok and spills not in both
    assert kr.pick("bwd_dkdv", 64, 128, both, kr.sm90a_ranks(ours, other)) == small2
    assert kr.pick("bwd_dkdv", 64, 128, both, kr.sm90a_ranks(ours)) == small3  # 2 vs 2 CTAs
    # a joint sweep (both arches) ignores the instruction and the CTAs: the area wins
    joint = ours + [{**r, "arch": "sm_80"} for r in ours]
    assert kr.pick("bwd_dkdv", 64, 128, both, kr.sm90a_ranks(joint)) == big
    # wgmma's M is the resident rows: 64 per warp group (BLOCK_N for dK/dV, BLOCK_M fwd)
    assert kr.wgmma_shaped("bwd_dkdv", small2) and not kr.wgmma_shaped(
        "bwd_dkdv", Tile(128, 64, 8, 3)
    )
    assert kr.wgmma_shaped("fwd", big) and not kr.wgmma_shaped("fwd", small2)


def test_tile_table_by_device_and_setting(monkeypatch) -> None:
    from sb_titan_kernels.attn_tiles import TILES_ENV, attn_tiles, tile_table

    monkeypatch.delenv(TILES_ENV, raising=False)
    assert tile_table(torch.device("cpu")) == "sm_80"
    for name in ("sm_90a", "sm_90a_mma_sync", "common", "sm_80"):
        monkeypatch.setenv(TILES_ENV, name)
        assert tile_table(torch.device("cpu")) == name
    monkeypatch.setenv(TILES_ENV, "sm_90")
    with pytest.raises(ValueError, match="SB_TRITON_TILES='sm_90'"):
        tile_table(torch.device("cpu"))
    # the mask: the table's per config unless SB_TRITON_MASK names one
    from sb_titan_kernels.attn_tiles import DOC_ID_MASK, MASK_ENV, bounds_mask

    table, field, d, bs = next(iter(sorted(DOC_ID_MASK)))
    monkeypatch.delenv(MASK_ENV, raising=False)
    assert not bounds_mask(table, field, d, bs) and bounds_mask(table, field, 128, 128)
    monkeypatch.setenv(MASK_ENV, "bounds")
    assert bounds_mask(table, field, d, bs)
    monkeypatch.setenv(MASK_ENV, "doc_id")
    assert not bounds_mask(table, field, 128, 128)
    monkeypatch.setenv(MASK_ENV, "ids")
    with pytest.raises(ValueError, match="SB_TRITON_MASK='ids'"):
        bounds_mask(table, field, d, bs)
    # the per-arch tables differ where the issue needed them to: dK/dV at D=64
    for bs in (64, 128):
        new = attn_tiles(torch.bfloat16, 64, bs, "sm_90a").dkdv
        assert new != attn_tiles(torch.bfloat16, 64, bs, "common").dkdv


# ------------------------------------------------------------------ plain CPU tests


@pytest.mark.parametrize(
    "arch,regs,warps,shared,want",
    [
        # registers: 128 x 32 = 4096 per warp, 4 warps per 16K sub-partition, 16 per SM
        ("sm_90a", 128, 4, 0, {"ctas": 4, "regs": 4, "warps": 16}),
        # 255 -> 8160, rounded to 8192 per warp: 2 warps per sub-partition, 8 per SM
        ("sm_90a", 255, 8, 0, {"ctas": 1, "regs": 1}),
        # 229 -> 7424 per warp: 2 per sub-partition; 97 KiB + 1 KiB reserved: 2 in 228 KiB
        ("sm_90a", 229, 4, 97 * 1024, {"ctas": 2, "regs": 2, "smem": 2}),
        # 129 KiB + 1: one in 228 KiB, though the registers allow 2
        ("sm_90a", 235, 4, 129 * 1024, {"ctas": 1, "regs": 2, "smem": 1}),
        # A100: 164 KiB per SM; 40 KiB + 1 KiB: 4; 64 registers: 8 warps per sub-partition
        ("sm_80", 64, 4, 40 * 1024, {"ctas": 4, "regs": 8, "smem": 4}),
        # small kernels: the 32 CTA slots or the 64 warps bind
        ("sm_90a", 16, 1, 0, {"ctas": 32, "slots": 32, "warps": 64}),
        ("sm_90a", 32, 4, 0, {"ctas": 16, "warps": 16}),
    ],
)
def test_ctas_per_sm_follows_cuda_occupancy_rules(arch, regs, warps, shared, want) -> None:
    from sb_titan_kernels.aot import ctas_per_sm

    got = ctas_per_sm(arch, regs, shared, warps)
    assert {k: got[k] for k in want} == want


# A hand-written kernel: one mma.sync before any loop, an outer loop around an inner
# one, the inner body with two wgmmas (A from shared, A from registers), and a wgmma
# after the inner loop's back edge that LLVM leaves unlabelled (falls through).
SYNTHETIC_PTX = """
.visible .entry k(
	.param .u64 k_param_0
)
{
	mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%r1}, {%r2}, {%r3}, {%r1};
	@%p0 bra 	$L__BB0_4;
$L__BB0_1:
	mov.b32 	%r9, 0;
$L__BB0_2:
	.loc	1 10 5                          // k.py:10:5
	wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r1,%r2}, %rd1, %rd2, 1, 1, 1, 0, 0;
	.loc	1 11 5                          // k.py:11:5
	wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%r1,%r2}, {%r5,%r6}, %rd2, 1, 1, 1;
	@%p1 bra 	$L__BB0_2;
// %bb.3:
	.loc	1 13 5                          // k.py:13:5
	wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%r1,%r2}, %rd1, %rd2, 1, 1, 1, 0, 0;
	@%p2 bra 	$L__BB0_1;
	bra.uni 	$L__BB0_4;
$L__BB0_4:
	ret;
}
"""


def test_count_mma_reads_loops_from_the_control_flow() -> None:
    from sb_titan_kernels.aot import count_mma

    got = count_mma(SYNTHETIC_PTX, num_warps=8)  # two warpgroups, eight warps
    # outer loop (header first): the m64n16k16 after the inner back edge, twice (2 groups)
    # inner loop: m64n64k16 + m64n32k16, twice; before the loops: m16n8k16 on 8 warps
    assert got.loops == [2 * 64 * 16 * 16, 2 * (64 * 64 * 16 + 64 * 32 * 16)]
    assert got.outside == 8 * 16 * 8 * 16
    dots = {(d["loop"], d["src"], d["instr"], d["count"]) for d in got.dots}
    assert dots == {
        (None, "?", "mma.sync m16n8k16 R", 1),
        (1, "k.py:10", "wgmma m64n64k16 SS", 1),
        (1, "k.py:11", "wgmma m64n32k16 RS", 1),
        (0, "k.py:13", "wgmma m64n16k16 SS", 1),
    }


def test_reference_full_table_is_dense_document_attention() -> None:
    from sb_titan_kernels import block_sparse_attention_ref

    gen = torch.Generator().manual_seed(0)
    doc = doc_ids(DOCS_200)
    q = torch.randn(2, 4, 200, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 200, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    full = build_table(torch.ones(2, 2, 4, 4, dtype=torch.bool).tril())
    mask = (doc[:, :, None] == doc[:, None, :]) & torch.ones(200, 200, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], enable_gqa=True
    )
    torch.testing.assert_close(block_sparse_attention_ref(q, k, v, doc, full), want)


@pytest.mark.parametrize("docs", ["200", "short"])
def test_backward_references_are_the_forward_reference_differentiated(docs: str) -> None:
    """attn_bwd_dq_naive / attn_bwd_dkdv_naive write the gradients out by hand; autograd
    through the forward reference is the independent check (GQA 3:1, query blocks that
    keep nothing, documents shorter than a block)."""
    from sb_titan_kernels import attention_dkdv_ref, attention_dq_ref, block_sparse_attention_ref

    gen = torch.Generator().manual_seed(1)
    doc = doc_ids(DOCS[docs])
    B, L = doc.shape
    NB = math.ceil(L / 64)
    keep = random_keep(B, 2, NB, 0.5, gen) & (torch.arange(NB) != 1)[:, None]
    table = build_table(keep)
    q = torch.randn(B, 6, L, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(B, 2, L, 16, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    dout = torch.randn(B, 6, L, 16, generator=gen, dtype=torch.float64)
    out = block_sparse_attention_ref(q, k, v, doc, table, scale=0.3)
    want = torch.autograd.grad(out, (q, k, v), dout)
    got = (attention_dq_ref(dout, q, k, v, doc, table, 0.3),)
    got += attention_dkdv_ref(dout, q, k, v, doc, table, 0.3)
    for g, w in zip(got, want, strict=True):
        assert g.abs().max() > 0
        torch.testing.assert_close(g, w)


def test_estimator_reference_is_a_distribution_over_allowed_blocks() -> None:
    from sb_titan_kernels.estimator_naive import estimate_block_mass_ref

    doc = doc_ids([[100, 40, 60]])  # blocks of 64: doc 0 = blocks 0-1, doc 1 and 2 share 2
    q, k = torch.randn(1, 2, 200, 16), torch.randn(1, 1, 200, 16)
    prob = estimate_block_mass_ref(q, k, doc, 64)[0, 0]
    torch.testing.assert_close(prob.sum(-1), torch.ones(4))
    # first docs per block 0,0,1,2; last docs 0,1,2,2: block j < i is allowed when it
    # ends in the document block i starts in
    allowed = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool
    )
    assert (prob[~allowed] == 0).all()


if __name__ == "__main__":
    # A child runs as `python tests/test_kernels.py MODE` from a source checkout, maybe
    # with nothing installed (a GPU machine with torch, Triton and numpy only).
    sys.path.insert(0, str(ROOT))
    from sb_titan.util.source_tree import use_source_kernels

    use_source_kernels()
    result = {"numerics": _child_numerics, "aot": _child_aot, "gpu": _child_gpu}[sys.argv[1]]()
    print(json.dumps(result))
