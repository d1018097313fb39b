"""Packing one step: longest-predicted-first into the least-loaded feasible bin, then
local moves, swaps and exchanges between the heaviest and the lightest."""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from sb_titan.balance.sab.plan import Piece

SEARCH_TARGETS = 4  # lightest micro-batches / ranks searched per move (on longtail-v1,


# 2 to 16 reach the same balance; more costs time)
ITER_FACTOR = 4  # at most ITER_FACTOR x (micro-batches or ranks) + 32 moves per search


BALANCE_TOL = 1e-3  # a search stops once the heaviest is this close to the mean: finer


class PackingShape(NamedTuple):
    dp: int
    microbatches: int  # per rank and step
    rows: int  # per micro-batch
    seq_len: int
    max_tokens: int  # token cap per micro-batch


class Packing:
    """A window's pieces packed into micro-batches, which are then dealt to ranks.

    The two levels of the objective separate: packing decides every micro-batch's load
    (minimise the heaviest micro-batch), dealing decides only which rank runs which
    micro-batch (minimise the heaviest rank sum). Dealing exchanges whole micro-batches,
    which is always token-feasible; moving single pieces between ranks rarely is once
    rows are full.

    Rows are numbered flat, `b * rows + w` for micro-batch b (packing order, not rank
    order); a piece's row is -1 while unplaced (carried to the next step).
    """

    def __init__(self, shape: PackingShape, lens: np.ndarray, cost: np.ndarray) -> None:
        self.dp, self.mbs, self.nrows = shape.dp, shape.microbatches, shape.rows
        self.n_mbs = self.dp * self.mbs
        self.seq_len, self.max_tokens = shape.seq_len, shape.max_tokens
        self.lens, self.cost = lens, cost
        self.row = np.full(len(lens), -1, dtype=np.int64)

    # -- packing ------------------------------------------------------------------------
    def greedy(self, order: np.ndarray) -> None:
        """Pieces in `order` (heaviest first) into the least-loaded micro-batch that can
        take them (token cap, and a row with room), first-fit into its rows.

        Micro-batches sit in a min-heap by load; one too full for the current piece is
        parked in a max-heap by the longest piece it still takes and returns once pieces
        get that short (they mostly shrink along the order), so each is set aside about
        once: O(n log B) for n pieces and B micro-batches.
        """
        nw = self.nrows
        lens, cost = self.lens.tolist(), self.cost.tolist()
        fit0 = min(self.seq_len, self.max_tokens)
        row_free = [[self.seq_len] * nw for _ in range(self.n_mbs)]
        mb_free = [self.max_tokens] * self.n_mbs
        mb_fit = [fit0] * self.n_mbs  # longest piece the micro-batch still takes
        mb_load = [0.0] * self.n_mbs
        version = [0] * self.n_mbs  # a heap entry is live only while its version is current
        heap = [(0.0, b, 0) for b in range(self.n_mbs)]  # (load, micro-batch, version)
        parked: list[tuple[int, int, int]] = []  # (-fit, micro-batch, version)
        placed = [-1] * len(lens)
        pop, push = heapq.heappop, heapq.heappush
        for i in order.tolist():
            n = lens[i]
            while parked and -parked[0][0] >= n:
                _, cand, ver = pop(parked)
                push(heap, (mb_load[cand], cand, ver))
            b = -1
            while heap:
                _, cand, ver = heap[0]
                if ver != version[cand]:
                    pop(heap)
                elif mb_fit[cand] >= n:
                    b = cand
                    break
                else:
                    pop(heap)
                    push(parked, (-mb_fit[cand], cand, ver))
            if b < 0:
                continue  # fits nowhere: carried over
            free = row_free[b]
            j = 0
            while free[j] < n:
                j += 1
            free[j] -= n
            mb_free[b] -= n
            mb_fit[b] = min(mb_free[b], max(free))
            mb_load[b] += cost[i]
            placed[i] = b * nw + j
            version[b] += 1
            push(heap, (mb_load[b], b, version[b]))
        self.row = np.array(placed, dtype=np.int64)
        placed_mask = self.row >= 0
        rows = self.row[placed_mask]
        n_rows = self.n_mbs * nw
        used = np.bincount(rows, weights=self.lens[placed_mask], minlength=n_rows)
        self.row_used = used.astype(np.int64)
        self.mb_tok = self.row_used.reshape(-1, nw).sum(1)
        self.mb_load = np.bincount(rows // nw, weights=self.cost[placed_mask], minlength=self.n_mbs)

    def improve(self) -> None:
        """Swaps/moves of pieces off the heaviest micro-batch, to the SEARCH_TARGETS
        lightest, one best move at a time, while the heaviest falls."""
        members = np.flatnonzero(self.row >= 0)
        is_target = np.zeros(self.n_mbs, dtype=bool)
        local_rows = np.arange(self.nrows)
        loads = self.mb_load
        for _ in range(ITER_FACTOR * self.n_mbs + 32):
            heavy = int(np.argmax(loads))
            if loads[heavy] * self.n_mbs <= loads.sum() * (1.0 + BALANCE_TOL):
                return
            mb_of = self.row[members] // self.nrows
            src = members[mb_of == heavy]
            if len(src) < 2:
                return  # a lone piece cannot shrink its micro-batch: the bound is reached
            lights = np.argsort(loads, kind="stable")
            lights = lights[lights != heavy][:SEARCH_TARGETS]
            is_target[:] = False
            is_target[lights] = True
            dst = members[is_target[mb_of]]
            slots = (lights[:, None] * self.nrows + local_rows).ravel()
            move = self._best_swap(src, dst, slots, heavy)
            if move is None:
                return
            self._apply(*move)

    def _room(self, rows: np.ndarray) -> np.ndarray:
        """Tokens a row could still take (its own space and its micro-batch's cap)."""
        mb_room = self.max_tokens - self.mb_tok[rows // self.nrows]
        return np.minimum(self.seq_len - self.row_used[rows], mb_room)

    def _best_swap(
        self, src: np.ndarray, dst: np.ndarray, slots: np.ndarray, heavy: int
    ) -> tuple[int, int, int] | None:
        """Best exchange of a piece of the heavy micro-batch with a destination piece or
        an empty slot of a destination row (a move): the one that leaves the pair's
        larger load smallest, if that is below the heavy micro-batch's load.

        Only length-compatible pairs are formed (q no longer than p plus p's spare room,
        found by binary search), so full rows cost O((|src| + pairs) log |dst|).
        """
        loads, nw = self.mb_load, self.nrows
        top = float(loads[heavy])
        eps = 1e-9 * max(abs(top), 1e-30)
        n_dst = len(dst)
        lq = np.concatenate([self.lens[dst], np.zeros(len(slots), np.int64)])
        cq = np.concatenate([self.cost[dst], np.zeros(len(slots))])
        rq = np.concatenate([self.row[dst], slots])
        room_q = self._room(rq)
        by_len = np.argsort(lq, kind="stable")
        lq_sorted = lq[by_len]
        lp, rp = self.lens[src], self.row[src]
        room_p = self._room(rp)
        lo = np.searchsorted(lq_sorted, lp - room_q.max(), side="left")
        hi = np.searchsorted(lq_sorted, lp + room_p, side="right")
        counts = np.maximum(hi - lo, 0)
        total = int(counts.sum())
        if total == 0:
            return None
        a = np.repeat(np.arange(len(src)), counts)
        starts = np.repeat(lo - np.cumsum(counts) + counts, counts)
        b = by_len[starts + np.arange(total)]
        dl = lp[a] - lq[b]
        ok = dl <= room_q[b]  # p fits where q was (and q, shorter by -dl, where p was)
        d = self.cost[src[a]] - cq[b]
        after = loads[rq[b] // nw] + d
        ok &= (d > eps) & (after < top - eps)
        score = np.where(ok, np.maximum(top - d, after), np.inf)
        k = int(np.argmin(score))  # ties: first pair (source order, then shorter q)
        if not np.isfinite(score[k]):
            return None
        q = int(dst[b[k]]) if b[k] < n_dst else -1  # -1: a move into an empty slot
        return int(src[a[k]]), q, int(rq[b[k]])

    def _apply(self, p: int, q: int, to_row: int) -> None:
        from_row = int(self.row[p])
        self._shift(p, from_row, to_row)
        if q >= 0:
            self._shift(q, to_row, from_row)

    def _shift(self, i: int, a: int, b: int) -> None:
        n, c = int(self.lens[i]), float(self.cost[i])
        self.row_used[a] -= n
        self.row_used[b] += n
        self.mb_tok[a // self.nrows] -= n
        self.mb_tok[b // self.nrows] += n
        self.mb_load[a // self.nrows] -= c
        self.mb_load[b // self.nrows] += c
        self.row[i] = b

    # -- dealing ------------------------------------------------------------------------
    def deal(self) -> np.ndarray:
        """[dp, m] micro-batch ids per rank: heaviest first to the lightest rank with
        room (m each), then exchanges between the heaviest rank and the SEARCH_TARGETS
        lightest while the heaviest rank sum falls. O(B log dp + iterations · m²)."""
        dp, m, loads = self.dp, self.mbs, self.mb_load
        heap = [(0.0, r) for r in range(dp)]
        groups: list[list[int]] = [[] for _ in range(dp)]
        for b in np.lexsort((np.arange(self.n_mbs), -loads)).tolist():  # ties: by id
            total, r = heapq.heappop(heap)
            groups[r].append(b)
            if len(groups[r]) < m:
                heapq.heappush(heap, (total + float(loads[b]), r))
        deal = np.array(groups, dtype=np.int64)
        if dp > 1 and m > 1:
            for _ in range(ITER_FACTOR * dp + 32):
                if not self._exchange(deal):
                    break
        deal.sort(axis=1)  # a rank runs its micro-batches in packing order
        return deal

    def _exchange(self, deal: np.ndarray) -> bool:
        """One best micro-batch exchange off the heaviest rank; False if none helps."""
        sums = self.mb_load[deal].sum(1)
        heavy = int(np.argmax(sums))
        top = float(sums[heavy])
        if top * len(sums) <= sums.sum() * (1.0 + BALANCE_TOL):
            return False
        lights = np.argsort(sums, kind="stable")
        lights = lights[lights != heavy][:SEARCH_TARGETS]
        d = self.mb_load[deal[heavy]][None, :, None] - self.mb_load[deal[lights]][:, None, :]
        after = sums[lights][:, None, None] + d
        eps = 1e-9 * max(abs(top), 1e-30)
        ok = (d > eps) & (after < top - eps)
        score = np.where(ok, np.maximum(top - d, after), np.inf)
        k = int(np.argmin(score))
        if not np.isfinite(score.flat[k]):
            return False
        t, x, y = np.unravel_index(k, score.shape)
        light = int(lights[t])
        deal[heavy, x], deal[light, y] = deal[light, y], deal[heavy, x]
        return True

    def bins(
        self, window: list[Piece], dens: list[float], order: np.ndarray, deal: np.ndarray
    ) -> tuple[list[list[list[Piece]]], list[list[float]]]:
        """Rank-major micro-batches (rank r's j-th is `deal[r, j]`): pieces per row in
        greedy order, and each micro-batch's densities in the same (row-major) order."""
        nw = self.nrows
        pieces: list[list[Piece]] = [[] for _ in range(self.n_mbs * nw)]
        row_dens: list[list[float]] = [[] for _ in range(self.n_mbs * nw)]
        rows = self.row.tolist()
        for i in order.tolist():
            if rows[i] >= 0:
                pieces[rows[i]].append(window[i])
                row_dens[rows[i]].append(dens[i])
        ids = deal.reshape(-1).tolist()
        out = [pieces[b * nw : (b + 1) * nw] for b in ids]
        out_dens = [sum(row_dens[b * nw : (b + 1) * nw], []) for b in ids]
        return out, out_dens
