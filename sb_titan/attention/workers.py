"""Single-threaded CPU workers, one per torch thread, for loops of many small ops.

The CPU block-sparse path runs a chunk as ~12 small ops (gathers, batched matmuls,
elementwise). Split over T threads op by op, every op pays an OpenMP fork/join and the
Python between ops stays serial; on a machine shared with other jobs a descheduled
thread stalls every op (measured 10-40x slowdowns). Whole chunks on T workers with one
intra-op thread each scale better (torch releases the GIL inside ops), and a worker
slowed by other load stalls only itself.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
S = TypeVar("S")

_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _single_thread() -> None:
    # A thread takes torch's process-wide default at its first parallel op: take it now,
    # then set this thread (OpenMP and MKL settings are per thread) to one.
    torch.get_num_threads()
    torch.set_num_threads(1)


def _pool(n: int) -> ThreadPoolExecutor:
    """n persistent worker threads, each set to one intra-op thread (thread-local in
    OpenMP and MKL; torch's process-wide default, which that also sets, is restored)."""
    with _POOLS_LOCK:
        if n not in _POOLS:
            threads = torch.get_num_threads()
            started = threading.Barrier(n, timeout=60)  # all n threads exist and are set
            pool = ThreadPoolExecutor(n, "sb_titan_worker", initializer=_single_thread)
            list(pool.map(lambda _: started.wait(), range(n)))
            torch.set_num_threads(threads)
            _POOLS[n] = pool
        return _POOLS[n]


os.register_at_fork(after_in_child=_POOLS.clear)  # a child has the pools but no threads


def run_split(
    work: Callable[[list, S], T],
    items: list,
    device: torch.device,
    scratch: Callable[[], S],
    parts_per_worker: int = 1,
) -> list[T]:
    """[work(part, scratch) for each part], parts in order.

    Serially with one part on GPUs or with one torch thread. Otherwise, with T torch
    threads, the items are dealt round-robin into P = T * parts_per_worker parts
    (items[p::P]) that T single-threaded workers take as they become free, so a worker
    slowed by other load takes fewer. Each worker builds `scratch()` once per call. The
    parts depend only on T, so per-part results are deterministic for a given T.
    """
    n = min(torch.get_num_threads() if device.type == "cpu" else 1, len(items))
    if n <= 1:
        return [work(items, scratch())]
    local = threading.local()
    grad = torch.is_grad_enabled()  # thread-local: workers follow the caller

    def run(part: list) -> T:
        with torch.set_grad_enabled(grad):
            if not hasattr(local, "scratch"):
                local.scratch = scratch()
            return work(part, local.scratch)

    P = min(len(items), n * parts_per_worker)
    return list(_pool(n).map(run, [items[p::P] for p in range(P)]))
