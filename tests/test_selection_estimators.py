"""Selection with the Triton estimator (the CUDA path) against the PyTorch estimator.

Both estimators compute the same fp32 softmax over each query block's allowed key
blocks; they differ only in rounding (summation order of the pooling and of the D-term
dot, exp2 with scale·log2 e folded in). So on the same inputs:

- block masses agree within MASS_TOL_ABS (see docs/kernels.md for why that bound);
- block tables agree except at near-ties, rows where the Triton table is what the
  PyTorch rule would pick after moving each mass by at most delta, the largest mass
  difference measured on that input. `near_tie_reason` checks the two conditions this
  needs (an order tie at the cut, and for `mass` a cumulative sum within reach of beta);
  a row that fails either is a real disagreement and fails the test.

The Triton side runs in a child process under TRITON_INTERPRET=1 (see test_kernels.py
for why a child) on the CPU; the `gpu` child repeats it with compiled kernels on CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from sb_titan.attention.backends import ESTIMATORS
from sb_titan.attention.estimator import block_mass_chunks, sink_blocks
from sb_titan.attention.selection import MASS_TOL, POLICIES, _select_chunk, select_blocks

ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 600
MASS_TOL_ABS = 1e-5  # |prob_triton - prob_torch| per block pair (docs/kernels.md)
# near-ties must stay rare: mismatching rows / rows, per case; the twin cases are built
# to tie, so there only the explanation is checked (with a loose bound)
MAX_MISMATCH_RATE = {False: 0.02, True: 0.25}
EPS32 = float(torch.finfo(torch.float32).eps)


class SelCase(NamedTuple):
    docs: list[list[int]]  # document lengths per row (rows sum to the same L)
    hq: int
    hkv: int
    block: int
    dtype: str
    chunk: int  # chunk_blocks: several chunks, starts not aligned to the kernel's tiles
    budget: list[float]  # per row
    twins: bool = False  # near-duplicate key blocks: masses equal up to rounding


# GQA 7:1 (2:1 over two kv heads in bf16), several documents (one shorter than a block,
# starts mid-block), L not a multiple of the block size, both block sizes; each case
# runs both policies. The twin cases put near-duplicate key blocks inside one long
# document, so that rounding does reorder some of them and the near-tie rule meets
# real mismatches.
L700 = [[300, 17, 250, 133], [64, 64, 450, 122]]
L1500 = [[1400, 37, 63]]
SEL_CASES: dict[str, SelCase] = {
    "bs64-gqa7-fp32": SelCase(L700, 7, 1, 64, "float32", 4, [0.35, 0.8]),
    "bs128-gqa2-bf16": SelCase(L700, 4, 2, 128, "bfloat16", 3, [0.5, 0.6]),
    "bs64-gqa7-fp32-twins": SelCase(L1500, 7, 1, 64, "float32", 5, [0.5], True),
    "bs128-gqa7-fp32-twins": SelCase(L1500, 7, 1, 128, "float32", 4, [0.7], True),
}
# GPU only (too slow for the interpreter): 8K rows, bf16, many documents.
GPU_CASES: dict[str, SelCase] = {
    f"gpu-bs{bs}-gqa7-8k": SelCase(
        [[3000, 50, 2000, 3142], [8192]], 28, 4, bs, "bfloat16", 16, [0.3, 0.7], True
    )
    for bs in (64, 128)
}


def doc_ids(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]
    ).to(torch.int32)


def make_inputs(case: SelCase, seed: int, device: str) -> tuple[torch.Tensor, ...]:
    """q/k with a low-frequency component shared by each GQA group, so block masses are
    far from uniform (as with real attention); `twins` copies key block 2m+1 onto 2m+2
    with a 3e-7 relative nudge (a few ulps), so their masses tie up to rounding."""
    gen = torch.Generator().manual_seed(seed)
    doc = doc_ids(case.docs)
    (B, L), D, G = doc.shape, 64, case.hq // case.hkv
    seg = torch.arange(L) // 24  # segments straddle block boundaries
    n = int(seg[-1]) + 1
    shared_q = torch.randn(B, case.hkv, 1, n, D, generator=gen).expand(-1, -1, G, -1, -1)
    q = 3 * shared_q.reshape(B, case.hq, n, D)[:, :, seg] + torch.randn(
        B, case.hq, L, D, generator=gen
    )
    k = 3 * torch.randn(B, case.hkv, n, D, generator=gen)[:, :, seg]
    k = k + torch.randn(B, case.hkv, L, D, generator=gen)
    if case.twins:
        bs = case.block
        for src in range(1, L // bs - 1, 2):
            nudge = 1 + 3e-7 * torch.randn(B, case.hkv, bs, D, generator=gen)
            k[:, :, (src + 1) * bs : (src + 2) * bs] = k[:, :, src * bs : (src + 1) * bs] * nudge
    dt = getattr(torch, case.dtype)
    return q.to(device, dt), k.to(device, dt), doc.to(device)


def torch_rank(p: torch.Tensor, sink: int, i: int) -> list[int]:
    """PyTorch selection's order over allowed blocks [sink, i]: forced (sink, diagonal)
    first, then descending mass, ties to the lower id."""
    forced = sorted({sink, i})
    rest = sorted((j for j in range(sink, i + 1) if j not in forced), key=lambda j: (-p[j], j))
    return forced + rest


def near_tie_reason(
    p: torch.Tensor,
    sink: int,
    i: int,
    kept_torch: set[int],
    kept_triton: set[int],
    policy: str,
    beta: float,
    delta: float,
) -> str | None:
    """None if `kept_triton` is a near-tie of `kept_torch`, else why it is not.

    p: fp64 PyTorch masses of query block i. Necessary conditions for kept_triton to be
    PyTorch's pick after moving each mass by at most delta:
    - order: with n = |kept_triton| and T the top-n of PyTorch's order, every block of T
      Triton dropped outweighs every block Triton kept outside T by at most 2·delta;
    - count: `topk` keeps the same number; `mass` keeps a different number only if every
      prefix sum C(m) between the two counts is within m·(delta + 2·eps32) of beta − tol
      (m masses off by delta each, plus each side's fp32 cumsum rounding).
    """
    rank = torch_rank(p, sink, i)
    if not set(rank[: 1 + (sink != i)]) <= kept_triton:
        return "a forced block (sink or diagonal) was dropped"
    if not kept_triton <= set(rank):
        return "a block outside [sink, i] was kept"
    n, c = len(kept_triton), len(kept_torch)
    top = set(rank[:n])
    extra, dropped = kept_triton - top, top - kept_triton
    if extra and max(p[j] for j in dropped) - min(p[j] for j in extra) > 2 * delta:
        return f"order: kept {sorted(extra)} over {sorted(dropped)} beyond 2·delta={2 * delta:.2g}"
    if n != c:
        if policy == "topk":
            return f"topk kept {n} blocks, PyTorch {c}"
        target = beta - MASS_TOL
        for m in range(min(n, c), max(n, c)):
            cum = float(sum(p[j] for j in rank[:m]))
            if abs(cum - target) > m * (delta + 2 * EPS32):
                return f"count {n} vs {c}: prefix sum {cum:.8f} at {m} is not near {target}"
    return None


def mismatches(
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
    p_t: torch.Tensor,
    sink: torch.Tensor,
    start: int,
    budget: list[float],
    policy: str,
    delta: float,
) -> tuple[int, int, list[str]]:
    """Compare (count [B, H, n], ids [B, H, n, w]) of query blocks start.. per estimator:
    (rows, mismatching rows, reasons of those that are not near-ties)."""
    (c_t, i_t), (c_x, i_x) = (tuple(x.cpu() for x in tables[e]) for e in ("torch", "triton"))
    B, H, n = c_t.shape
    bad, reasons = 0, []
    for b in range(B):
        beta = float(torch.tensor(budget[b], dtype=torch.float32))
        for h in range(H):
            for r in range(n):
                kt = set(i_t[b, h, r, : c_t[b, h, r]].tolist())
                kx = set(i_x[b, h, r, : c_x[b, h, r]].tolist())
                if kt == kx:
                    continue
                bad += 1
                i = start + r
                why = near_tie_reason(p_t[b, h, i], int(sink[b, i]), i, kt, kx, policy, beta, delta)
                if why is not None:
                    reasons.append(f"beta {beta:.3f} row {b} head {h} block {i}: {why}")
    return B * H * n, bad, reasons


def compare(case: SelCase, device: str) -> dict:
    """Masses and tables of both estimators on one input; JSON-able summary.

    Tables come from select_blocks end to end at the case's budgets, and, for a sweep of
    budgets, from the selection rule applied to each estimator's chunk masses (cheap:
    no kernel launches), so near-ties get many chances to show up.
    """
    q, k, doc = make_inputs(case, seed=case.block + case.hq, device=device)
    bs, nb = case.block, -(-doc.shape[1] // case.block)
    sink = sink_blocks(doc, bs)
    kw = dict(block_size=bs, scale=0.125, chunk_blocks=case.chunk)
    chunks = {e: list(block_mass_chunks(q, k, doc, sink, estimator=e, **kw)) for e in ESTIMATORS}
    assert [s for s, *_ in chunks["triton"]] == list(range(0, nb, case.chunk))
    p_t, p_x = (torch.cat([p for _, p, _ in chunks[e]], 2).double().cpu() for e in ESTIMATORS)
    allowed = torch.cat([a for *_, a in chunks["torch"]], 2).cpu()
    delta = (p_t - p_x).abs().max().item()
    out = {
        "mass_err": delta,
        "triton_outside_allowed": p_x[~allowed].abs().max().item(),
        "row_sum_err": (p_x.sum(-1) - 1).abs().max().item(),
        # top mass over the uniform 1/n_allowed, mean over query blocks: far from uniform?
        "spread": (p_t.amax(-1) * allowed.sum(-1)).mean().item(),
    }
    for policy in POLICIES:
        res = {}
        for est in ESTIMATORS:
            table, stats = select_blocks(q, k, doc, torch.tensor(case.budget, device=device),
                                         policy=policy, estimator=est, **kw)  # fmt: skip
            res[est] = (*table.padded_kv(), stats)
        rows, bad, why = mismatches(
            {e: res[e][:2] for e in ESTIMATORS}, p_t, sink.cpu(), 0, case.budget, policy, delta
        )
        recall = [res[e][2].recall.cpu() for e in ESTIMATORS]
        out[policy] = {
            "rows": rows,
            "mismatches": bad,
            "unexplained": why,
            "recall_err": (recall[0] - recall[1]).abs().max().item() if not bad else 0.0,
        }
        sweep = {"rows": 0, "mismatches": 0, "unexplained": []}
        for beta in torch.linspace(0.05, 0.95, 19).tolist():
            budget = torch.full(sink.shape, beta, device=device)  # [B, NB]: per query block
            for (start, pt, a), (_, px, _) in zip(chunks["torch"], chunks["triton"], strict=True):
                picked = {e: _select_chunk(p, a, sink, start, budget, policy)[:2]
                          for e, p in (("torch", pt), ("triton", px))}  # fmt: skip
                n, bad, why = mismatches(
                    picked, p_t, sink.cpu(), start, [beta] * q.shape[0], policy, delta
                )
                sweep["rows"] += n
                sweep["mismatches"] += bad
                sweep["unexplained"] += why
        out[f"{policy}-sweep"] = sweep
    return out


def _child(device: str, cases: dict[str, SelCase]) -> dict:
    torch.set_num_threads(1)
    return {name: compare(case, device) for name, case in cases.items()}


# ------------------------------------------------------------------ parent side


def _run_child(mode: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("SB_TRITON_UPCAST", None)  # the estimator's only dot reads fp32 operands
    if mode == "interpret":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, __file__, mode],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
    )
    if proc.returncode != 0:
        pytest.fail(f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return _run_child("interpret")


@pytest.fixture(scope="module")
def on_gpu() -> dict:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the interpreter checks above run everywhere)")
    return _run_child("gpu")


def _check(result: dict, name: str, cases: dict[str, SelCase]) -> None:
    r = result[name]
    assert r["mass_err"] <= MASS_TOL_ABS, f"{name}: masses differ by {r['mass_err']:.3g}"
    assert r["triton_outside_allowed"] == 0, f"{name}: Triton mass outside [sink, i]"
    assert r["row_sum_err"] <= 1e-5, name
    assert r["spread"] > 1.3, f"{name}: masses near uniform, the comparison is too easy"
    for what in ("mass", "topk", "mass-sweep", "topk-sweep"):
        p = r[what]
        assert not p["unexplained"], f"{name} {what}: {p['unexplained'][:5]}"
        rate = MAX_MISMATCH_RATE[cases[name].twins]
        assert p["mismatches"] <= rate * p["rows"], f"{name} {what}: {p}"
    for policy in ("mass", "topk"):  # identical tables: the same kept mass
        assert r[policy]["recall_err"] <= 1e-5, f"{name} {policy}: {r[policy]}"


@pytest.mark.parametrize("name", list(SEL_CASES))
def test_triton_estimator_selects_like_torch(interpreted: dict, name: str) -> None:
    _check(interpreted, name, SEL_CASES)


@pytest.mark.parametrize("name", [*SEL_CASES, *GPU_CASES])
def test_triton_estimator_selects_like_torch_on_gpu(on_gpu: dict, name: str) -> None:
    _check(on_gpu, name, {**SEL_CASES, **GPU_CASES})


# ------------------------------------------------------------------ plain CPU tests


def test_near_tie_rule_accepts_ties_and_rejects_real_disagreements() -> None:
    # query block 5, sink 1: forced {1, 5}; others ranked 3 (0.30), 2 (0.2999990), 4 (0.1)
    p = torch.tensor([0.0, 0.2, 0.2999990, 0.30, 0.1, 0.1000010], dtype=torch.float64)
    tie = dict(p=p, sink=1, i=5, delta=1e-6)
    # topk, one extra block: 2 instead of 3 is a tie (gap 1e-6 <= 2·delta) ...
    assert near_tie_reason(kept_torch={1, 3, 5}, kept_triton={1, 2, 5}, policy="topk",
                           beta=0.6, **tie) is None  # fmt: skip
    # ... 4 instead of 3 is not (gap 0.2), nor is a dropped forced block or another count
    for kept, why in (({1, 4, 5}, "order"), ({2, 3, 5}, "forced"), ({1, 2, 3, 5}, "topk")):
        reason = near_tie_reason(kept_torch={1, 3, 5}, kept_triton=kept, policy="topk",
                                 beta=0.6, **tie)  # fmt: skip
        assert reason is not None and why in reason, (kept, reason)
    # mass: forced + block 3 hold 0.2 + 0.1000010 + 0.30 = 0.6000010; with beta a hair
    # above that PyTorch adds block 2, Triton may stop: a count tie ...
    beta = 0.6000010 + MASS_TOL + 5e-7
    assert near_tie_reason(kept_torch={1, 2, 3, 5}, kept_triton={1, 3, 5}, policy="mass",
                           beta=beta, **tie) is None  # fmt: skip
    # ... but not when beta is well above the prefix sum
    reason = near_tie_reason(kept_torch={1, 2, 3, 5}, kept_triton={1, 3, 5}, policy="mass",
                             beta=0.7, **tie)  # fmt: skip
    assert reason is not None and "count" in reason


def test_estimator_argument_is_checked() -> None:
    doc = doc_ids([[100, 100]])
    q, k = torch.randn(1, 2, 200, 64), torch.randn(1, 1, 200, 64)
    with pytest.raises(ValueError, match="unknown estimator 'cuda'.*torch.*triton"):
        select_blocks(q, k, doc, 0.5, policy="mass", block_size=64, estimator="cuda")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ValueError, match="estimator='triton' needs CUDA tensors"):
            select_blocks(q, k, doc, 0.5, policy="mass", block_size=64, estimator="triton")


if __name__ == "__main__":
    mode = sys.argv[1]
    cases = SEL_CASES if mode == "interpret" else {**SEL_CASES, **GPU_CASES}
    print(json.dumps(_child("cpu" if mode == "interpret" else "cuda", cases)))
