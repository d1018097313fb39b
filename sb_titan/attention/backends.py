"""Which implementation serves which device: the one place that decides.

- attention, `backend="auto"`: on CUDA `triton`, the kernels (`sb_titan_kernels`);
  elsewhere `torch`, the PyTorch path (attention/block_sparse.py).
- selection's estimator: follows the attention backend, so one run selects with one
  implementation per device: the estimator and block-max kernels with `triton`, their
  PyTorch versions (attention/estimator.py, `block_max_naive`) with `torch`.
- `backend="flex"`: compiled FlexAttention on any device, forward only off CUDA.

`triton` off CUDA runs only in Triton's interpreter (`TRITON_INTERPRET=1`, which Triton
reads when the kernels are first imported): that is how the tests run the kernels on a
CPU, against the naive PyTorch references beside them (kernels/*_naive.py). Asked for
without it, it is refused with one line naming both ways out.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Literal, get_args

Backend = Literal["auto", "torch", "triton", "flex"]  # a Literal: the CLI help lists them
BACKENDS: tuple[str, ...] = get_args(Backend)
#: what the block-sparse custom ops run (flex attends through its own function)
OP_BACKENDS: tuple[str, ...] = ("torch", "triton")
ESTIMATORS: tuple[str, ...] = ("torch", "triton")


def triton_runs_on(device_type: str) -> bool:
    """The Triton kernels run on `device_type`: CUDA, or anything in the interpreter."""
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _check_triton(what: str, device_type: str) -> None:
    if not triton_runs_on(device_type):
        raise ValueError(
            f"{what}='triton' needs CUDA tensors (got {device_type}); set TRITON_INTERPRET=1 "
            f"to run the kernels in the interpreter, or use {what}='torch'"
        )


def resolve_backend(backend: str, device_type: str) -> str:
    """What `backend` runs on tensors of `device_type`: `auto` is Triton on CUDA and
    PyTorch elsewhere; Triton off CUDA only in the interpreter (TRITON_INTERPRET=1);
    `flex` (compiled FlexAttention) on any device, but off CUDA forward only."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device_type == "cuda" else "torch"
    if backend == "triton":
        _check_triton("backend", device_type)
    return backend


def estimator_for(backend: str, device_type: str) -> str:
    """The selection estimator a resolved backend uses: one selection per device (`flex`
    on CUDA attends over the table `triton` would use)."""
    on_gpu = backend == "triton" or (backend == "flex" and device_type == "cuda")
    return "triton" if on_gpu else "torch"


def check_estimator(estimator: str, device_type: str) -> None:
    """Raise if `estimator` is unknown, or is Triton where the kernels cannot run."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {ESTIMATORS}")
    if estimator == "triton":
        _check_triton("estimator", device_type)


def kernels() -> ModuleType:
    """`sb_titan_kernels`, imported on first use: importing it imports Triton, which a
    CPU-only run never needs."""
    import sb_titan_kernels

    return sb_titan_kernels
