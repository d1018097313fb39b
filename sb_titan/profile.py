"""`sb-profile`: measure one pipeline stage on this device -> a cost-model Profile.

The cost model (sb_titan/cost_model.py) predicts a micro-batch's fwd+bwd seconds as
overhead + linear(tokens) + sum over documents of attn(L, rho). This module measures
those terms on the device it runs on, for the stage the trainer runs:

  * attention: the stage's inner attention (dense layers, estimator and selection
    included), fwd+bwd on `rows` rows of `row_len` tokens packed with k copies of an
    L-token document at topk budget rho, divided by k. One layer of each kind (dense,
    sparse) is timed and multiplied by how many the stage has: they do identical work.
  * linear: the stage with its inner attention swapped for an O(tokens) stand-in, at
    several token counts; a fitted line's intercept is the overhead.

`scope` says what "the stage" is. `blocks` (default): its decoder blocks only, which is
what the trainer's clock measures (sb_titan/measure.py), so the online refit compares
like with like. `stage`: also the embedding, final norm, output head and loss where the
stage holds them. All grid points, attention and linear, are timed round-robin (each
point once per pass), so a change in machine load spreads over the whole profile
instead of bending the part that happened to be timed during it.
docs/cost_model.md ("Measuring a profile") gives the reasons for each choice.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from sb_titan.attention.layout import AttnMeta
from sb_titan.attention.module import SBAttention
from sb_titan.attention.selection import select_blocks
from sb_titan.balance.cost_model import CostModel, Profile, ProfileError

logger = logging.getLogger(__name__)

DEFAULT_DENSITIES = (0.1, 0.25, 0.5, 1.0)
LINEAR_FRACTIONS = (0.25, 0.5, 0.75, 1.0)  # token grid: these shares of a micro-batch
MIN_LENGTH = 16  # the shortest document the data pipeline emits (longtail-v1 MIN_LEN)
CPU_MAX_STAGE_PARAMS = 60_000_000  # beyond this a CPU grid takes hours, not minutes
SCOPES = ("blocks", "stage")
CLOCKS = ("wall", "cpu")
PROFILE_POLICY = "topk"  # realised density == budget (above the forced blocks)
_IO_MODULES = ("tok_embeddings", "norm", "lm_head")


class ProfilerError(ValueError):
    """A profiling request that cannot run here; the message says what to change."""


# ------------------------------------------------------------------------------ stage


def stage_module_names(config: Any, stage: int) -> list[str]:
    """Module FQNs of pipeline stage `stage`, split exactly as TorchTitan's pipeline_llm
    splits the model (first/last stage carry the embedding/head and fewer layers)."""
    p = config.parallelism
    model_cfg = config.model_spec.model
    n_layers = len(model_cfg.layers)
    if p.pipeline_parallel_degree <= 1:
        if stage != 0:
            raise ProfilerError(f"--stage {stage}: the config has no pipeline parallelism")
        return ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "lm_head"]
    parts = p.module_fqns_per_model_part
    if parts is None:
        from torchtitan.distributed.pipeline_parallel import (
            _generate_llm_fqn_per_model_part,
            _get_pipeline_metadata,
        )

        dims = SimpleNamespace(pp=p.pipeline_parallel_degree)
        try:
            n_stages, n_layers, w_in, w_out = _get_pipeline_metadata(dims, p, model_cfg)
            parts = _generate_llm_fqn_per_model_part(n_stages, n_layers, w_in, w_out)
        except ValueError as e:
            raise ProfilerError(f"[parallelism] {e}") from None
    if not 0 <= stage < len(parts):
        raise ProfilerError(f"--stage {stage}: the pipeline has stages 0..{len(parts) - 1}")
    return list(parts[stage])


def _layer_ids(modules: Sequence[str]) -> list[int]:
    return [int(m.split(".")[1]) for m in modules if m.startswith("layers.")]


def scoped_modules(modules: Sequence[str], scope: str) -> list[str]:
    """The modules a profile of `scope` times."""
    if scope not in SCOPES:
        raise ProfilerError(f"--scope: {scope!r} is not one of {SCOPES}")
    return [m for m in modules if scope == "stage" or m not in _IO_MODULES]


def profile_dtype(config: Any, device: torch.device) -> torch.dtype:
    """The compute dtype of training: FSDP's param dtype on GPU, fp32 on CPU."""
    if device.type == "cpu":
        return torch.float32
    name = config.training.mixed_precision_param
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ProfilerError(f"training.mixed_precision_param: unknown dtype {name!r}")
    return dtype


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _backend(config: Any, device: torch.device) -> str:
    """The attention implementation `auto` resolves to on this device."""
    backend = config.sparse_attention.backend
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend


def current_fingerprint(
    config: Any,
    stage: int = 0,
    device: torch.device | str | None = None,
    scope: str = "blocks",
) -> dict[str, Any]:
    """What a profile must have been measured on to describe this run.

    The trainer passes it to CostModel.check_fingerprint. Every rank checks against
    the same stage (the one whose profile DST uses), not its own; `scope` is what the
    trainer's clock measures (decoder blocks, sb_titan/measure.py).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    modules = scoped_modules(stage_module_names(config, stage), scope)
    model_cfg = config.model_spec.model
    attn = model_cfg.layers[0].attention
    layers = _layer_ids(modules)
    dense = [i for i in layers if not model_cfg.layers[i].attention.inner_attention.sparse]
    fp = {
        "device_type": device.type,
        "device_name": _device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "dtype": str(profile_dtype(config, device)).removeprefix("torch."),
        "attention_backend": _backend(config, device),
        "block_size": config.sparse_attention.block_size,
        "flavor": config.model.flavor,
        "hidden": model_cfg.dim,
        "heads": attn.n_heads,
        "kv_heads": attn.n_kv_heads,
        "head_dim": attn.head_dim,
        "intermediate": model_cfg.layers[0].feed_forward.w1.out_features,
        "vocab_size": model_cfg.vocab_size,
        "layers": len(model_cfg.layers),
        "pp_degree": config.parallelism.pipeline_parallel_degree,
        "pp_stage": stage,
        "scope": scope,
        "stage_modules": modules,
        "stage_dense_layers": dense,
        "row_len": config.training.seq_len,
    }
    if device.type == "cpu":
        fp["cpu_threads"] = torch.get_num_threads()
    return fp


def stage_params(config: Any, modules: Sequence[str]) -> int:
    """Parameters of the modules, counted on the meta device (allocates nothing)."""
    with torch.device("meta"):
        model = config.model_spec.model.build()
    return sum(
        p.numel()
        for name, p in model.named_parameters()
        if any(name == m or name.startswith(m + ".") for m in modules)
    )


def check_supported(config: Any, modules: Sequence[str], device: torch.device) -> None:
    """Refuse a stage this device cannot profile in reasonable time or memory."""
    n = stage_params(config, modules)
    flavor = config.model.flavor
    if device.type == "cpu" and n > CPU_MAX_STAGE_PARAMS:
        raise ProfilerError(
            f"model.flavor {flavor!r}: the stage has {n / 1e6:.0f}M parameters, too many to "
            f"profile on CPU (limit {CPU_MAX_STAGE_PARAMS / 1e6:.0f}M: the grid would take "
            "hours). Profile it on its target GPU, or use a smaller flavor here "
            "(--model.flavor debug)."
        )
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        need = n * 16  # weights, grads and fp32 copies, with room for activations
        if need > free:
            raise ProfilerError(
                f"model.flavor {flavor!r}: the stage ({n / 1e6:.0f}M parameters) needs about "
                f"{need / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free on {_device_name(device)}. "
                "Use a smaller flavor or more pipeline stages."
            )


def build_stage(config: Any, modules: Sequence[str], device: torch.device) -> nn.Module:
    """The listed modules only, on `device`, with topk selection (exact densities)."""
    from sb_titan.models.qwen2_5 import model_registry

    attention = dataclasses.replace(config.sparse_attention, policy=PROFILE_POLICY)
    spec = model_registry(
        config.model.flavor, attention=attention, tie_embeddings=config.model.tie_embeddings
    )
    with torch.device("meta"):
        model = spec.model.build()
    keep = set(modules)
    for name in [n for n in model.layers if f"layers.{n}" not in keep]:
        del model.layers[name]
    for name in _IO_MODULES:
        if name not in keep:
            setattr(model, name, None)
    model.enable_weight_tying = model.enable_weight_tying and {"tok_embeddings", "lm_head"} <= keep
    model.to_empty(device=device)
    dtype = profile_dtype(config, device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
        for p in model.parameters():  # as FSDP's mixed precision: parameters, not buffers
            p.data = p.data.to(dtype)
    return model


def attention_kinds(model: nn.Module) -> list[tuple[SBAttention, int]]:
    """One representative per kind (dense, sparse) of the stage's inner attentions, and
    how many layers of that kind the stage has."""
    modules = [m for m in model.modules() if isinstance(m, SBAttention)]
    kinds = []
    for sparse in (False, True):
        same = [m for m in modules if m.config.sparse == sparse]
        if same:
            kinds.append((same[0], len(same)))
    return kinds


class TokenLinearAttention(nn.Module):
    """Stand-in inner attention for the linear measurement: O(tokens) work, and
    gradients reach q, k and v, so every projection's backward still runs."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False):
        return q + (k + v).repeat_interleave(q.shape[2] // k.shape[2], dim=2)


@contextlib.contextmanager
def attention_swapped(model: nn.Module, stand_in: nn.Module) -> Iterator[None]:
    """Temporarily replace every layer's inner attention by `stand_in`."""
    owners = [
        m for m in model.modules() if isinstance(getattr(m, "inner_attention", None), nn.Module)
    ]
    saved = [m.inner_attention for m in owners]
    for m in owners:
        m.inner_attention = stand_in
    try:
        yield
    finally:
        for m, inner in zip(owners, saved, strict=True):
            m.inner_attention = inner


# ------------------------------------------------------------------------- inputs


def doc_ids(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """[B, R] int32 document index per token from each row's document lengths."""
    out = [np.repeat(np.arange(len(r), dtype=np.int32), r) for r in rows]
    return torch.from_numpy(np.stack(out)).to(device)


def positions_of(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """[B, R] position within the document (what the loader emits)."""
    out = [np.concatenate([np.arange(n) for n in r]) for r in rows]
    return torch.from_numpy(np.stack(out)).to(device)


def packed_rows(doc_len: int, rows: int, row_len: int, shift: int = 0) -> list[list[int]]:
    """`rows` rows of row_len // doc_len copies of a doc_len-token document.

    shift > 0 starts the copies `shift` tokens into the row (a `shift`-token document
    first, the last copy cut short), so they straddle block boundaries as packed
    documents almost always do: a 64n-token document then spans n + 1 blocks, not n.
    """
    if row_len % doc_len:
        raise ProfilerError(f"document length {doc_len} must divide the row length {row_len}")
    k = row_len // doc_len
    if shift <= 0 or doc_len <= shift:
        return [[doc_len] * k] * rows
    return [[shift, *[doc_len] * (k - 1), doc_len - shift]] * rows


def _meta(rows: Sequence[Sequence[int]], budget: float, device: torch.device) -> AttnMeta:
    return AttnMeta(doc_ids(rows, device), torch.full((len(rows),), float(budget), device=device))


def make_stage_step(
    model: nn.Module,
    config: Any,
    rows: Sequence[Sequence[int]],
    budget: float,
    device: torch.device,
    seed: int = 0,
) -> Callable[[], None]:
    """A closure running the model's fwd+bwd on one micro-batch, as training does: from
    tokens where it holds the embedding, else from hidden states; cross-entropy where it
    holds the head, else backward of a random output gradient."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, R = len(rows), sum(rows[0])
    dtype = profile_dtype(config, device)
    dim, vocab = config.model_spec.model.dim, config.model_spec.model.vocab_size
    meta = _meta(rows, budget, device)
    positions = positions_of(rows, device)
    if model.tok_embeddings is not None:
        x = torch.randint(0, vocab, (B, R), generator=g).to(device)
    else:
        x = torch.randn(B, R, dim, generator=g).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (B, R), generator=g).to(device)
    grad = torch.randn(B, R, dim, generator=g).to(device, dtype)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        if x.requires_grad:
            x.grad = None
        out = model(x, positions=positions, attention_masks=meta)
        if model.lm_head is not None:
            F.cross_entropy(out.flatten(0, 1).float(), labels.flatten()).backward()
        else:
            out.backward(grad)

    return step


@dataclass(frozen=True)
class AttentionInputs:
    """q, k, v ([B, R, heads, head_dim], as GQAttention hands them over) and an output
    gradient; shared by every grid point, which differ only in layout and budget."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad: torch.Tensor

    @classmethod
    def random(cls, config: Any, rows: int, row_len: int, device: torch.device, seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        attn = config.model_spec.model.layers[0].attention
        dtype = profile_dtype(config, device)
        shapes = [(rows, row_len, h, attn.head_dim) for h in (attn.n_heads, attn.n_kv_heads)]
        q, k, v = (
            torch.randn(shapes[i], generator=g).to(device, dtype).requires_grad_()
            for i in (0, 1, 1)
        )
        return cls(q, k, v, torch.randn(shapes[0], generator=g).to(device, dtype))


def make_attention_step(
    module: SBAttention,
    inputs: AttentionInputs,
    rows: Sequence[Sequence[int]],
    budget: float,
) -> tuple[Callable[[], None], float]:
    """(fwd+bwd closure of one inner attention for this layout and budget, realised
    density of the point: 1.0 for a dense layer)."""
    q, k, v, grad = inputs.q, inputs.k, inputs.v, inputs.grad
    meta = _meta(rows, budget, q.device)
    scale, gqa = q.shape[-1] ** -0.5, q.shape[2] != k.shape[2]

    def step() -> None:
        for t in (q, k, v):
            t.grad = None
        module(q, k, v, attention_masks=meta, scale=scale, enable_gqa=gqa).backward(grad)

    density = 1.0
    if module.config.sparse:
        _, stats = select_blocks(
            q.detach().transpose(1, 2),
            k.detach().transpose(1, 2),
            meta.doc_id,
            meta.budget,
            policy=PROFILE_POLICY,
            block_size=module.config.block_size,
        )
        density = float(stats.density.mean())
    return step, density


# ------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], None], device: torch.device, clock: str = "wall") -> float:
    """Seconds of one call. clock="cpu": this process's CPU time (single-threaded CPU
    runs only), which other users' processes on a shared machine do not inflate."""
    if clock == "cpu":
        t0 = time.process_time()
        fn()
        return time.process_time() - t0
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


class Progress:
    """tqdm when installed, else one rewritten stderr line; silent when disabled."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self.total, self.desc, self.enabled, self.n = total, desc, enabled, 0
        self._bar = None
        if enabled:
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=desc, file=sys.stderr)

    def update(self, note: str = "") -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(1)
        elif self.enabled:
            end = "\n" if self.n == self.total else ""
            print(f"\r{self.desc}: {self.n}/{self.total} {note}", end=end, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def time_grid(
    steps: Sequence[Callable[[], None]],
    device: torch.device,
    warmup: int,
    repeats: int,
    progress: Progress,
    clock: str = "wall",
) -> list[list[float]]:
    """Per step, `repeats` timings, taken round-robin after `warmup` passes."""
    for w in range(warmup):
        for step in steps:
            step()
            progress.update(f"warm-up {w + 1}/{warmup}")
    times: list[list[float]] = [[] for _ in steps]
    for r in range(repeats):
        for i, step in enumerate(steps):
            times[i].append(time_once(step, device, clock))
            progress.update(f"pass {r + 1}/{repeats}")
    return times


# ------------------------------------------------------------------------ profiling


@dataclass(frozen=True, slots=True)
class ProfileSettings:
    """What to measure: grids, micro-batch shape, repetition, clock."""

    lengths: tuple[int, ...]
    densities: tuple[float, ...] = DEFAULT_DENSITIES
    rows: int = 2
    row_len: int = 4096
    repeats: int = 5
    warmup: int = 1
    clock: str = "wall"
    """`wall`, or `cpu` (process CPU time; CPU device with one thread only)."""
    scope: str = "blocks"

    def __post_init__(self) -> None:
        lengths = list(self.lengths)
        if len(lengths) < 2 or lengths != sorted(set(lengths)):
            raise ProfilerError(f"--lengths: need >= 2 increasing values, got {lengths}")
        bad = [n for n in lengths if n < 1 or self.row_len % n]
        if bad:
            raise ProfilerError(
                f"--lengths {bad}: every length must divide the row length "
                f"(training.seq_len = {self.row_len}); a row holds copies of one document"
            )
        dens = list(self.densities)
        if len(dens) < 2 or dens != sorted(set(dens)) or dens[0] <= 0 or dens[-1] != 1.0:
            raise ProfilerError(
                f"--densities: need >= 2 increasing values in (0, 1] ending at 1.0, got {dens}"
            )
        if self.rows < 1 or self.repeats < 1 or self.warmup < 0:
            raise ProfilerError("need rows >= 1, repeats >= 1, warmup >= 0")
        if self.clock not in CLOCKS:
            raise ProfilerError(f"--clock: {self.clock!r} is not one of {CLOCKS}")
        if self.scope not in SCOPES:
            raise ProfilerError(f"--scope: {self.scope!r} is not one of {SCOPES}")


def default_lengths(row_len: int, block_size: int) -> tuple[int, ...]:
    """MIN_LENGTH, then powers of two from one block up to the row length (each rounded
    down to a divisor of the row length, since a row holds copies of one document).

    Lengths below one block matter: short documents share blocks, so they cost less
    than the one block pair the cost model's below-grid rule would charge.
    """
    targets = [MIN_LENGTH] if MIN_LENGTH < block_size else []
    n = block_size
    while n < row_len:
        targets.append(n)
        n *= 2
    divisors = [d for d in range(1, row_len + 1) if row_len % d == 0]
    return tuple(sorted({max(d for d in divisors if d <= t) for t in [*targets, row_len]}))


def at_nominal(
    realised: Sequence[float], seconds: Sequence[float], grid: Sequence[float]
) -> list[float]:
    """Seconds at the grid's densities from seconds measured at realised densities.

    topk keeps at least the sink and diagonal blocks, so short documents realise more
    than the requested density; the table must still mean "seconds at density rho".
    Piecewise linear in the realised density, flat below the least realised one.
    """
    r, s = np.asarray(realised, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    order = np.argsort(r, kind="stable")
    r, s = r[order], s[order]
    r, first = np.unique(r, return_index=True)  # equal realised density: same work
    s = np.array([np.median(x) for x in np.split(s, first[1:])])
    return np.interp(np.asarray(grid, dtype=np.float64), r, s).tolist()


def fit_linear(tokens: Sequence[int], seconds: Sequence[float]) -> tuple[float, list[float]]:
    """(overhead, linear_seconds): a least-squares line's intercept (clamped at 0), and
    each measurement minus it (the contract in docs/cost_model.md)."""
    _, intercept = np.polyfit(np.asarray(tokens, float), np.asarray(seconds, float), 1)
    overhead = max(float(intercept), 0.0)
    return overhead, [max(float(s) - overhead, 0.0) for s in seconds]


@dataclass
class AttentionGrid:
    """The attention grid's points: (kind, length, budget), closures, realised densities."""

    kinds: list[tuple[SBAttention, int]]
    points: list[tuple[int, int, float]]
    steps: list[Callable[[], None]]
    realised: list[float]


def attention_grid(model, config, settings: ProfileSettings, device) -> AttentionGrid:
    """One point per (kind, length, budget); a dense layer needs one budget (no effect)."""
    kinds = attention_kinds(model)
    points = []
    for k, (module, _) in enumerate(kinds):
        budgets = settings.densities if module.config.sparse else (1.0,)
        points += [(k, n, rho) for n in settings.lengths for rho in budgets]
    inputs = AttentionInputs.random(config, settings.rows, settings.row_len, device)
    shift = config.sparse_attention.block_size // 2
    built = [
        make_attention_step(
            kinds[k][0], inputs, packed_rows(n, settings.rows, settings.row_len, shift), rho
        )
        for k, n, rho in points
    ]
    return AttentionGrid(kinds, points, [b[0] for b in built], [b[1] for b in built])


def attention_table(grid: AttentionGrid, times, settings: ProfileSettings) -> tuple[list, list]:
    """attn_seconds[i][j] = sum over kinds of layers * seconds(L_i, rho_j) / copies."""
    table = np.zeros((len(settings.lengths), len(settings.densities)))
    raw = []
    for k, (module, count) in enumerate(grid.kinds):
        mine = [p for p, point in enumerate(grid.points) if point[0] == k]
        per_len = len(mine) // len(settings.lengths)
        for i, n in enumerate(settings.lengths):
            copies = settings.rows * settings.row_len // n
            idx = mine[i * per_len : (i + 1) * per_len]
            secs = [statistics.median(times[p]) / copies for p in idx]
            real = [grid.realised[p] for p in idx]
            table[i] += count * np.asarray(at_nominal(real, secs, settings.densities))
            raw.append(
                {
                    "kind": "sparse" if module.config.sparse else "dense",
                    "layers": count,
                    "length": n,
                    "copies": copies,
                    "budgets": [grid.points[p][2] for p in idx],
                    "realised_density": real,
                    "seconds_per_doc_and_layer": secs,
                }
            )
    for module, _ in grid.kinds:
        module.reset_stats()
    return table.tolist(), raw


def linear_grid(model, config, settings, device) -> tuple[list[int], list[Callable[[], None]]]:
    """The stage with the O(tokens) stand-in attention at LINEAR_FRACTIONS of a
    micro-batch (shorter rows, so the largest point is the micro-batch itself)."""
    stand_in = TokenLinearAttention()
    tokens, steps = [], []
    for frac in LINEAR_FRACTIONS:
        row_len = max(MIN_LENGTH, round(settings.row_len * frac))
        tokens.append(settings.rows * row_len)
        step = make_stage_step(model, config, [[row_len]] * settings.rows, 1.0, device)

        def swapped(step=step) -> None:
            with attention_swapped(model, stand_in):
                step()

        steps.append(swapped)
    return tokens, steps


@dataclass
class ProfileRun:
    profile: Profile
    measurement: dict[str, Any]


def run_profile(
    config: Any,
    settings: ProfileSettings,
    stage: int = 0,
    device: torch.device | None = None,
    progress: bool = True,
) -> ProfileRun:
    """Measure stage `stage` of `config` on `device` (default: CUDA if present)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if settings.clock == "cpu" and (device.type != "cpu" or torch.get_num_threads() != 1):
        raise ProfilerError("--clock cpu needs the CPU device and one thread (--threads 1)")
    modules = scoped_modules(stage_module_names(config, stage), settings.scope)
    check_supported(config, modules, device)
    fingerprint = current_fingerprint(config, stage, device, settings.scope)
    fingerprint["row_len"] = settings.row_len
    fingerprint["policy"] = PROFILE_POLICY
    model = build_stage(config, modules, device)
    kinds = attention_kinds(model)
    n_points = len(LINEAR_FRACTIONS) + sum(
        len(settings.lengths) * (len(settings.densities) if m.config.sparse else 1)
        for m, _ in kinds
    )
    bar = Progress(n_points * (settings.warmup + settings.repeats), "sb-profile", progress)
    t0, load_before = time.perf_counter(), load_average()
    grid = attention_grid(model, config, settings, device)
    tokens, linear_steps = linear_grid(model, config, settings, device)
    try:  # one round-robin over both grids: they share every pass's machine state
        times = time_grid(
            grid.steps + linear_steps,
            device,
            settings.warmup,
            settings.repeats,
            bar,
            settings.clock,
        )
    finally:
        bar.close()
    table, attention_points = attention_table(grid, times[: len(grid.steps)], settings)
    linear = [statistics.median(t) for t in times[len(grid.steps) :]]
    overhead, linear_seconds = fit_linear(tokens, linear)
    profile = Profile(
        fingerprint=fingerprint,
        block_size=config.sparse_attention.block_size,
        lengths=list(settings.lengths),
        densities=[float(d) for d in settings.densities],
        attn_seconds=table,
        linear_tokens=tokens,
        linear_seconds=linear_seconds,
        overhead_seconds=overhead,
    )
    measurement = {
        "settings": dataclasses.asdict(settings),
        "elapsed_s": round(time.perf_counter() - t0, 1),
        "load_avg_1min": [load_before, load_average()],
        "linear_measured_seconds": linear,
        "attention_points": attention_points,
    }
    return ProfileRun(profile, measurement)


def load_average() -> float | None:
    with contextlib.suppress(OSError, AttributeError):
        return round(os.getloadavg()[0], 2)
    return None


def write_profile(run: ProfileRun, path: str | os.PathLike) -> None:
    """Atomic write of the profile plus a `measurement` record (the loader ignores it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**run.profile.to_dict(), "measurement": run.measurement}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def load_cost_model(
    path: str | os.PathLike,
    config: Any | None = None,
    stage: int = 0,
    strict: bool = False,
    **kwargs: Any,
) -> CostModel:
    """Trainer-facing loader: read the profile (ProfileError names the file) and, given
    the run's config, warn (raise under strict) where its fingerprint differs."""
    model = CostModel.from_file(path, **kwargs)
    if config is not None:
        model.check_fingerprint(current_fingerprint(config, stage), strict=strict)
    return model


# ----------------------------------------------------------------------------- CLI


def microbatch_rows(config: Any) -> int:
    """Rows per micro-batch as the trainer forms them."""
    p = config.parallelism
    if p.pipeline_parallel_degree > 1:
        return p.pipeline_parallel_microbatch_size
    return config.training.local_batch_size


def settings_from_args(
    config: Any, args: argparse.Namespace, device: torch.device
) -> ProfileSettings:
    row_len = config.training.seq_len
    cpu_clock = device.type == "cpu" and torch.get_num_threads() == 1
    return ProfileSettings(
        lengths=tuple(args.lengths or default_lengths(row_len, config.sparse_attention.block_size)),
        densities=tuple(args.densities or DEFAULT_DENSITIES),
        rows=args.rows or microbatch_rows(config),
        row_len=row_len,
        repeats=args.repeats,
        warmup=args.warmup,
        clock=args.clock or ("cpu" if cpu_clock else "wall"),
        scope=args.scope,
    )


def check_file(path: Path, config: Any | None, stage: int, scope: str) -> int:
    """`--check`: load a profile, print a summary, compare fingerprints given a config."""
    model = CostModel.from_file(path)
    p = model.profile
    print(
        f"{path}: ok: lengths {p.lengths[0]}..{p.lengths[-1]} ({len(p.lengths)}), densities "
        f"{p.densities}, block {p.block_size}, overhead {p.overhead_seconds:.4g} s, "
        f"device {p.fingerprint.get('device_name', '?')}"
    )
    if config is None:
        return 0
    diffs = model.check_fingerprint(current_fingerprint(config, stage, scope=scope))
    if diffs:
        print(f"{path}: fingerprint differs from this setup in: {', '.join(diffs)}")
        return 1
    print(f"{path}: fingerprint matches this setup")
    return 0


def _load_config(path: Path, overrides: list[str]):
    from sb_titan.config.toml import ConfigError, load_config

    try:
        return load_config(path, overrides)
    except ConfigError as e:
        raise ProfilerError(str(e)) from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="sb-profile",
        description="Measure one pipeline stage's fwd+bwd latency on this device into a "
        "cost-model profile (JSON). Other --section.key VALUE options override the config, "
        "e.g. --training.seq_len 2048.",
    )
    ap.add_argument("--config", type=Path, metavar="TOML", help="train config")
    ap.add_argument("--out", type=Path, metavar="JSON", help="where to write the profile")
    ap.add_argument(
        "--check",
        type=Path,
        metavar="JSON",
        help="validate a profile (and, with --config, "
        "compare its fingerprint with this setup); exit 0 ok, 1 mismatch, 2 unusable",
    )
    ap.add_argument("--lengths", type=int, nargs="+", metavar="L", help="document lengths")
    ap.add_argument("--densities", type=float, nargs="+", metavar="RHO", help="end at 1.0")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes (median; default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed passes first (default 1)")
    ap.add_argument("--rows", type=int, help="rows per micro-batch (default: as the trainer)")
    ap.add_argument("--stage", type=int, default=0, help="pipeline stage (default 0)")
    ap.add_argument(
        "--scope",
        choices=SCOPES,
        default="blocks",
        help="blocks: decoder blocks only, as the trainer measures (default); stage: also "
        "embedding, norm, head and loss where the stage holds them",
    )
    ap.add_argument("--device", help="cpu or cuda[:i] (default: cuda if available)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1, as training)")
    ap.add_argument(
        "--clock",
        choices=CLOCKS,
        help="wall, or cpu = process CPU time, which other users of a shared machine do not "
        "inflate (default: cpu on CPU with one thread, else wall)",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args, overrides = ap.parse_known_args(argv)
    logging.basicConfig(level=logging.WARNING, format="sb-profile: %(message)s")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    if not args.check and (args.config is None or args.out is None):
        ap.error("--config and --out are required to measure (or use --check FILE)")
    if overrides and args.config is None:
        ap.error(f"unrecognized arguments: {' '.join(overrides)}")
    try:
        config = _load_config(args.config, overrides) if args.config else None
        if args.check:
            return check_file(args.check, config, args.stage, args.scope)
        settings = settings_from_args(config, args, device)
        run = run_profile(config, settings, args.stage, device, progress=not args.quiet)
    except (ProfileError, ProfilerError) as e:
        print(f"sb-profile: error: {e}", file=sys.stderr)
        return 2
    write_profile(run, args.out)
    print(
        f"sb-profile: wrote {args.out}: stage {args.stage} ({settings.scope}) on "
        f"{run.profile.fingerprint['device_name']}, {len(settings.lengths)} lengths x "
        f"{len(settings.densities)} densities, {run.measurement['elapsed_s']:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
