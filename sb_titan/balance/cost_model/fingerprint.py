"""Whether a profile describes this run: its fingerprint against the run's.

Two kinds of difference. A profile timed for another model shape or stage layout
prices the wrong work (other layers, widths, heads, or other modules in the timed
stage): refused unless the config says otherwise (`cost_model.allow_shape_mismatch`).
A profile timed on another driver, torch, device or clock prices the same work at
another speed, which the online refit absorbs as two scales: a warning.
"""

from __future__ import annotations

import logging
from typing import Any

from sb_titan.balance.cost_model.profile import ProfileError

logger = logging.getLogger(__name__)

MODEL_SHAPE_KEYS = (
    "family",
    "flavor",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "intermediate",
    "vocab_size",
    "layers",
)
"""The model's family and dimensions (profiler/fingerprint.py writes them)."""
STAGE_LAYOUT_KEYS = ("pp_degree", "pp_stage", "scope", "stage_modules", "stage_dense_layers")
"""Which modules the profile timed, and which of them were dense."""
SHAPE_KEYS = MODEL_SHAPE_KEYS + STAGE_LAYOUT_KEYS

_MISSING = object()
LEGACY_DEFAULTS = {"family": "qwen2_5"}
"""Keys a profile written before they existed lacks, and what it was measured on: the
recipe trained only Qwen2.5 before it had families."""


def with_legacy_defaults(fp: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """A profile's fingerprint with the keys `expected` checks that older profiles lack
    filled in."""
    return {**{k: v for k, v in LEGACY_DEFAULTS.items() if k in expected}, **fp}


def fingerprint_diffs(have: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """Keys of `expected` whose value in `have` (the profile's) differs, sorted."""
    have = with_legacy_defaults(have, expected)
    return [k for k in sorted(expected) if have.get(k, _MISSING) != expected[k]]


def _shape(fp: dict[str, Any], extra: list[str]) -> str:
    """A fingerprint's model dimensions, and the other differing shape keys."""
    keys = [k for k in MODEL_SHAPE_KEYS if k in fp] + extra
    return " ".join(f"{k}={fp.get(k, '<missing>')}" for k in keys).replace(", ", ",")


def check_fingerprint(
    source: str,
    have: dict[str, Any],
    expected: dict[str, Any],
    strict: bool = False,
    allow_shape_mismatch: bool = False,
) -> list[str]:
    """The differing keys. Raises ProfileError (one line naming `source` and both
    shapes) on a shape difference unless allowed, and on any difference under strict;
    warns for the rest."""
    have = with_legacy_defaults(have, expected)
    diffs = fingerprint_diffs(have, expected)
    if not diffs:
        return diffs
    detail = "; ".join(
        f"{k}: profile={have.get(k, '<missing>')!r} current={expected[k]!r}" for k in diffs
    )
    msg = f"{source}: profile fingerprint mismatch: {detail}"
    if strict:
        raise ProfileError(
            f"{msg} (cost_model.strict_fingerprint = true: re-run sb-profile for "
            "this config, or set it false to only warn)"
        )
    shape = [k for k in diffs if k in SHAPE_KEYS]
    if shape and not allow_shape_mismatch:
        extra = [k for k in shape if k not in MODEL_SHAPE_KEYS]
        raise ProfileError(
            f"{source}: profile measured for another model shape: profile "
            f"[{_shape(have, extra)}], this run [{_shape(expected, extra)}]; re-run "
            "`sb-profile --config <this config> --out <path>`, or set "
            "cost_model.allow_shape_mismatch = true to train with it anyway"
        )
    if shape:
        msg += " (another model shape, used anyway: cost_model.allow_shape_mismatch = true)"
    logger.warning(msg)
    return diffs
