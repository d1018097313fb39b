"""A FLOP-based stand-in for a measured profile (explicit opt-in, or simulations at
cluster scale): the same table shape, filled from peak FLOP/s and efficiencies."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from sb_titan.balance.cost_model.blocks import block_pairs
from sb_titan.balance.cost_model.profile import Profile

if TYPE_CHECKING:  # a name only: the cost model runs without the model code
    from sb_titan.models.dims import ModelDims


@dataclass(frozen=True)
class AnalyticSpec:
    """Inputs of the FLOP-based model: one stage's dims and assumed device efficiencies.

    Defaults describe an H100/H200 SXM (989 TFLOP/s dense BF16). attn_efficiency is the
    block-sparse kernel's share of peak at any density (the ideal 1/rho speedup);
    gemm_efficiency the share reached by the projections and the MLP.
    """

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int  # layers on this stage
    vocab_size: int = 0  # > 0: the stage holds the output projection
    block_size: int = 64
    peak_flops: float = 989e12
    gemm_efficiency: float = 0.6
    attn_efficiency: float = 0.4
    overhead_seconds: float = 1e-3
    device_name: str = "analytic"

    def __post_init__(self) -> None:
        dims = ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "layers", "block_size")
        for name in dims:
            if getattr(self, name) < 1:
                raise ValueError(f"AnalyticSpec.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("gemm_efficiency", "attn_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"AnalyticSpec.{name} must lie in (0, 1]")
        if self.peak_flops <= 0 or self.overhead_seconds < 0 or self.vocab_size < 0:
            raise ValueError("AnalyticSpec: need peak_flops > 0, overhead_seconds >= 0, vocab >= 0")


_ANALYTIC_DENSITIES = [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0]


def analytic_profile(spec: AnalyticSpec) -> Profile:
    """A Profile computed from FLOPs instead of measured (explicit opt-in only)."""
    b = spec.block_size
    # Per causal block pair, head and layer: QK^T and PV forward (2 GEMMs) plus five
    # backward GEMMs (FlashAttention-2 recomputes S), 2 FLOPs per multiply-add.
    pair_flops = 14 * b * b * spec.head_dim * spec.heads * spec.layers
    attn_rate = spec.peak_flops * spec.attn_efficiency
    lengths = [b * 2**k for k in range(int(math.log2(131072 // b)) + 1)]
    pairs = block_pairs(np.array(lengths), b)
    attn = [[float(p * rho * pair_flops / attn_rate) for rho in _ANALYTIC_DENSITIES] for p in pairs]
    proj = spec.hidden * spec.head_dim * (2 * spec.heads + 2 * spec.kv_heads)
    params = spec.layers * (proj + 3 * spec.hidden * spec.intermediate)
    params += spec.vocab_size * spec.hidden
    gemm_rate = spec.peak_flops * spec.gemm_efficiency
    tokens = [2**k for k in range(10, 21)]
    fingerprint = {"source": "analytic", **asdict(spec)}
    return Profile(
        fingerprint=fingerprint,
        block_size=b,
        lengths=lengths,
        densities=list(_ANALYTIC_DENSITIES),
        attn_seconds=attn,
        linear_tokens=tokens,
        linear_seconds=[6.0 * params * t / gemm_rate for t in tokens],
        overhead_seconds=spec.overhead_seconds,
        source=f"analytic:{spec.device_name}",
    )


ANALYTIC_DEVICES: dict[str, dict[str, float]] = {
    # Dense BF16 peak; efficiencies are assumptions (docs/cost_model.md), not measurements.
    "h100": {"peak_flops": 989e12, "gemm_efficiency": 0.6, "attn_efficiency": 0.4},
    "h200": {"peak_flops": 989e12, "gemm_efficiency": 0.62, "attn_efficiency": 0.42},
    # One CPU core in fp32: a rough order of magnitude, for wiring tests only.
    "cpu": {"peak_flops": 5e10, "gemm_efficiency": 0.5, "attn_efficiency": 0.2},
}
AnalyticDevice = Literal[tuple(ANALYTIC_DEVICES)]  # the CLI help lists them


def analytic_spec(
    device: str,
    *,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    layers: int,
    vocab_size: int = 0,
    block_size: int = 64,
) -> AnalyticSpec:
    return AnalyticSpec(
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        layers=layers,
        vocab_size=vocab_size,
        block_size=block_size,
        device_name=f"analytic-{device}",
        **ANALYTIC_DEVICES[device],
    )


def analytic_stage_spec(
    dims: ModelDims, layers: int, head: bool, device: str, block_size: int
) -> AnalyticSpec:
    """The analytic spec of one pipeline stage of the model `dims` describes, whatever its
    family (head_dim as set, which Qwen3 sets apart from dim / n_heads); `head`: the
    stage holds the output projection."""
    return analytic_spec(
        device,
        hidden=dims.dim,
        heads=dims.n_heads,
        kv_heads=dims.n_kv_heads,
        head_dim=dims.head_dim,
        intermediate=dims.hidden_dim,
        layers=max(layers, 1),
        vocab_size=dims.vocab_size if head else 0,
        block_size=block_size,
    )
