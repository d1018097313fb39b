"""The per-document budget allocator against brute force over its grid."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from sb_titan.balance.doc_budgets import (
    BudgetCurve,
    DocAllocator,
    DocBudgetConfig,
    DocCurves,
    _ExactSeconds,
    _hull_steps,
    allocate,
)

GRID = (0.2, 0.35, 0.5, 0.65, 0.8, 1.0)
CFG = DocBudgetConfig(grid=GRID, beta_min=0.2, beta_max=1.0, long_tokens=10**9)


def _doc(length: int, sensitivity: float) -> DocCurves:
    """Attention seconds ~ length^2 x density (topk: density = beta, plus the forced
    blocks); true recall 1 - (1 - beta)^sensitivity: concave, a flatter curve the more
    a document's attention concentrates in few blocks."""
    betas = np.linspace(0.05, 1.0, 20)
    seconds = 1e-9 * length**2 * (0.05 + 0.95 * betas)
    recall = 1.0 - (1.0 - betas) ** sensitivity
    return DocCurves(
        length, BudgetCurve(tuple(betas), tuple(seconds)), BudgetCurve(tuple(betas), tuple(recall))
    )


# long documents lose little recall per second saved, short ones much: an equal split
# cannot trade between them
BATCH = [_doc(8192, 6.0), _doc(4096, 1.5), _doc(2048, 0.8), _doc(1024, 3.0)]


def _tables(docs: list[DocCurves], cfg: DocBudgetConfig):
    grid = np.asarray(cfg.grid)
    t = np.stack([d.seconds.at(grid) for d in docs])
    r = np.stack([d.recall.at(grid) for d in docs])
    w = np.array([d.length for d in docs], dtype=np.float64)
    return grid, t, r, w


def _brute_force(docs, target_s, cfg):
    """(best token-weighted recall, its budgets) over every grid combination."""
    grid, t, r, w = _tables(docs, cfg)
    best = (-1.0, None)
    for combo in itertools.product(range(len(grid)), repeat=len(docs)):
        rows = np.arange(len(docs))
        if math.fsum(t[rows, combo].tolist()) <= target_s:
            value = float((w * r[rows, combo]).sum() / w.sum())
            if value > best[0] + 1e-15:
                best = (value, grid[list(combo)])
    return best


def _equal_split(docs, target_s, cfg):
    """Micro-batch DST's answer: the largest single grid beta that fits."""
    grid, t, r, w = _tables(docs, cfg)
    fits = [k for k in range(len(grid)) if math.fsum(t[:, k].tolist()) <= target_s]
    k = max(fits)
    return float((w * r[:, k]).sum() / w.sum()), grid[k]


def _targets(docs, cfg):
    _, t, _, _ = _tables(docs, cfg)
    return np.linspace(t[:, 0].sum(), t[:, -1].sum(), 23)


def test_meets_the_time_target():
    for target in _targets(BATCH, CFG):
        got = allocate(BATCH, float(target), CFG)
        spent = math.fsum(d.seconds.at(b) for d, b in zip(BATCH, got.betas, strict=True))
        assert got.met and spent <= target and got.seconds == spent
    # below what the lowest budgets cost: they are kept and the miss is reported
    _, t, _, _ = _tables(BATCH, CFG)
    short = allocate(BATCH, 0.5 * float(t[:, 0].sum()), CFG)
    assert not short.met and (short.betas == 0.2).all()


def test_optimal_at_every_lagrangian_breakpoint():
    """For any lambda, the documents' own best points (max w r - lambda t) are optimal
    for their total time (Everett): the allocator matches brute force there."""
    grid, t, r, w = _tables(BATCH, CFG)
    value = w[:, None] * r / w.sum()
    checked = 0
    for lam in np.geomspace(1e-4, 1e4, 40) * (value.max() / t.max()):
        k = np.argmax(value - lam * t, axis=1)
        target = math.fsum(t[np.arange(len(BATCH)), k].tolist())
        want, want_betas = _brute_force(BATCH, target, CFG)
        got = allocate(BATCH, target, CFG)
        assert got.recall == pytest.approx(want, abs=1e-12), lam
        checked += not np.array_equal(k, np.zeros_like(k))
    assert checked > 5


def test_beats_an_equal_split_and_stays_within_one_step_of_brute_force():
    grid, t, r, w = _tables(BATCH, CFG)
    step = max((w * np.diff(r, axis=1).max(axis=1)).max() / w.sum(), 0.0)
    strictly = 0
    for target in _targets(BATCH, CFG):
        got = allocate(BATCH, float(target), CFG)
        best, _ = _brute_force(BATCH, float(target), CFG)
        equal, _ = _equal_split(BATCH, float(target), CFG)
        assert got.recall <= best + 1e-12
        assert got.recall >= best - step
        assert got.recall >= equal - 1e-12
        strictly += got.recall > equal + 1e-3
    assert strictly >= 10  # where time binds, moving budget between documents pays
    # e.g. halfway: the long, insensitive document gives its budget to the short ones
    mid = float(_targets(BATCH, CFG)[11])
    got = allocate(BATCH, mid, CFG)
    assert got.betas[0] < got.betas[2]


def test_exchange_takes_the_step_the_sweep_left_out():
    """B's steps pay more per second and fill the time; A's one big step then no longer
    fits. Giving back B's cheaper step makes room for it: the optimum, which neither the
    sweep (B at 1.0) nor one budget for both (0.4) finds."""
    grid = (0.2, 0.4, 1.0)
    cfg = DocBudgetConfig(grid=grid, beta_min=0.2, long_tokens=10**9)
    a = DocCurves(1000, BudgetCurve(grid, (1.0, 1.0, 11.0)), BudgetCurve(grid, (0.0, 0.0, 1.0)))
    b = DocCurves(1000, BudgetCurve(grid, (1.0, 2.0, 3.0)), BudgetCurve(grid, (0.0, 0.6, 1.0)))
    got = allocate([a, b], 13.0, cfg)
    best, best_betas = _brute_force([a, b], 13.0, cfg)
    assert got.betas.tolist() == best_betas.tolist() == [1.0, 0.4]
    assert got.recall == pytest.approx(best) == pytest.approx(0.8)


def test_random_micro_batches_against_brute_force():
    """Feasible, never above brute force and never below an equal split, on random
    micro-batches with repeated documents (whose steps are taken together) and recall
    curves convex in beta as well as concave."""
    rng = np.random.default_rng(1)
    for _ in range(12):
        docs = [
            _doc(int(n), float(s))
            for n, s in zip(rng.integers(256, 8192, 3), rng.uniform(0.5, 6, 3), strict=True)
        ]
        docs += [docs[int(rng.integers(3))]] * 2
        grid, t, r, w = _tables(docs, CFG)
        for target in rng.uniform(t[:, 0].sum(), t[:, -1].sum(), 4):
            got = allocate(docs, float(target), CFG)
            spent = math.fsum(d.seconds.at(b) for d, b in zip(docs, got.betas, strict=True))
            best, _ = _brute_force(docs, float(target), CFG)
            assert spent <= target and got.recall <= best + 1e-12
            assert got.recall >= _equal_split(docs, float(target), CFG)[0] - 1e-12


def test_long_document_floor_holds():
    tight = float(_tables(BATCH, CFG)[1][:, 0].sum()) * 1.05
    free = allocate(BATCH, tight, CFG)
    assert free.betas[0] < 0.5  # without the floor the 8K document is starved
    floored = DocBudgetConfig(grid=GRID, beta_min=0.2, long_tokens=8192, long_floor=0.5)
    for target in (tight, *_targets(BATCH, CFG)):
        got = allocate(BATCH, float(target), floored)
        assert got.betas[0] >= 0.5 and (got.betas[1:] >= 0.2).all()
    # a floor between grid points rounds up to the next grid budget
    between = DocBudgetConfig(grid=GRID, long_tokens=8192, long_floor=0.55)
    assert allocate(BATCH, tight, between).betas[0] == 0.65


def test_equal_documents_get_equal_budgets():
    same = [_doc(4096, 2.0) for _ in range(5)]
    other = _doc(1024, 0.7)
    _, t, _, _ = _tables(same + [other], CFG)
    for target in np.linspace(t[:, 0].sum(), t[:, -1].sum(), 31):
        got = allocate(same, float(target), CFG)
        assert (got.betas == got.betas[0]).all(), target
        mixed = allocate(same + [other], float(target), CFG)
        assert (mixed.betas[:5] == mixed.betas[0]).all(), target


def test_order_free_and_deterministic():
    rng = np.random.default_rng(0)
    docs = [
        _doc(int(n), float(s))
        for n, s in zip(rng.integers(64, 8192, 12), rng.uniform(0.5, 6, 12), strict=True)
    ]
    perm = rng.permutation(len(docs))
    for target in _targets(docs, CFG)[1:-1]:
        got = allocate(docs, float(target), CFG)
        again = allocate(docs, float(target), CFG)
        shuffled = allocate([docs[i] for i in perm], float(target), CFG)
        assert np.array_equal(got.betas, again.betas)
        assert np.array_equal(got.betas[perm], shuffled.betas)


def test_one_token_documents_weigh_nothing_and_bad_input_is_refused():
    docs = [_doc(1, 1.0), _doc(2048, 1.0)]
    got = allocate(docs, 1.0, CFG)  # time for everything: only the real document rises
    assert got.betas.tolist() == [0.2, 1.0]
    empty = allocate([], 0.0, CFG)
    assert empty.betas.size == 0 and empty.met and empty.seconds == 0.0
    with pytest.raises(ValueError, match="values must not decrease"):
        BudgetCurve((0.2, 0.5), (0.9, 0.8))
    with pytest.raises(ValueError, match="recall must lie in"):
        DocCurves(10, BudgetCurve((0.5,), (1.0,)), BudgetCurve((0.5,), (1.5,)))
    with pytest.raises(ValueError, match="long_floor"):
        DocBudgetConfig(beta_max=0.4, long_floor=0.5)
    with pytest.raises(ValueError, match="target_s"):
        allocate(docs, float("nan"), CFG)


def _fits(exact: _ExactSeconds, total: int, target_s: float) -> bool:
    """The exact rule: `total` on exact's scale, correctly rounded (int / int and int ->
    float both round to nearest, ties to even), is within target_s."""
    try:
        if exact.shift >= 0:
            return float(total << exact.shift) <= target_s
        return total / (1 << -exact.shift) <= target_s
    except OverflowError:  # beyond the largest float: above any target
        return False


def test_exact_seconds_limit_is_the_last_total_that_fits():
    """`limit` against the rule it replaces, on scales from subnormal to huge seconds
    (the common shift below and above 0) and targets at the edges: 0, the smallest
    subnormal, a total's own float and its neighbours, the largest float."""
    rng = np.random.default_rng(2)
    checked = 0
    for exponent in (-1074, -1040, -600, -60, -20, -1, 0, 1, 30, 200, 900, 960):
        for _ in range(40):
            mantissa = rng.uniform(0.5, 1.0, 6)
            seconds = np.ldexp(mantissa, exponent + rng.integers(-3, 4, 6))
            seconds[rng.integers(6)] = rng.choice([0.0, 5e-324, 1.0])
            exact = _ExactSeconds(seconds.reshape(2, 3))
            own = [float(x) for x in seconds] + [math.fsum(seconds.tolist())]
            targets = [0.0, 5e-324, 1.7976931348623157e308, *own]
            targets += [math.nextafter(t, d) for t in own for d in (0.0, math.inf)]
            targets += np.ldexp(rng.random(4), exponent + rng.integers(-8, 60, 4)).tolist()
            for target in (t for t in targets if math.isfinite(t)):
                limit = exact.limit(target)
                near = [limit + d for d in range(-3, 4)] + [limit * 2, limit // 2 + 1]
                for total in (t for t in near if t >= 0):
                    assert _fits(exact, total, target) == (total <= limit), (target, total)
                    checked += 1
    assert checked > 50000


def _hull_one(t: list[float], v: list[float], lo: int, hi: int) -> list[tuple[int, int, float]]:
    """One row's hull steps, the plain way (the monotone chain, one point at a time):
    (from, to, slope) while they gain value, each slope at most the one before."""
    hull = [lo]
    for k in range(lo + 1, hi + 1):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (t[b] - t[a]) * (v[k] - v[b]) >= (v[b] - v[a]) * (t[k] - t[b]):
                hull.pop()
            else:
                break
        hull.append(k)
    out: list[tuple[int, int, float]] = []
    for a, b in zip(hull[:-1], hull[1:], strict=True):
        gain, dt = v[b] - v[a], t[b] - t[a]
        if gain <= 0:
            break
        slope = math.inf if dt == 0 else gain / dt
        out.append((a, b, min(slope, out[-1][2]) if out else slope))
    return out


def test_hull_steps_on_all_rows_at_once_match_one_row_at_a_time():
    """Rows with exact collinear runs (integers), interpolated runs (rounding decides),
    plateaus, steps in no time, falling values and huge slopes, each within its own
    [lo, hi]: the same steps, slopes equal to the bit."""
    rng = np.random.default_rng(3)
    width = 24
    betas = np.linspace(0.05, 1.0, width)
    rows_t, rows_v = [], []
    for _ in range(3000):
        kind = rng.integers(5)
        if kind == 0:  # small integers: many exact ties
            t = np.cumsum(rng.integers(0, 3, width)).astype(np.float64)
            v = np.cumsum(rng.integers(0, 3, width)).astype(np.float64)
        elif kind == 1:  # piecewise linear curves sampled on a grid (as the models are)
            knots = np.sort(rng.choice(betas, 4, replace=False))
            t = np.interp(betas, knots, np.cumsum(rng.random(4)))
            v = np.interp(betas, knots, np.cumsum(rng.random(4))) * rng.integers(1, 40000)
        elif kind == 2:  # plateaus and steps in no time
            t = np.cumsum(rng.choice([0.0, 0.0, 1e-3, 0.25], width))
            v = np.cumsum(rng.choice([0.0, 0.5, 1e-9], width))
        elif kind == 3:  # anything, falling values included
            t, v = rng.random(width), rng.normal(size=width)
        else:  # tiny times beside large gains: slopes that overflow to inf
            t = np.cumsum(rng.choice([0.0, 5e-324, 1e-310, 1e-300], width))
            v = np.cumsum(rng.random(width)) * 1e10
        rows_t.append(t)
        rows_v.append(v)
    t, v = np.array(rows_t), np.array(rows_v)
    hi = rng.integers(0, width, len(t))
    lo = rng.integers(0, hi + 1)
    row, start, end, slope, _ = _hull_steps(t, v, lo, hi)
    got: list[list[tuple[int, int, float]]] = [[] for _ in range(len(t))]
    for r, a, b, s in zip(row.tolist(), start.tolist(), end.tolist(), slope.tolist(), strict=True):
        got[r].append((a, b, s))
    steps = 0
    for r in range(len(t)):
        want = _hull_one(t[r].tolist(), v[r].tolist(), int(lo[r]), int(hi[r]))
        assert got[r] == want, r
        steps += len(want)
    assert steps > 3000


def _table(docs: list[DocCurves], grid: np.ndarray):
    """DocAllocator's inputs for `docs` on `grid`: (grid, seconds, recall, lengths)."""
    seconds = [d.seconds.at(grid) for d in docs]
    recall = [d.recall.at(grid) for d in docs]
    shape = (len(docs), grid.size)
    return (
        grid,
        np.array(seconds).reshape(shape),
        np.array(recall).reshape(shape),
        np.array([d.length for d in docs], dtype=np.int64),
    )


def test_many_allocators_decide_as_each_alone():
    """`DocAllocator.many` finds every micro-batch's hulls in one pass over rows of
    different grids (widths), floors and counts (none included): each decides as the
    allocator built alone, which the tests above hold against brute force."""
    rng = np.random.default_rng(4)
    cfg = DocBudgetConfig(grid=GRID, beta_min=0.2, long_tokens=6000, long_floor=0.5)
    tables = []
    for n in (3, 0, 5, 1, 7, 2):
        grid = np.sort(rng.choice(np.arange(2, 21) / 20, int(rng.integers(3, 12)), replace=False))
        grid[-1] = 1.0
        lengths, sensitivity = rng.integers(64, 9000, n), rng.uniform(0.5, 6, n)
        docs = [_doc(int(x), float(s)) for x, s in zip(lengths, sensitivity, strict=True)]
        tables.append(_table(docs + docs[:1] * (n > 2), grid))  # with a tie
    # the last step of one micro-batch and the first of the next of equal slope (the
    # same document): still two groups
    pair, grid = [_doc(512, 2.0), _doc(4096, 1.0)], np.array([0.2, 1.0])
    tables += [_table(pair[:1], grid), _table(pair, grid)]
    together = DocAllocator.many(tables, cfg)
    for table, allocator in zip(tables, together, strict=True):
        alone = DocAllocator(*table, cfg)
        total = table[1].sum(axis=0)
        for target in np.linspace(0.5 * total[0], total[-1], 17).tolist():
            got, want = allocator(target), alone(target)
            assert got.betas.tolist() == want.betas.tolist()
            assert (got.seconds, got.recall, got.met) == (want.seconds, want.recall, want.met)
