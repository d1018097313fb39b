"""What is simulated: the cluster (DP x PP shape, schedule, rows, network) and the
scenario (model, data, planner and DST settings)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sb_titan.balance.dst import DSTConfig
from sb_titan.balance.sab import SABConfig
from sb_titan.models.dims import ModelDims
from sb_titan.models.flavors import family_flavors

SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe")


@dataclass(frozen=True, slots=True)
class Network:
    """Communication: activations between pipeline stages, gradients across DP ranks,
    K/V across the ranks of a context-parallel group."""

    p2p_gbps: float = 100.0  # GB/s per stage boundary (NVLink within a node)
    p2p_latency_s: float = 20e-6
    allreduce_gbps: float = 50.0  # GB/s per GPU for the ring (400 Gb/s InfiniBand)
    allreduce_latency_s: float = 100e-6
    activation_bytes: int = 2  # bf16 activations and activation gradients
    grad_bytes: int = 4  # fp32 gradient reduction (TorchTitan's default reduce dtype)
    cp_gbps: float = 100.0  # GB/s per GPU for CP's ring collectives (NVLink within a node)
    cp_latency_s: float = 20e-6  # per ring hop
    kv_bytes: int = 2  # bf16 K/V and their gradients

    def send_seconds(self, tokens: np.ndarray, hidden: int) -> np.ndarray:
        """One micro-batch's activations (or their gradient) across a stage boundary."""
        return self.p2p_latency_s + tokens * hidden * self.activation_bytes / (self.p2p_gbps * 1e9)

    def allreduce_seconds(self, params: int, dp: int) -> float:
        """Ring all-reduce of one pipeline rank's gradients, not overlapped (worst case)."""
        if dp <= 1:
            return 0.0
        volume = 2 * (dp - 1) / dp * params * self.grad_bytes
        return self.allreduce_latency_s * 2 * (dp - 1) + volume / (self.allreduce_gbps * 1e9)

    def cp_bytes(self, tokens: int, kv_heads: int, head_dim: int, layers: int, cp: int) -> float:
        """Bytes one CP rank receives per row (fwd + bwd): per layer, the all-gather of
        K and V and the reduce-scatter of dK and dV, each (N-1)/N of the row's
        Hkv x D x L values for each of the two tensors."""
        if cp <= 1:
            return 0.0
        per_tensor = kv_heads * head_dim * tokens * self.kv_bytes * (cp - 1) / cp
        return 2 * 2 * per_tensor * layers  # {K, V} x {all-gather, reduce-scatter}

    def cp_seconds(self, tokens: int, kv_heads: int, head_dim: int, layers: int, cp: int) -> float:
        """Ring time of those collectives (two per layer: K/V travel stacked), not
        overlapped with compute (worst case)."""
        if cp <= 1:
            return 0.0
        volume = self.cp_bytes(tokens, kv_heads, head_dim, layers, cp)
        return 2 * layers * (cp - 1) * self.cp_latency_s + volume / (self.cp_gbps * 1e9)


@dataclass(frozen=True, slots=True)
class Cluster:
    dp: int
    pp: int
    microbatches: int
    schedule: str = "1F1B"
    virtual_stages: int = 1  # model chunks per pipeline rank (Interleaved1F1B: >= 2)
    rows: int = 1  # rows of seq_len tokens per micro-batch
    seq_len: int = 65536

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if min(self.dp, self.pp, self.microbatches, self.virtual_stages, self.rows) < 1:
            raise ValueError("dp, pp, microbatches, virtual_stages and rows must be >= 1")
        if self.schedule == "Interleaved1F1B" and self.virtual_stages < 2:
            raise ValueError("Interleaved1F1B needs virtual_stages >= 2")
        if self.schedule != "Interleaved1F1B" and self.virtual_stages != 1:
            raise ValueError(f"{self.schedule} runs one stage per rank (virtual_stages=1)")

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def gpus(self) -> int:
        return self.dp * self.pp


@dataclass
class Scenario:
    """What a run needs besides the cluster: model, data, planner and DST settings."""

    family: str = "qwen2_5"
    flavor: str = "3b"
    dims: ModelDims | None = None
    """The dims a train config builds (its [model] overrides, an HF config.json);
    None: `family`'s `flavor` as its table has it."""
    lengths: np.ndarray | None = None  # None: longtail-v1 at seq_len
    data_name: str = "longtail-v1"
    seed: int = 0
    steps: int = 10
    sab: SABConfig = field(default_factory=SABConfig)
    dst: DSTConfig = field(default_factory=DSTConfig)
    selection: str = "mass"  # the budget's selection policy ([sparse_attention] policy)
    block_size: int = 64
    device: str | None = "h200"
    profile: str | None = None
    baseline_policy: str = "sequential"
    density_exponent: float = 1.0
    network: Network = field(default_factory=Network)
    bwd_over_fwd: float = 2.0
    first_less: int = 1
    last_less: int = 1
    recall_curves: str | None = None
    """Measured per-document recall curves (bench/recall_curves.py): DST's recall model
    learns their fit half, their held-out half scores every step (simulator/heldout.py)."""

    @property
    def model(self) -> ModelDims:
        """The model priced: `dims`, else the flavor table's row."""
        return self.dims if self.dims is not None else model_dims_of(self.family, self.flavor)

    @property
    def model_name(self) -> str:
        """How reports and titles name it: `qwen3 4b`, `llama3 hf`."""
        return f"{self.model.family} {self.flavor}"


def model_dims_of(family: str, flavor: str) -> ModelDims:
    """`family`'s `flavor` (ValueError in one line naming both if there is none)."""
    flavors = family_flavors(family)
    if flavor not in flavors:
        raise ValueError(f"unknown {family} flavor {flavor!r}; one of {sorted(flavors)}")
    return flavors[flavor]
