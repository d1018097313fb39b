"""attention/backends.py: which implementation serves which device, decided in one place."""

from __future__ import annotations

import ast

import pytest
from conftest import REPO

from sb_titan.attention.backends import (
    check_estimator,
    estimator_for,
    resolve_backend,
    triton_runs_on,
)


def test_auto_is_triton_on_cuda_and_torch_elsewhere(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter does not make auto Triton
    assert resolve_backend("auto", "cuda") == "triton"
    assert resolve_backend("auto", "cpu") == "torch"
    assert [estimator_for(b, "cuda") for b in ("triton", "torch", "flex")] == [
        "triton",
        "torch",
        "triton",
    ]
    assert [estimator_for(b, "cpu") for b in ("triton", "torch", "flex")] == [
        "triton",
        "torch",
        "torch",
    ]


def test_triton_off_cuda_only_in_the_interpreter(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert triton_runs_on("cuda") and not triton_runs_on("cpu")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors .*TRITON_INTERPRET"):
        resolve_backend("triton", "cpu")
    with pytest.raises(ValueError, match="estimator='triton' needs CUDA tensors .*'torch'"):
        check_estimator("triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", "cpu") == "triton"
    check_estimator("triton", "cpu")


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        resolve_backend("cuda", "cuda")
    with pytest.raises(ValueError, match="unknown estimator 'fast'"):
        check_estimator("fast", "cpu")


def test_only_backends_reads_the_interpreter_switch() -> None:
    """The device rule lives in one module: no other sb_titan module reads
    TRITON_INTERPRET (docstrings aside)."""
    readers = []
    for path in sorted((REPO / "sb_titan").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            is_str = isinstance(node, ast.Constant) and node.value == "TRITON_INTERPRET"
            if is_str:
                readers.append(path.relative_to(REPO).as_posix())
    assert readers == ["sb_titan/attention/backends.py"]
