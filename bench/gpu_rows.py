"""bench/gpu.py's rows: a JSONL log that keeps every row the moment it is measured, the
budget that stops a run between rows, timing and NaN-filling free memory, and the report
that turns JSONL back into the tables of docs/results.md.

    python bench/gpu.py report --out DIR      # every DIR/*.jsonl -> markdown tables

Every row is one JSON object on its own line with a "part": "run" (device, versions,
arguments), "a" (correctness), "peer" (dense flash / cuDNN on one shape), "b" (our
kernels on one table), "flex" (FlexAttention on the same table, or its error), "c" (a
one-GPU training step), "end" (why the run stopped: done, budget, max_rows).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch


class Stop(Exception):
    """Raised between rows when the run must end (budget or row cap)."""


class RowLog:
    """Appends rows to `path` as they come (flushed and fsynced: a run killed at its
    limit keeps what it measured) and decides, between rows, whether another fits:
    at most `max_rows` rows, and none that would, at the pace of the longest row so
    far, end past `budget_s` seconds after start. `clock` is injectable (tests)."""

    def __init__(
        self,
        path: Path,
        budget_s: float | None = None,
        max_rows: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path, self.budget_s, self.max_rows, self.clock = path, budget_s, max_rows, clock
        self.start = clock()
        self.rows = 0
        self.longest = 0.0
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")  # one file per run

    def elapsed(self) -> float:
        return self.clock() - self.start

    def write(self, row: dict) -> None:
        """Append one row now (not counted against max_rows: run and end markers)."""
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def check(self) -> None:
        """Raise Stop if the next row should not start."""
        if self.max_rows is not None and self.rows >= self.max_rows:
            raise Stop("max_rows")
        if self.budget_s is not None and self.elapsed() + self.longest > self.budget_s:
            raise Stop("budget")

    def measure(self, key: dict, fn: Callable[..., dict], *args) -> dict:
        """check(), then run fn(*args) and append key | its result as one row."""
        self.check()
        t0 = self.clock()
        row = key | fn(*args)
        took = self.clock() - t0
        self.longest = max(self.longest, took)
        row["row_s"] = took  # what the row cost (planning GPU time), never asserted
        self.rows += 1
        self.write(row)
        return row


def run_rows(log: RowLog, parts: Iterable[Callable[[RowLog], None]]) -> str:
    """Run each part against `log` until one raises Stop; returns why the run ended
    and writes it as the last row."""
    reason = "done"
    try:
        for part in parts:
            part(log)
    except Stop as stop:
        reason = str(stop)
    log.write({"part": "end", "reason": reason, "rows": log.rows, "elapsed_s": log.elapsed()})
    return reason


def guarded(fn: Callable[..., dict], *args) -> dict:
    """fn(*args), or {"error": ...} if it raised: for rows whose failure is a finding
    (a peer that does not run here), not a reason to stop the run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 -- reported as the row, never raised
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def read_rows(paths: Iterable[Path]) -> list[dict]:
    rows = []
    for path in paths:
        rows += [json.loads(line) for line in Path(path).read_text().splitlines() if line]
    return rows


# ---------------------------------------------------------------------------- measuring


POISON_CHUNKS = (1 << 32, 1 << 28, 1 << 24)  # bytes: big first, so big outputs land in one
POISON_HEADROOM = 1 << 30  # left to the driver (module loads, cuBLAS and cuDNN handles)


def poison(device: torch.device) -> None:
    """Fill the free device memory with NaN through the caching allocator (its cached
    free blocks first, then new ones, in chunks, leaving a little to the driver), then
    free it back to the cache: the next run's outputs are cut from NaN, so an output a
    kernel leaves unwritten shows. CUDA only: CPU memory is not cached."""
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    left, chunks = max(free - POISON_HEADROOM, 0) + cached, []
    for size in POISON_CHUNKS:
        while left >= size:
            try:
                chunks.append(torch.full((size // 4,), math.nan, device=device))
            except torch.cuda.OutOfMemoryError:
                break
            left -= size
    torch.cuda.synchronize(device)
    del chunks


def median_ms(
    fn: Callable[[], object],
    repeats: int,
    device: torch.device,
    reset: Callable[[], None] | None = None,
    warmup: int = 2,
) -> float | None:
    """Median of `repeats` CUDA-event timings of fn after `warmup` calls; `reset` runs
    before every call, outside the timing (clearing gradients). Off CUDA fn runs once
    (the dry run executes the code path) and the time is None: it would mean nothing."""
    if device.type != "cuda":
        if reset:
            reset()
        fn()
        return None
    for _ in range(warmup):
        if reset:
            reset()
        fn()
    times = []
    for _ in range(repeats):
        if reset:
            reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_norm(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in fp64 (inf where ref is zero and got is not)."""
    got, ref = got.double(), ref.double()
    den = float(ref.norm())
    num = float((got - ref).norm())
    return num / den if den else (0.0 if num == 0 else math.inf)


# ---------------------------------------------------------------------------- report


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool) or not isinstance(x, float):
        return str(x)
    return f"{x:.3g}"


def _table(rows: list[dict], columns: dict[str, Callable[[dict], object]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(get(r)) for get in columns.values()) + " |")
    return lines


def _errs(d: dict | None) -> str:
    return "-" if not d else ", ".join(f"{v:.1e}" for v in d.values())


KEY_COLUMNS = {
    "L": lambda r: r["L"],
    "heads (q, kv, D)": lambda r: tuple(r["heads"]),
    "block": lambda r: r["block"],
}


CHECK_COLUMNS = KEY_COLUMNS | {
    "dtype": lambda r: r["dtype"].replace("torch.", ""),
    "check": lambda r: r["check"],
    "density": lambda r: r["realised_density"],
    "rel. norm error (out, dq, dk, dv)": lambda r: _errs(r.get("rel_norm_error")),
    "max abs error": lambda r: _errs(r.get("max_abs_error")),
    "flash's rel. norm error": lambda r: _errs(r.get("dense_rel_norm_error")),
    "bitwise repeatable": lambda r: r.get("deterministic"),
    "ok": lambda r: r["ok"],
}
PEER_COLUMNS = {
    "L": lambda r: r["L"],
    "heads (q, kv, D)": lambda r: tuple(r["heads"]),
    "kernel": lambda r: r["peer"],
    "fwd ms": lambda r: r.get("fwd_ms"),
    "bwd ms": lambda r: r.get("bwd_ms"),
    "fwd TF/s per pair": lambda r: r.get("fwd_tflops_per_pair"),
    "bwd TF/s per pair": lambda r: r.get("bwd_tflops_per_pair"),
    "error": lambda r: r.get("error"),
}
SPEED_COLUMNS = KEY_COLUMNS | {
    "topk β": lambda r: r["density"],
    "density": lambda r: r["realised_density"],
    "fwd TF/s": lambda r: r.get("fwd_tflops_per_pair"),
    "pre GB/s": lambda r: r.get("preprocess_gb_per_s"),
    "dQ TF/s": lambda r: r.get("dq_tflops_per_pair"),
    "dK/dV TF/s": lambda r: r.get("dkdv_tflops_per_pair"),
    "bwd TF/s": lambda r: r.get("bwd_tflops_per_pair"),
    "fwd / flash": lambda r: r.get("fwd_vs_flash"),
    "bwd / flash": lambda r: r.get("bwd_vs_flash"),
    "fwd / cuDNN": lambda r: r.get("fwd_vs_cudnn"),
    "bwd / cuDNN": lambda r: r.get("bwd_vs_cudnn"),
}
FLEX_COLUMNS = KEY_COLUMNS | {
    "topk β": lambda r: r["density"],
    "mask ms": lambda r: r.get("mask_ms"),
    "fwd TF/s": lambda r: r.get("fwd_tflops_per_pair"),
    "bwd TF/s": lambda r: r.get("bwd_tflops_per_pair"),
    "ours / Flex fwd": lambda r: r.get("ours_fwd_vs_flex"),
    "ours / Flex bwd": lambda r: r.get("ours_bwd_vs_flex"),
    "rel. norm vs ours (out, dq, dk, dv)": lambda r: _errs(r.get("rel_norm_vs_ours")),
    "error": lambda r: r.get("error"),
}
TRAIN_COLUMNS = {
    "ran": lambda r: r["ran"],
    "variant": lambda r: r["variant"],
    "L": lambda r: r.get("L"),
    "step ms (fwd + bwd)": lambda r: r.get("step_ms"),
    "peak GiB": lambda r: r.get("peak_gib"),
    "error": lambda r: r.get("error"),
}
SECTIONS = [
    ("a", "(a) correctness against the fp32 PyTorch path", CHECK_COLUMNS),
    ("peer", "dense peers: one causal SDPA call per document, TFLOP/s per q-k pair", PEER_COLUMNS),
    ("b", "(b) our kernels, TFLOP/s per computed block pair", SPEED_COLUMNS),
    ("flex", "FlexAttention on the same block tables", FLEX_COLUMNS),
    ("c", "(c) one GPU, forward + backward", TRAIN_COLUMNS),
]


def markdown(rows: list[dict]) -> str:
    """The tables of docs/results.md from the rows of one or more runs."""
    lines = []
    for r in rows:
        if r["part"] == "run":
            env = r.get("env", {})
            lines.append(f"device: {r['device']}; " + ", ".join(f"{k} {v}" for k, v in env.items()))
        elif r["part"] == "end":
            lines.append(f"stopped: {r['reason']} after {r['rows']} rows")
    for part, title, columns in SECTIONS:
        chosen = [r for r in rows if r["part"] == part]
        if chosen:
            lines += ["", f"{title}:", "", *_table(chosen, columns)]
    return "\n".join(lines)
