"""Every family's flavor table, by family name: what `[model] family` / `flavor` can
name. The tables are plain data (models/<family>/flavors.py)."""

from __future__ import annotations

from typing import Literal

from sb_titan.models.dims import ModelDims
from sb_titan.models.llama3.flavors import FLAVORS as LLAMA3
from sb_titan.models.qwen2_5.flavors import FLAVORS as QWEN2_5
from sb_titan.models.qwen3.flavors import FLAVORS as QWEN3

FAMILY_FLAVORS: dict[str, dict[str, ModelDims]] = {
    "qwen2_5": QWEN2_5,
    "qwen3": QWEN3,
    "llama3": LLAMA3,
}
HF_FLAVOR = "hf"
"""The flavor that builds what an HF initial load's config.json describes."""
# `[model] flavor`: the CLI help and TOML errors list them.
Flavor = Literal[tuple(dict.fromkeys(n for t in FAMILY_FLAVORS.values() for n in t)) + (HF_FLAVOR,)]


def family_flavors(family: str) -> dict[str, ModelDims]:
    """`family`'s flavor table (ValueError naming the section key if unknown)."""
    if family not in FAMILY_FLAVORS:
        raise ValueError(
            f"model.family: {family!r} is not one of {sorted(FAMILY_FLAVORS)} "
            "(mixture-of-experts models are not supported)"
        )
    return FAMILY_FLAVORS[family]
