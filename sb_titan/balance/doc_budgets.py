"""Budgets per document within a micro-batch: the most predicted true recall that fits
a time target.

Micro-batch DST gives every document of a micro-batch one beta. Documents differ in
what a beta costs (attention time grows with the square of length) and in what it
loses (how much true attention mass the kept blocks cover, which depends on content
and length). Given each document's predicted seconds t_d(beta) and true recall
r_d(beta), `allocate` picks beta_d on a grid to maximise sum_d w_d r_d(beta_d) subject
to sum_d t_d(beta_d) <= T.

Weights are tokens (w_d = the document's attending tokens: its length, 0 for a
one-token document). The loss is a mean over tokens, so a token's recall is worth the
same in any document. Weighting query blocks would count a 40-token document as much
as a 64-token block of a long one. Over documents longer than a block, the two agree to
within one block's rounding, which is what the sampled true recall (one query per
query block) measures.

Solver: the Lagrangian max sum_d w_d r_d - lambda t_d splits into one problem per
document. As lambda falls from infinity to 0, each document climbs the upper convex
hull of its points (t_d, w_d r_d), one hull step at each lambda equal to that step's
slope (marginal recall per marginal second). Sorting every hull step by slope visits
each breakpoint exactly, where bisection on lambda would only approach it to a
tolerance. So the steps are taken in falling slope while they fit. Steps of equal slope
are taken together or not at all, so documents equal in every input keep equal budgets
and the result does not depend on document order. A step that does not fit stops its
document there, and cheaper steps of other documents still fill the remaining time. At
a breakpoint the allocation is optimal for its own time (Everett); between breakpoints
it falls short by at most the group the sweep had to leave out (the LP bound). Two
repairs follow: the exchange (take that group, giving back the cheapest steps taken
before it) and the best single budget for all (micro-batch DST's own answer); the
allocation is the best of the three, so it never does worse than an equal split, even
where a tie of many documents makes the left-out group large. Times are summed exactly
(floats as integers) and the sum rounded once, so the target holds as math.fsum sees
it, whatever the order the steps were taken in, on every rank alike.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True, slots=True)
class BudgetCurve:
    """A non-decreasing prediction over budgets: `values` at the knots `betas`
    (increasing, in (0, 1]), linear between them, flat outside. It can come from a
    document's measured history or from its class's curve; it holds seconds or true
    recall."""

    betas: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        b, v = np.asarray(self.betas, dtype=np.float64), np.asarray(self.values, dtype=np.float64)
        if b.ndim != 1 or b.shape != v.shape or b.size == 0:
            raise ValueError(
                f"BudgetCurve: need as many values as knots, got {b.size} and {v.size}"
            )
        if not (np.isfinite(b).all() and np.isfinite(v).all()):
            raise ValueError(f"BudgetCurve: knots and values must be finite, got {self}")
        if (b <= 0).any() or (b > 1).any() or (np.diff(b) <= 0).any():
            raise ValueError(f"BudgetCurve: knots must increase within (0, 1], got {self.betas}")
        if (np.diff(v) < 0).any():
            raise ValueError(f"BudgetCurve: values must not decrease with beta, got {self.values}")

    def at(self, betas: np.ndarray) -> np.ndarray:
        """The curve at `betas`."""
        return np.interp(np.asarray(betas, dtype=np.float64), self.betas, self.values)


@dataclass(frozen=True, slots=True)
class DocCurves:
    """One document of a micro-batch: its length and its predicted curves."""

    length: int  # tokens
    seconds: BudgetCurve  # attention seconds (forward + backward) at each budget
    recall: BudgetCurve  # true recall at each budget, in [0, 1]

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"DocCurves: length must be >= 1 token, got {self.length}")
        if min(self.seconds.values) < 0:
            raise ValueError(f"DocCurves: seconds must be >= 0, got {self.seconds.values}")
        if min(self.recall.values) < 0 or max(self.recall.values) > 1:
            raise ValueError(f"DocCurves: recall must lie in [0, 1], got {self.recall.values}")


@dataclass(frozen=True, slots=True)
class DocBudgetConfig:
    """Bounds of the per-document budgets."""

    grid: tuple[float, ...] = tuple(k / 20 for k in range(2, 21))
    """The budgets the allocator chooses from (increasing, in (0, 1])."""
    beta_min: float = 0.1
    beta_max: float = 1.0
    long_tokens: int = 16384
    """Documents of at least this many tokens are long and get at least `long_floor`.
    Recall per second favours starving exactly the long-range documents that long
    context training is for."""
    long_floor: float = 0.5

    def __post_init__(self) -> None:
        BudgetCurve(self.grid, self.grid)  # the same checks on the grid
        if not 0 < self.beta_min <= self.beta_max <= 1:
            raise ValueError(
                f"DocBudgetConfig: need 0 < beta_min <= beta_max <= 1, got "
                f"{self.beta_min}, {self.beta_max}"
            )
        if self.long_floor > self.beta_max or self.long_tokens < 1:
            raise ValueError(
                f"DocBudgetConfig: long_floor ({self.long_floor}) must be <= beta_max "
                f"({self.beta_max}) and long_tokens ({self.long_tokens}) >= 1"
            )
        if not any(self.beta_min <= b <= self.beta_max for b in self.grid):
            raise ValueError(
                f"DocBudgetConfig: no grid budget within [{self.beta_min}, {self.beta_max}]"
            )


class DocBudgets(NamedTuple):
    betas: np.ndarray  # [D] the budget of each document
    seconds: float  # predicted sum of the documents' seconds (correctly rounded)
    recall: float  # predicted token-weighted mean true recall
    met: bool  # seconds <= target (False: even the lowest allowed budgets miss it)


def allocate(docs: Sequence[DocCurves], target_s: float, cfg: DocBudgetConfig) -> DocBudgets:
    """Per-document budgets on `cfg.grid` with the most predicted token-weighted true
    recall whose predicted seconds sum to at most `target_s` (see the module docstring).
    A pure function of its arguments: every rank that holds them decides the same."""
    grid = np.asarray(cfg.grid, dtype=np.float64)
    seconds = np.stack([d.seconds.at(grid) for d in docs]) if docs else np.zeros((0, grid.size))
    recall = np.stack([d.recall.at(grid) for d in docs]) if docs else np.zeros((0, grid.size))
    lengths = np.array([d.length for d in docs], dtype=np.int64)
    return DocAllocator(grid, seconds, recall, lengths, cfg)(target_s)


class DocAllocator:
    """`allocate` on curves already evaluated: seconds and recall [D, K] at `grid` [K]
    (increasing; it stands in for cfg.grid, whose other bounds apply), lengths [D].
    What does not depend on the time target (the hull steps in slope order) is done
    once: the step's allocation (balance/doc_dst.py) evaluates thousands of documents'
    curves at once, adds each micro-batch's own budget to its grid, builds every
    micro-batch's allocator at once (`many`) and may try several targets."""

    def __init__(
        self,
        grid: np.ndarray,
        seconds: np.ndarray,
        recall: np.ndarray,
        lengths: np.ndarray,
        cfg: DocBudgetConfig,
        find_groups: bool = True,
    ) -> None:
        """find_groups False: `groups` and `before` are left to `_find_groups` (`many`)."""
        self.weight = np.where(lengths >= 2, lengths, 0).astype(np.float64)
        long = lengths >= cfg.long_tokens
        lowest = np.where(long, max(cfg.beta_min, cfg.long_floor), cfg.beta_min)
        self.lo = np.searchsorted(grid, lowest, side="left")  # first grid budget >= bound
        self.hi = int(np.searchsorted(grid, cfg.beta_max, side="right")) - 1
        if (self.lo > self.hi).any():
            raise ValueError(
                f"allocate: no grid budget in [{float(lowest[np.argmax(self.lo > self.hi)])}, "
                f"{cfg.beta_max}] (grid {grid.tolist()})"
            )
        self.grid, self.seconds, self.recall = grid, seconds, recall
        self.exact = _ExactSeconds(seconds)
        self.value = (self.weight[:, None] * recall).tolist()
        self.floor = self.exact.total(self.lo)
        self.uniform: dict[int, int] = {}  # single budget -> its exact seconds, as asked
        self.groups = _Groups([], [], [0], True)
        if find_groups:
            _find_groups([self])

    @classmethod
    def many(
        cls,
        curves: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
        cfg: DocBudgetConfig,
    ) -> list[DocAllocator]:
        """`[DocAllocator(grid, seconds, recall, lengths, cfg) for ... in curves]`, with
        the hulls of all their documents found at once: the hull is a loop over budgets,
        which numpy then runs across every document of the step together."""
        allocators = [cls(*c, cfg, find_groups=False) for c in curves]
        _find_groups(allocators)
        return allocators

    def __call__(self, target_s: float) -> DocBudgets:
        if not math.isfinite(target_s) or target_s < 0:
            raise ValueError(f"allocate: target_s must be a finite number >= 0, got {target_s}")
        pos, limit = self.lo, self.exact.limit(target_s)
        if self.floor <= limit:
            climbed = _climb(self.lo.tolist(), self.floor, limit, self.groups)
            pos = np.array(climbed, dtype=self.lo.dtype)
            uniform = self._uniform(limit)
            if _value(self.value, uniform) > _value(self.value, pos):
                pos = uniform
        return _result(self.grid, pos, self.seconds, self.recall, self.weight, target_s)

    def _uniform(self, limit: int) -> np.ndarray:
        """The largest single budget (each document at least its floor) that fits:
        micro-batch DST's answer, which the allocation never falls below. Ties of many
        documents, taken together, can leave the sweep far short of it. A budget's
        seconds do not depend on the target, so each is summed once."""
        for k in range(self.hi, int(self.lo.min(initial=self.hi)) - 1, -1):
            if (total := self.uniform.get(k)) is None:
                total = self.uniform[k] = self.exact.total(np.maximum(self.lo, k))
            if total <= limit:
                return np.maximum(self.lo, k)
        return self.lo


def _value(value: list[list[float]], pos: np.ndarray) -> float:
    return math.fsum(value[d][k] for d, k in enumerate(pos.tolist()))


Step = tuple[int, int, int, int, float]
"""A hull step: (document, from, to grid index, its exact seconds, its value gain)."""
Group = tuple[tuple[Step, ...], int, tuple[int, ...]]
"""Hull steps of equal slope: (the steps, their exact seconds, their documents). Tuples
of numbers, which the garbage collector stops tracking: a step holds thousands."""


class _Groups(NamedTuple):
    """A micro-batch's groups in falling slope, with what the sweep looks up."""

    groups: list[Group]
    steps: list[tuple[Step, ...]]  # each group's steps
    before: list[int]  # the exact seconds of the groups before each
    rising: bool
    """No group takes less time (as where seconds do not fall with the budget): `before`
    does not fall, and the groups the sweep takes before its first miss are found by
    bisection."""


def _find_groups(allocators: list[DocAllocator]) -> None:
    """Each allocator's `groups`: its documents' hull steps from their lowest budgets,
    in falling slope, steps of equal slope grouped (taken together or not at all)."""
    if not allocators:
        return
    counts = [a.lo.size for a in allocators]
    starts = list(itertools.accumulate(counts, initial=0))
    width = max(a.grid.size for a in allocators)
    t, v = np.zeros((starts[-1], width)), np.zeros((starts[-1], width))
    for a, top in zip(allocators, starts[:-1], strict=True):
        t[top : top + a.lo.size, : a.grid.size] = a.seconds
        v[top : top + a.lo.size, : a.grid.size] = a.weight[:, None] * a.recall  # `value`
    lo = np.concatenate([a.lo for a in allocators]).astype(np.int64)
    hi = np.repeat(np.array([a.hi for a in allocators], dtype=np.int64), counts)
    row, start, end, slope, gain = _hull_steps(t, v, lo, hi)
    owner = np.repeat(np.arange(len(allocators)), counts)[row]
    order = np.lexsort((-slope, owner))  # stable: equal slopes keep document and hull order
    row, start, end, slope, gain, owner = (x[order] for x in (row, start, end, slope, gain, owner))
    first = np.ones(row.size, dtype=bool)  # the first step of each group
    first[1:] = (owner[1:] != owner[:-1]) | (slope[1:] != slope[:-1])
    doc = row - np.array(starts[:-1], dtype=np.int64)[owner]
    steps = zip(
        doc.tolist(), start.tolist(), end.tolist(), gain.tolist(), first.tolist(), strict=True
    )
    cuts = np.searchsorted(owner, np.arange(len(allocators) + 1)).tolist()
    for i, allocator in enumerate(allocators):
        groups = _groups(itertools.islice(steps, cuts[i + 1] - cuts[i]), allocator.exact.ints)
        costs = [cost for _, cost, _ in groups]
        before = list(itertools.accumulate(costs, initial=0))
        rising = all(cost >= 0 for cost in costs)
        allocator.groups = _Groups(groups, [group[0] for group in groups], before, rising)


def _groups(
    steps: Iterable[tuple[int, int, int, float, bool]], ints: list[list[int]]
) -> list[Group]:
    """Hull steps (document, from, to, value gain, whether it starts a group), in
    falling slope, with their exact seconds, grouped."""
    groups: list[Group] = []
    for d, a, b, gain, first in steps:
        step = (d, a, b, ints[d][b] - ints[d][a], gain)
        if first:
            groups.append(((step,), step[3], (d,)))
        else:  # of the slope of the group before: taken with it
            same, cost, docs = groups[-1]
            groups[-1] = ((*same, step), cost + step[3], (*docs, d))
    return groups


def _climb(pos: list[int], used: int, limit: int, groups: _Groups) -> list[int]:
    """`pos` after the sweep, or after the exchange around its first miss where that
    keeps more value; `used`: the documents' seconds at `pos`, exactly; `limit`: the
    most seconds that fit the target (`_ExactSeconds.limit`)."""
    taken, missed = _sweep(groups, 0, used, limit, set())
    if missed is not None:
        other = _exchange(groups, missed, used, limit)
        if other is not None and _gain(other) > _gain(taken):
            taken = other
    for steps in taken:  # in slope order, so each document ends at its last step
        for d, _, b, _, _ in steps:
            pos[d] = b
    return pos


def _sweep(
    groups: _Groups, start: int, used: int, limit: int, blocked: set[int]
) -> tuple[list[tuple[Step, ...]], int | None]:
    """(steps taken from groups[start:] in order while they fit, group by group; the
    first group that did not fit). A group is taken whole or not at all; one that does
    not fit stops its documents, and cheaper steps of others may still fill the time."""
    taken: list[tuple[Step, ...]] = []
    first = start
    if groups.rising and not blocked:  # all whole up to the first miss: one bisection
        before = groups.before
        first = bisect.bisect_right(before, limit - used + before[start], start) - 1
        taken = groups.steps[start:first]
        used += before[first] - before[start]
    missed = None
    for g in range(first, len(groups.groups)):
        steps, cost, docs = groups.groups[g]
        if blocked and not blocked.isdisjoint(docs):
            steps = tuple(step for step in steps if step[0] not in blocked)
            if not steps:
                continue
            cost = sum(step[3] for step in steps)
        if used + cost <= limit:
            used += cost
            taken.append(steps)
        else:
            blocked.update(docs)
            missed = g if missed is None else missed
    return taken, missed


def _exchange(groups: _Groups, missed: int, used: int, limit: int) -> list[tuple[Step, ...]] | None:
    """Take the first group that did not fit, giving back the cheapest groups taken
    before it (lowest slope first, none of its documents) until it fits, then sweep on:
    the knapsack's classic repair of the one large step the sweep had to leave out."""
    used += groups.before[missed + 1]
    keep = set(groups.groups[missed][2])  # documents whose steps must stay
    dropped: set[int] = set()
    given_back: set[int] = set()
    last = missed  # the lowest group looked at
    for g in reversed(range(missed)):
        if used <= limit:
            break
        last = g
        _, cost, docs = groups.groups[g]
        if keep.isdisjoint(docs):  # each is its document's last step: safe to give back
            used -= cost
            dropped.update(docs)
            given_back.add(g)
        else:  # kept, so the earlier steps of all its documents stay too
            keep.update(docs)
    if used > limit:
        return None
    rest, _ = _sweep(groups, missed + 1, used, limit, dropped)
    looked = (groups.steps[g] for g in range(last, missed + 1) if g not in given_back)
    return [*groups.steps[:last], *looked, *rest]


def _gain(taken: list[tuple[Step, ...]]) -> float:
    return math.fsum(step[4] for steps in taken for step in steps)


def _hull_steps(
    t: np.ndarray, v: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(row, from, to grid index, slope, value gain) of every step of the upper convex
    hull of each row's points (t[r, k], v[r, k]), k in [lo[r], hi[r]], starting at
    lo[r], while they gain value, in row then hull order; a row's slopes fall (a step in
    no time has slope inf). The monotone chain on every row at once, each row seeing the
    same tests in the same order and float64 arithmetic as alone."""
    n, width = t.shape
    hull = np.zeros((n, width), dtype=np.int64)
    hull[:, 0] = lo
    size = np.ones(n, dtype=np.int64)
    for k in range(1, width):
        rows = np.flatnonzero((lo < k) & (k <= hi))
        pending = rows[size[rows] >= 2]
        while pending.size:  # pop the top while it lies on or below the chord to k
            top = size[pending] - 1
            a, b = hull[pending, top - 1], hull[pending, top]
            ta, tb, va, vb = t[pending, a], t[pending, b], v[pending, a], v[pending, b]
            below = (tb - ta) * (v[pending, k] - vb) >= (vb - va) * (t[pending, k] - tb)
            pending = pending[below]
            size[pending] -= 1
            pending = pending[size[pending] >= 2]
        hull[rows, size[rows]] = k
        size[rows] += 1
    rows = np.arange(n)[:, None]
    start, end = hull[:, :-1], hull[:, 1:]
    gain, dt = v[rows, end] - v[rows, start], t[rows, end] - t[rows, start]
    taken = np.arange(width - 1) < (size - 1)[:, None]
    taken &= np.logical_and.accumulate(gain > 0, axis=1)  # up to the first that gains nothing
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        slope = np.where(dt == 0, np.inf, gain / dt)
    # never above the step before, whatever the division rounds: a document's steps
    # must come out of the sort in hull order
    slope = np.minimum.accumulate(slope, axis=1)
    row, j = np.nonzero(taken)
    return row, start[row, j], end[row, j], slope[row, j], gain[row, j]


class _ExactSeconds:
    """Seconds [D, K] (>= 0) as exact integers on one common scale 2**shift: sums
    without rounding, rounded once where they meet the target (as math.fsum would),
    through the largest total that fits it (`limit`)."""

    def __init__(self, seconds: np.ndarray) -> None:
        mantissa, exponent = np.frexp(seconds)  # seconds = mantissa * 2**exponent
        digits = (mantissa * 2.0**53).astype(np.int64)  # exact: 53 significant bits
        exponent = exponent.astype(np.int64) - 53
        self.shift = int(exponent.min()) if exponent.size else 0
        self.ints = np.left_shift(digits.astype(object), (exponent - self.shift).astype(object))
        self.ints = self.ints.tolist()  # Python ints: wider than 64 bits where need be

    def total(self, pos: np.ndarray) -> int:
        """The documents' seconds at grid indices `pos`, exactly."""
        return sum(self.ints[d][k] for d, k in enumerate(pos.tolist()))

    def limit(self, target_s: float) -> int:
        """The largest total (on this scale) that, correctly rounded, is within target_s
        (>= 0): rounding is monotone, so each check is one comparison of integers
        (rather than a division of big integers per check). A real rounds to at most
        target_s below the midpoint to the next float up, and at it where target_s's
        last bit is 0 (ties to even)."""
        ulp = math.ulp(target_s)  # a power of two: target_s = n * ulp exactly
        n = int(target_s / ulp)
        exponent = math.frexp(ulp)[1] - 2 - self.shift  # midpoint = (2n + 1) * 2**exponent
        if exponent < 0:  # the midpoint is no integer: the largest below it
            return (2 * n + 1) >> -exponent
        return ((2 * n + 1) << exponent) - (n & 1)


def _result(
    grid: np.ndarray,
    pos: np.ndarray,
    seconds: np.ndarray,
    recall: np.ndarray,
    weight: np.ndarray,
    target_s: float,
) -> DocBudgets:
    rows = np.arange(len(pos))
    total_s = math.fsum(seconds[rows, pos].tolist())
    mass = weight.sum()
    mean = math.fsum((weight * recall[rows, pos]).tolist()) / mass if mass > 0 else 1.0
    return DocBudgets(grid[pos], total_s, mean, total_s <= target_s)
