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

_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_POOL_LOCK = threading.Lock()


def _single_thread() -> None:
    # A thread takes torch's process-wide default at its first parallel op: take it now,
    # then set this thread (OpenMP and MKL settings are per thread) to one.
    torch.get_num_threads()
    torch.set_num_threads(1)


def _pool(n: int) -> ThreadPoolExecutor:
    """n persistent worker threads, each set to one intra-op thread (thread-local in
    OpenMP and MKL; torch's process-wide default, which that also sets, is restored)."""
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or _POOL_SIZE < n:
            if _POOL is not None:
                _POOL.shutdown()
            threads = torch.get_num_threads()
            started = threading.Barrier(n, timeout=60)  # all n threads exist and are set
            _POOL = ThreadPoolExecutor(n, "block_sparse", initializer=_single_thread)
            list(_POOL.map(lambda _: started.wait(), range(n)))
            torch.set_num_threads(threads)
            _POOL_SIZE = n
        return _POOL


def _forget_pool() -> None:  # a forked child has the pool object but not its threads
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_forget_pool)


def run_split(work: Callable[[list], T], items: list, device: torch.device) -> list[T]:
    """[work(part) for each part]: all items in one part, or on CPU with T > 1 torch
    threads, T parts dealt round-robin (items[w::T]) to T single-threaded workers. The
    split depends only on T, so results are deterministic for a given thread count."""
    n = min(torch.get_num_threads() if device.type == "cpu" else 1, len(items))
    if n <= 1:
        return [work(items)]
    return list(_pool(n).map(work, [items[w::n] for w in range(n)]))
