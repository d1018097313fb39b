"""The latency profile: what `sb-profile` measures and the cost model interpolates.

A JSON file of attention seconds over a (document length, density) grid plus the
token-linear part, with a fingerprint of the device, software and model it was
measured on. Every field is validated on load, naming the key (docs/cost_model.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sb_titan.util.files import write_atomic

PROFILE_FORMAT = "sb_titan.profile"


PROFILE_VERSION = 1


MIN_SECONDS = 1e-12  # floor for table entries, so log-length interpolation stays finite


class ProfileError(ValueError):
    """A latency profile that cannot be used: corrupt, incomplete or mismatched."""


class ProfileNotFoundError(ProfileError, FileNotFoundError):
    """No profile at the configured path."""


def missing_profile_message(path: str | os.PathLike) -> str:
    return (
        f"no latency profile at {path}. Measure one on the target device with "
        f"`sb-profile --config <config.toml> --out {path}`, or explicitly request the "
        "FLOP-based analytic fallback."
    )


def _number(value: object, key: str, source: str) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value):
        raise ProfileError(f"{source}: key '{key}': expected a finite number, got {value!r}")
    if value < 0:
        raise ProfileError(f"{source}: key '{key}': must be >= 0, got {value!r}")
    return float(value)


def _integer(value: object, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ProfileError(f"{source}: key '{key}': expected a positive integer, got {value!r}")
    return value


def _grid(value: object, key: str, source: str, item) -> list:
    """A strictly increasing list of at least two entries."""
    if not isinstance(value, list) or len(value) < 2:
        raise ProfileError(f"{source}: key '{key}': expected a list of at least 2 entries")
    out = [item(v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if any(b <= a for a, b in zip(out, out[1:], strict=False)):
        raise ProfileError(f"{source}: key '{key}': must be strictly increasing, got {out}")
    return out


def _row(value: object, key: str, source: str, n: int) -> list[float]:
    if not isinstance(value, list) or len(value) != n:
        raise ProfileError(f"{source}: key '{key}': expected a list of {n} numbers")
    return [_number(v, f"{key}[{i}]", source) for i, v in enumerate(value)]


@dataclass
class Profile:
    """Measured latencies of one pipeline stage (or the whole model) on one device.

    attn_seconds[i][j]: fwd+bwd seconds of the stage's attention for ONE document of
    lengths[i] tokens at density densities[j] (marginal cost: measured on a micro-batch
    packed with copies of that document, divided by their count, so per-launch costs
    stay in `overhead_seconds`). linear_seconds[k]: fwd+bwd seconds of everything else
    for a micro-batch of linear_tokens[k] tokens, excluding the fixed overhead.
    """

    fingerprint: dict[str, Any]
    block_size: int
    lengths: list[int]
    densities: list[float]
    attn_seconds: list[list[float]]
    linear_tokens: list[int]
    linear_seconds: list[float]
    overhead_seconds: float
    source: str = field(default="<memory>", compare=False)

    def __post_init__(self) -> None:
        src = self.source
        if not isinstance(self.fingerprint, dict) or not all(
            isinstance(k, str) for k in self.fingerprint
        ):
            raise ProfileError(f"{src}: key 'fingerprint': expected an object with string keys")
        self.block_size = _integer(self.block_size, "block_size", src)
        self.lengths = _grid(self.lengths, "lengths", src, _integer)
        self.densities = _grid(self.densities, "densities", src, _number)
        if self.densities[0] <= 0 or self.densities[-1] != 1.0:
            raise ProfileError(f"{src}: key 'densities': must lie in (0, 1] and end at 1.0")
        if not isinstance(self.attn_seconds, list) or len(self.attn_seconds) != len(self.lengths):
            raise ProfileError(
                f"{src}: key 'attn_seconds': expected {len(self.lengths)} rows (one per length)"
            )
        self.attn_seconds = [
            _row(r, f"attn_seconds[{i}]", src, len(self.densities))
            for i, r in enumerate(self.attn_seconds)
        ]
        self.linear_tokens = _grid(self.linear_tokens, "linear_tokens", src, _integer)
        self.linear_seconds = _row(
            self.linear_seconds, "linear_seconds", src, len(self.linear_tokens)
        )
        self.overhead_seconds = _number(self.overhead_seconds, "overhead_seconds", src)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "fingerprint": self.fingerprint,
            "block_size": self.block_size,
            "lengths": self.lengths,
            "densities": self.densities,
            "attn_seconds": self.attn_seconds,
            "linear_tokens": self.linear_tokens,
            "linear_seconds": self.linear_seconds,
            "overhead_seconds": self.overhead_seconds,
        }

    @classmethod
    def from_dict(cls, data: object, source: str = "<memory>") -> Profile:
        if not isinstance(data, dict):
            raise ProfileError(f"{source}: expected a JSON object at the top level")
        keys = ("format", "version", "fingerprint", "block_size", "lengths", "densities")
        keys += ("attn_seconds", "linear_tokens", "linear_seconds", "overhead_seconds")
        for key in keys:
            if key not in data:
                raise ProfileError(f"{source}: missing key '{key}' (re-run `sb-profile`)")
        if data["format"] != PROFILE_FORMAT:
            raise ProfileError(f"{source}: key 'format': expected {PROFILE_FORMAT!r}")
        if data["version"] != PROFILE_VERSION:
            raise ProfileError(
                f"{source}: key 'version': expected {PROFILE_VERSION}, got {data['version']!r}"
            )
        return cls(**{k: data[k] for k in keys[2:]}, source=source)

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically, so an interrupted profiler never leaves a truncated file."""
        write_atomic(path, json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ProfileNotFoundError(missing_profile_message(path)) from None
        except UnicodeDecodeError as e:
            raise ProfileError(f"{path}: not a UTF-8 JSON profile ({e.reason})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(
                f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                "the file is corrupted or truncated, re-run `sb-profile`"
            ) from None
        return cls.from_dict(data, source=str(path))

    def digest(self) -> str:
        """Content hash: calibration state is only valid for the profile it was fit on."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha1(blob).hexdigest()
