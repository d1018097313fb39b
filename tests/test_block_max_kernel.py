"""The `int4_max` block-max kernel (kernels/block_max.py) against its PyTorch reference.

The kernel takes the integer dot in int32 and the two scale products in the reference's
order, so the two are bitwise equal: compared as int32 bit patterns, not within a
tolerance. As in tests/test_kernels.py (see its docstring for why), the kernel runs in
child processes started together: one under TRITON_INTERPRET=1, one compiling one
shipped config ahead of time for sm_80 and sm_90a (each committed report holds them
all); a third, on CUDA only, runs larger shapes with the compiled kernel. Each child
prints one JSON document.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zlib
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


class Case(NamedTuple):
    docs: list[list[int]]  # document lengths per row (rows sum to the same L)
    hq: int
    hkv: int
    head_dim: int
    block: int
    ranges: tuple[tuple[int, int], ...]  # query-block ranges [start, end) to score
    dtype: str = "float32"


# L = 200 / 300 (not multiples of the block size); documents shorter than a block
# (30, 20, 5, 1), starting mid-block (at 90, 120, 150, 25, ...); GQA 2:1 and 7:1.
CASES: dict[str, Case] = {
    "gqa2-bs64": Case([[90, 30, 80], [150, 50]], 4, 2, 64, 64, ((0, 4), (1, 3), (3, 4))),
    "gqa7-bs128": Case([[20, 5, 140, 100, 35], [130, 1, 1, 168]], 7, 1, 64, 128, ((0, 3), (2, 3))),
    "gqa2-bs128-bf16": Case([[90, 30, 80], [150, 50]], 4, 2, 64, 128, ((0, 2),), "bfloat16"),
    "mha-bs64-one-doc": Case([[200]], 2, 2, 64, 64, ((0, 4),)),
}
# selection end to end: NB = 10, so that ranking (not the forced blocks) decides; GQA 2:1
# (the kernel's 7:1 is checked bitwise above)
SELECTION = Case([[500, 140], [640]], 2, 1, 64, 64, ())
# CUDA only: long rows, every shipped (D, Bs), Qwen2.5-7B's GQA 7:1
GPU_CASES: dict[str, Case] = {
    f"gpu-d{d}-bs{bs}-gqa7-4k": Case([[1000, 50, 3046], [4096]], 28, 4, d, bs, ((0, 4096 // bs),))
    for d in (64, 128)
    for bs in (64, 128)
}


def doc_ids(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]
    ).to(torch.int32)


def _inputs(name: str, case: Case, device: str = "cpu"):
    from sb_titan.attention.estimator import token_doc_start

    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    doc = doc_ids(case.docs)
    (B, L), D = doc.shape, case.head_dim
    dtype = getattr(torch, case.dtype)
    q = 2 * torch.randn(B, case.hq, L, D, generator=gen)
    # a mean per (row, head) that centring removes before quantizing
    k = torch.randn(B, case.hkv, L, D, generator=gen) + torch.randn(
        B, case.hkv, 1, D, generator=gen
    )
    ds = token_doc_start(doc)
    return (q.to(device, dtype), k.to(device, dtype), doc.to(device), ds.to(device))


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _score_case(name: str, case: Case, device: str) -> dict:
    """Mismatching elements (bit patterns) per range, and what the outputs hold."""
    from sb_titan_kernels.block_max import block_max_triton
    from sb_titan_kernels.block_max_naive import block_max_ref, int4_codes

    q, k, _, ds = _inputs(name, case, device)
    codes = int4_codes(q, k)
    out = {}
    for start, end in case.ranges:
        got = block_max_triton(*codes, ds.to(torch.int32), case.block, start, end)
        want = block_max_ref(*codes, ds, case.block, start, end)
        out[f"{start}:{end}"] = {
            "shape_ok": got.shape == want.shape,
            "mismatch": int((_bits(got) != _bits(want)).sum()),
            "finite": int(torch.isfinite(want).sum()),
            "elements": want.numel(),
        }
    return out


def _selection_case(case: Case) -> dict:
    """select_blocks(scorer="int4_max"): the same table from the kernel and from PyTorch;
    with the number of allowed and of forced (sink, diagonal) block pairs."""
    from sb_titan.attention.estimator import sink_blocks
    from sb_titan.attention.selection import select_blocks

    q, k, doc, _ = _inputs("selection", case)
    sink = sink_blocks(doc, case.block)
    i = torch.arange(sink.shape[1])
    out = {
        "allowed": int((i - sink + 1).sum()) * case.hkv,
        "forced": int(torch.where(sink == i, 1, 2).sum()) * case.hkv,
    }
    for policy, budget in (("mass", 0.6), ("topk", 0.4)):
        kw = dict(policy=policy, block_size=case.block, chunk_blocks=3, scorer="int4_max")
        t_tab, t_st = select_blocks(q, k, doc, budget, estimator="triton", **kw)
        r_tab, r_st = select_blocks(q, k, doc, budget, estimator="torch", **kw)
        same = all(torch.equal(a, b) for a, b in zip(t_tab[:4], r_tab[:4], strict=True))
        stats = all(torch.equal(a, b) for a, b in zip(t_st, r_st, strict=True))
        out[policy] = {"table": same, "stats": stats, "kept": int(t_tab.kv_index.numel())}
    return out


def _child_interp() -> dict:
    torch.set_num_threads(1)
    out = {name: _score_case(name, case, "cpu") for name, case in CASES.items()}
    out["selection"] = _selection_case(SELECTION)
    return out


def _child_gpu() -> dict:
    cases = {**CASES, **GPU_CASES}
    return {name: _score_case(name, case, "cuda") for name, case in cases.items()}


ARCHS = ("sm_80", "sm_90a")
# an int8 x int8 -> int32 tensor-core instruction: mma.sync ... .s32.s8.s8.s32 (sm_80),
# wgmma.mma_async ... .s32.s8.s8 (sm_90a)
_S8_MMA = re.compile(r"\b(?:mma|wgmma\.mma_async)\.sync\.aligned\.m\d+n\d+k32\S*\.s32\.s8\.s8")


#: (head_dim, block size) compiled live on each arch: the widest tile (the most registers).
#: A kernel change shows in every config, so one per arch (each its own MMA) finds a
#: stale report; every committed report's rows of all shipped configs keep the rules
#: (test_committed_reports_keep_the_rules).
LIVE_AOT = (128, 128)


def _child_aot() -> dict:
    import triton
    from sb_titan_kernels import aot

    specs = [s for s in aot.block_max_specs() if (s.head_dim, s.block_size) == LIVE_AOT]
    rows = []
    for spec, arch in ((s, a) for s in specs for a in aot.ARCHS):
        row = aot.full_report((arch,), spills=False, specs=[spec])[0].as_dict()
        ptx = aot.compile_spec(spec, arch).asm["ptx"]  # from Triton's cache
        rows.append({**row, "s8_mma": len(_S8_MMA.findall(ptx))})
    return {"cuobjdump": aot.cuobjdump_path(), "triton": triton.__version__, "rows": rows}


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
        "interp": _start_child("interp", {"TRITON_INTERPRET": "1"}),
        "aot": _start_child("aot", {}),
    }
    yield procs
    from conftest import stop_kernel_children

    stop_kernel_children(procs)


@pytest.fixture(scope="module")
def interp(children) -> dict:
    return _collect(children["interp"])


@pytest.fixture(scope="module")
def aot_rows(children) -> dict:
    return _collect(children["aot"])


def _check_bitwise(result: dict) -> None:
    for rng, r in result.items():
        assert r["shape_ok"], rng
        assert r["mismatch"] == 0, f"[{rng}]: {r['mismatch']} of {r['elements']} differ"
        # allowed block pairs are finite, the others -inf: both kinds are compared
        assert 0 < r["finite"] < r["elements"], rng


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_is_bitwise_equal_to_reference(interp: dict, name: str) -> None:
    _check_bitwise(interp[name])


def test_selection_with_the_kernel_keeps_the_same_blocks(interp: dict) -> None:
    sel = interp["selection"]
    for policy in ("mass", "topk"):
        r = sel[policy]
        assert r["table"] and r["stats"], policy
        # the scores decide: more than the forced blocks are kept, fewer than all
        assert sel["forced"] < r["kept"] < sel["allowed"], (policy, r, sel)


def _rule_breaks(rows: list[dict]) -> list[str]:
    """What a compiled block-max config must not do: spill, exceed the arch's shared
    memory or 255 registers, repeat its int8 MMA pass across warps (mma_ratio 1: one
    pass per head and sub-tile), fail; nor may a report hold a tile the table no longer
    has."""
    from sb_titan_kernels.block_max import BLOCK_MAX_CONFIGS

    bad = []
    for r in rows:
        label = f"D={r['head_dim']} Bs={r['block_size']} {r['arch']}"
        tile = (r["block_m"], r["block_n"], r["num_warps"], r["num_stages"])
        checks = {
            "spills": r["local"] == 0 and r["stack"] == 0,
            "shared memory over the limit": r["shared"] <= r["shared_limit"],
            f"{r['regs']} registers": 0 < r["regs"] <= 255,
            f"mma_ratio {r['mma_ratio']}": r["mma_ratio"] == 1.0,
            "not ok": r["ok"],
            f"tile {tile}, the table has another": tile
            == tuple(BLOCK_MAX_CONFIGS[(r["head_dim"], r["block_size"])]),
        }
        bad += [f"{label}: {what}" for what, ok in checks.items() if not ok]
    return bad


def _committed_rows(path: Path) -> list[dict]:
    return [r for r in json.loads(path.read_text())["rows"] if r["kernel"] == "block_max"]


REPORTS = sorted((ROOT / "bench" / "results").glob("kernels_report*.json"))
_COMPILED = ("block_m", "block_n", "num_warps", "num_stages", "regs", "shared", "local")
_COMPILED += ("stack", "mma_count", "mma_instr", "ok")


def test_aot_compiles_as_the_committed_report_says(aot_rows: dict) -> None:
    """The live compile (LIVE_AOT on each arch) keeps every rule, issues an int8
    tensor-core MMA, and with the Triton a committed report was made with reproduces
    that report's rows: kernel code changed since the report shows here."""
    rows = aot_rows["rows"]
    assert aot_rows["cuobjdump"], "no cuobjdump: only shared memory could be checked"
    assert sorted(r["arch"] for r in rows) == sorted(ARCHS)
    assert {(r["head_dim"], r["block_size"]) for r in rows} == {LIVE_AOT}
    assert not _rule_breaks(rows), _rule_breaks(rows)
    for r in rows:
        assert r["s8_mma"] > 0, f"{r['arch']}: no int8 tensor-core instruction in the PTX"
    made_with = {p: json.loads(p.read_text())["setup"]["triton"] for p in REPORTS}
    same_triton = [p for p, version in made_with.items() if version == aot_rows["triton"]]
    if not same_triton:
        pytest.skip(f"no committed report was made with Triton {aot_rows['triton']}")
    committed = {r["arch"]: r for r in _committed_rows(same_triton[0])
                 if (r["head_dim"], r["block_size"]) == LIVE_AOT}  # fmt: skip
    changed = [
        f"{r['arch']} {k}: {committed[r['arch']].get(k)} in {same_triton[0].name}, {r[k]} now"
        for r in rows
        for k in _COMPILED
        if committed[r["arch"]].get(k) != r[k]
    ]
    assert not changed, changed


@pytest.mark.parametrize("path", REPORTS, ids=lambda p: p.name)
def test_committed_reports_keep_the_rules(path: Path) -> None:
    """Every committed kernel report holds the block-max kernel at every shipped
    (D, Bs) and arch, with the table's tile and within every rule."""
    from sb_titan_kernels.block_max import BLOCK_MAX_CONFIGS

    rows = _committed_rows(path)
    got = sorted((r["head_dim"], r["block_size"], r["arch"]) for r in rows)
    assert got == sorted((d, bs, arch) for d, bs in BLOCK_MAX_CONFIGS for arch in ARCHS)
    assert not _rule_breaks(rows), _rule_breaks(rows)


@pytest.mark.parametrize("name", [*CASES, *GPU_CASES])
def test_on_gpu(name: str, gpu_results: dict) -> None:
    _check_bitwise(gpu_results[name])


@pytest.fixture(scope="module")
def gpu_results() -> dict:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the interpreter checks above run everywhere)")
    return _collect(_start_child("gpu", {}))


# ------------------------------------------------------------------ plain CPU tests


def test_reference_is_the_definition() -> None:
    """block_max_ref, pair by pair: (Qc . Kc) * qs * ks over the allowed token pairs and
    the G heads, max per block pair, -inf where a block pair has none."""
    from sb_titan_kernels.block_max_naive import block_max_ref, int4_codes

    from sb_titan.attention.estimator import token_doc_start

    gen = torch.Generator().manual_seed(3)
    doc = doc_ids([[13, 3, 24], [40]])  # L = 40, blocks of 16: a partial last block
    ds = token_doc_start(doc)
    q, k = torch.randn(2, 4, 40, 8, generator=gen), torch.randn(2, 2, 40, 8, generator=gen)
    qc, qs, kc, ks = int4_codes(q, k)
    want = torch.full((2, 2, 3, 3), float("-inf"))
    for b in range(2):
        for h in range(2):
            for t in range(40):
                for u in range(int(ds[b, t]), t + 1):
                    for g in range(2):
                        dot = (qc[b, 2 * h + g, t].int() * kc[b, h, u].int()).sum().float()
                        x = dot * qs[b, 2 * h + g, t] * ks[b, h, u]
                        want[b, h, t // 16, u // 16] = torch.maximum(
                            want[b, h, t // 16, u // 16], x
                        )
    got = block_max_ref(qc, qs, kc, ks, ds, 16)
    assert torch.equal(_bits(got), _bits(want))
    # token-chunked (one block per chunk) and a range of query blocks: the same values
    assert torch.equal(
        _bits(block_max_ref(qc, qs, kc, ks, ds, 16, 1, 3, max_scores=1)), _bits(got[:, :, 1:3])
    )


def test_int4_codes() -> None:
    from sb_titan_kernels.block_max_naive import INT4_MAX, int4_codes

    q, k = torch.randn(1, 2, 50, 16), torch.randn(1, 1, 50, 16) + 3.0
    q[0, 0, 7] = 0.0  # a zero token: codes 0, scale 1
    qc, qs, kc, ks = int4_codes(q, k)
    assert qc.dtype == kc.dtype == torch.int8 and qs.shape == (1, 2, 50)
    assert int(qc.abs().max()) == int(kc.abs().max()) == INT4_MAX
    assert (qs > 0).all() and (ks > 0).all() and qs[0, 0, 7] == 1 and (qc[0, 0, 7] == 0).all()
    assert ((qc.float() * qs[..., None] - q).abs() <= qs[..., None] / 2 + 1e-6).all()
    kcent = k - k.mean(dim=2, keepdim=True)  # k is centred first
    assert ((kc.float() * ks[..., None] - kcent).abs() <= ks[..., None] / 2 + 1e-6).all()


if __name__ == "__main__":
    # as in tests/test_kernels.py: a child may run from a bare source checkout
    sys.path.insert(0, str(ROOT))
    from sb_titan.util.source_tree import use_source_kernels

    use_source_kernels()
    result = {"interp": _child_interp, "aot": _child_aot, "gpu": _child_gpu}[sys.argv[1]]()
    print(json.dumps(result))
