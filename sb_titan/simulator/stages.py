"""Each pipeline stage's cost model, split as TorchTitan splits the model."""

from __future__ import annotations

from dataclasses import dataclass

from sb_titan.balance.cost_model import (
    CostModel,
    DensityModel,
    analytic_stage_spec,
)
from sb_titan.models.dims import ModelDims
from sb_titan.simulator.cluster import Cluster


@dataclass(frozen=True, slots=True)
class StageSplit:
    """Layers per global stage as TorchTitan splits them, and where embedding/head live."""

    layers: tuple[int, ...]
    embedding: tuple[bool, ...]
    head: tuple[bool, ...]


def stage_split(
    n_layers: int, n_stages: int, first_less: int = 1, last_less: int = 1
) -> StageSplit:
    """TorchTitan's own split (compat.pipelining.llm_stage_modules): the first and last
    stages take `*_less` fewer layers for the embedding and the output head."""
    from sb_titan.compat.pipelining import llm_stage_modules

    parts = llm_stage_modules(n_stages, n_layers, first_less, last_less)
    return StageSplit(
        layers=tuple(sum(m.startswith("layers.") for m in p) for p in parts),
        embedding=tuple("tok_embeddings" in p for p in parts),
        head=tuple(s == n_stages - 1 for s in range(n_stages)),
    )


def stage_param_count(dims: ModelDims, layers: int, embedding: bool, head: bool) -> int:
    """Parameters whose gradients a stage reduces (q/k/v/o, SwiGLU, embedding, head)."""
    proj = dims.dim * dims.head_dim * (2 * dims.n_heads + 2 * dims.n_kv_heads)
    params = layers * (proj + 3 * dims.dim * dims.hidden_dim)
    tied_whole_model = embedding and head and dims.tie_embeddings
    params += dims.vocab_size * dims.dim * (int(embedding) + int(head) - int(tied_whole_model))
    return params


@dataclass
class CostModels:
    """`planning`: the slowest pipeline rank's model, what SAB and DST see (DESIGN.md:
    DST's unit under PP is the micro-batch on the slowest stage). `stages`: one per
    global stage, for the replay; `scale` multiplies their predictions."""

    planning: CostModel
    stages: list[CostModel]
    scale: float
    params: list[int]  # per pipeline rank
    description: str


def build_cost_models(
    dims: ModelDims,
    cluster: Cluster,
    *,
    device: str | None,
    profile: str | None,
    block_size: int,
    beta0: float,
    policy: str,
    density_exponent: float = 1.0,
    first_less: int = 1,
    last_less: int = 1,
) -> CostModels:
    """Per-stage analytic models, or one measured profile for every stage."""
    split = stage_split(dims.n_layers, cluster.n_stages, first_less, last_less)
    pp = cluster.pp
    rank_of = [s % pp for s in range(cluster.n_stages)]
    params = [0] * pp
    for s, r in enumerate(rank_of):
        params[r] += stage_param_count(dims, split.layers[s], split.embedding[s], split.head[s])
    density = DensityModel(prior_exponent=density_exponent)
    if profile is not None:
        cm = CostModel.from_file(profile, density_model=density)
        desc = f"profile {profile} (one stage; every rank, 1/{cluster.virtual_stages} per chunk)"
        return CostModels(cm, [cm] * cluster.n_stages, 1.0 / cluster.virtual_stages, params, desc)
    if device is None:
        raise ValueError("need an analytic device or a profile")
    cache: dict[tuple[int, bool], CostModel] = {}

    def model(layers: int, head: bool) -> CostModel:
        if (layers, head) not in cache:
            spec = analytic_stage_spec(dims, layers, head, device, block_size)
            cache[(layers, head)] = CostModel.analytic(spec, density_model=density)
        return cache[(layers, head)]

    stages = [model(split.layers[s], split.head[s]) for s in range(cluster.n_stages)]
    per_rank = [
        (
            sum(split.layers[s] for s in range(cluster.n_stages) if rank_of[s] == r),
            any(split.head[s] for s in range(cluster.n_stages) if rank_of[s] == r),
        )
        for r in range(pp)
    ]
    row = [cluster.seq_len]
    slowest = max(per_rank, key=lambda lh: model(*lh).predict_budget(row, beta0, policy))
    desc = (
        f"analytic {device}: layers per stage {list(split.layers)}, head on the last; "
        f"planning/DST on the slowest rank ({slowest[0]} layers{', head' if slowest[1] else ''})"
    )
    return CostModels(model(*slowest), stages, 1.0, params, desc)
