"""The `[model]` section: which model to build. It lives with the model; the trainer's
config only holds it, and the model spec is derived from it (with `[sparse_attention]`)
where the trainer is built, never stored (`derive_model_spec`)."""

from __future__ import annotations

from dataclasses import dataclass

from sb_titan.models.dims import FamilyName
from sb_titan.models.flavors import Flavor


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The `[model]` section: which model to build."""

    family: FamilyName | None = None
    """`qwen2_5` (also Qwen2), `qwen3` (dense) or `llama3` (3, 3.1, 3.2); None: an HF
    initial load's config.json model_type, else qwen2_5."""
    flavor: Flavor = "debug"
    """Model size: `debug` (tiny, for CPU), a released size of the family, or `hf`: the
    model an HF initial load's config.json describes, whatever its size."""
    tie_embeddings: bool | None = None
    """Override the flavor's tying (pipeline parallelism needs untied)."""
    rope_theta: float | None = None
    """Override the flavor's RoPE base (None: the flavor's, or an HF initial load's)."""
    norm_eps: float | None = None
    """Override the flavor's RMSNorm epsilon (None: the flavor's, or an HF initial load's)."""
    max_seq_len: int | None = None
    """Override the RoPE length (None: the flavor's, or an HF initial load's); at least
    training.seq_len. Exported as max_position_embeddings."""

    def __post_init__(self) -> None:
        for name in ("rope_theta", "norm_eps", "max_seq_len"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} = {value!r}: expected a positive number")
