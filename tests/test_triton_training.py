"""The CUDA code path (Triton kernels, their autograd, DST budgets) inside real training
steps on the CPU, under the Triton interpreter: two ranks, DST on, losses equal to the
PyTorch backend's."""

from __future__ import annotations

import pytest
from conftest import losses, scalars, torchrun

pytestmark = pytest.mark.torchrun

ARGS = ["--training.seq_len", "256", "--training.steps", "2", "--dst.enabled"]
ARGS += ["--cost_model.analytic_device", "cpu", "--dst.beta0", "0.6", "--dst.beta_min", "0.3"]
ARGS += ["--sparse_attention.policy", "topk"]
INTERPRETER = {"TRITON_INTERPRET": "1", "SB_TRITON_UPCAST": "1"}


def test_triton_backend_trains_like_the_torch_backend(tmp_path):
    runs = {}
    for backend in ("torch", "triton"):
        dump = tmp_path / backend
        args = [*ARGS, "--sparse_attention.backend", backend]
        # the torch backend never imports the kernels: its ranks fork from this process's
        # server; the Triton run needs the interpreter on before Triton is imported
        torchrun(2, args, dump, timeout=900, env=INTERPRETER if backend == "triton" else None)
        runs[backend] = dump
    a, b = losses(runs["torch"]), losses(runs["triton"])
    assert len(a) == len(b) == 2
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4, (a, b)
    density = scalars(runs["triton"], "sparsity/density")
    assert density and all(0 < d < 1 for d in density.values())  # really sparse
    budgets = scalars(runs["triton"], "dst/budget_mean")
    assert budgets and all(b < 1 for b in budgets.values())
