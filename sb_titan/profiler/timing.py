"""Timing one callable on the device: wall clock (synchronised) or process CPU time,
and round-robin passes over a grid so machine load spreads over every point."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch

CLOCKS = ("wall", "cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], None], device: torch.device, clock: str = "wall") -> float:
    """Seconds of one call. clock="cpu": this process's CPU time (single-threaded CPU
    runs only), which other users' processes on a shared machine do not inflate."""
    if clock == "cpu":
        t0 = time.process_time()
        fn()
        return time.process_time() - t0
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


class Progress:
    """tqdm when installed, else one rewritten stderr line; silent when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self.total, self.desc, self.enabled, self.n = total, desc, enabled, 0
        self._bar = None
        if enabled:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=sys.stderr)

    def update(self, note: str = "") -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(1)
        elif self.enabled:
            end = "\n" if self.n == self.total else ""
            print(f"\r{self.desc}: {self.n}/{self.total} {note}", end=end, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def time_grid(
    steps: Sequence[Callable[[], None]],
    device: torch.device,
    warmup: int,
    repeats: int,
    progress: Progress,
    clock: str = "wall",
) -> list[list[float]]:
    """Per step, `repeats` timings, taken round-robin after `warmup` passes."""
    for w in range(warmup):
        for step in steps:
            step()
            progress.update(f"warm-up {w + 1}/{warmup}")
    times: list[list[float]] = [[] for _ in steps]
    for r in range(repeats):
        for i, step in enumerate(steps):
            times[i].append(time_once(step, device, clock))
            progress.update(f"pass {r + 1}/{repeats}")
    return times


def load_average() -> float | None:
    with contextlib.suppress(OSError, AttributeError):
        return round(os.getloadavg()[0], 2)
    return None
