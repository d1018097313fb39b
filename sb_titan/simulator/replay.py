"""Event-level replay of a pipeline step: every action starts when its stage is free
and its input has arrived."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sb_titan.simulator.schedules import Action


@dataclass
class Timeline:
    """One step's replay, vectorised over DP ranks (all run the same order)."""

    events: list[tuple[int, Action, np.ndarray, np.ndarray]]  # (pp rank, action, start, end)
    makespan: np.ndarray  # [dp] seconds until the last backward of each DP rank
    busy: np.ndarray  # [pp, dp] compute seconds of each (pipeline rank, DP rank)


def replay(
    orders: list[list[Action]], fwd: np.ndarray, bwd: np.ndarray, send: np.ndarray
) -> Timeline:
    """Event-by-event replay of per-rank action orders.

    fwd, bwd: [n_stages, microbatches, dp] seconds; send: [microbatches, dp] seconds per
    stage boundary. F(s, i) needs F(s-1, i) plus a send; B(s, i) needs B(s+1, i) plus a
    send (the last stage: its own F); each rank runs its actions in order, one at a time.
    """
    n_stages, _, dp = fwd.shape
    pp = len(orders)
    done: dict[tuple[str, int, int], np.ndarray] = {}
    free = [np.zeros(dp) for _ in range(pp)]
    busy = np.zeros((pp, dp))
    ptr = [0] * pp
    events = []
    zero = np.zeros(dp)
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while ptr[r] < len(orders[r]):
                a = orders[r][ptr[r]]
                if a.kind == "F":
                    deps = [(("F", a.stage - 1, a.mb), send[a.mb])] if a.stage else []
                    dur = fwd[a.stage, a.mb]
                elif a.stage == n_stages - 1:
                    deps, dur = [(("F", a.stage, a.mb), zero)], bwd[a.stage, a.mb]
                else:
                    deps = [(("B", a.stage + 1, a.mb), send[a.mb]), (("F", a.stage, a.mb), zero)]
                    dur = bwd[a.stage, a.mb]
                if any(key not in done for key, _ in deps):
                    break
                start = free[r]
                for key, lag in deps:
                    start = np.maximum(start, done[key] + lag)
                end = start + dur
                done[(a.kind, a.stage, a.mb)] = end
                free[r] = end
                busy[r] += dur
                events.append((r, a, start, end))
                ptr[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [orders[r][ptr[r]] for r in range(pp) if ptr[r] < len(orders[r])]
            raise RuntimeError(f"schedule replay deadlocked at {stuck}")
    return Timeline(events, np.max([e[3] for e in events], axis=0), busy)
