"""`sb-profile`: measure one pipeline stage on this device -> a cost-model Profile
(sb_titan/profiler/ does the measuring; docs/cost_model.md explains each choice)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the profiler loads torch and TorchTitan: the work needs them, --help not
    import torch
    from torchtitan.models.qwen3.model import Qwen3Model

    from sb_titan.profiler.run import ProfileSettings

# --help's choices, named here for that reason; tests/test_cli.py holds them equal to
# sb_titan.profiler's SCOPES and CLOCKS.
SCOPES = ("blocks", "stage")
CLOCKS = ("wall", "cpu")


def settings_from_args(
    config: Any, args: argparse.Namespace, device: torch.device
) -> ProfileSettings:
    import torch

    from sb_titan.profiler.run import (
        DEFAULT_DENSITIES,
        ProfileSettings,
        default_lengths,
        microbatch_rows,
    )

    row_len = config.training.seq_len
    cpu_clock = device.type == "cpu" and torch.get_num_threads() == 1
    return ProfileSettings(
        lengths=tuple(args.lengths or default_lengths(row_len, config.sparse_attention.block_size)),
        densities=tuple(args.densities or DEFAULT_DENSITIES),
        rows=args.rows or microbatch_rows(config.parallelism, config.training),
        row_len=row_len,
        repeats=args.repeats,
        warmup=args.warmup,
        clock=args.clock or ("cpu" if cpu_clock else "wall"),
        scope=args.scope,
    )


def check_file(
    path: Path, config: Any | None, model_cfg: Qwen3Model.Config | None, stage: int, scope: str
) -> int:
    """`--check`: load a profile, print a summary, compare fingerprints given a config."""
    from sb_titan.balance.cost_model import CostModel
    from sb_titan.balance.cost_model.fingerprint import SHAPE_KEYS, fingerprint_diffs
    from sb_titan.profiler.fingerprint import current_fingerprint

    model = CostModel.from_file(path)
    p = model.profile
    print(
        f"{path}: ok: lengths {p.lengths[0]}..{p.lengths[-1]} ({len(p.lengths)}), densities "
        f"{p.densities}, block {p.block_size}, overhead {p.overhead_seconds:.4g} s, "
        f"device {p.fingerprint.get('device_name', '?')}"
    )
    if config is None:
        return 0
    have = {**p.fingerprint, "block_size": p.block_size}
    diffs = fingerprint_diffs(have, current_fingerprint(config, model_cfg, stage, scope=scope))
    if diffs:
        shape = [k for k in diffs if k in SHAPE_KEYS]
        refused = f" (model shape: a run refuses it: {', '.join(shape)})" if shape else ""
        print(f"{path}: fingerprint differs from this setup in: {', '.join(diffs)}{refused}")
        return 1
    print(f"{path}: fingerprint matches this setup")
    return 0


def _load_config(path: Path, overrides: list[str], measure_on: torch.device | None):
    """The config and the model its spec builds (derived once, here); to measure on
    `measure_on`, also the checks a training run gets (the profile times backward)."""
    from sb_titan.config.toml import (
        ConfigError,
        check_training_backend,
        checked_model_spec,
        load_config,
    )
    from sb_titan.profiler.stage import ProfilerError

    try:
        config = load_config(path, overrides)
        if measure_on is not None:
            check_training_backend(config, path, measure_on.type)
        return config, checked_model_spec(config, path).model
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
    import torch

    from sb_titan.balance.cost_model import ProfileError
    from sb_titan.profiler.run import run_profile, write_profile
    from sb_titan.profiler.stage import ProfilerError

    logging.basicConfig(level=logging.WARNING, format="sb-profile: %(message)s")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    if not args.check and (args.config is None or args.out is None):
        ap.error("--config and --out are required to measure (or use --check FILE)")
    if overrides and args.config is None:
        ap.error(f"unrecognized arguments: {' '.join(overrides)}")
    try:
        measure_on = None if args.check else device
        config, model = (None, None)
        if args.config:
            config, model = _load_config(args.config, overrides, measure_on)
        if args.check:
            return check_file(args.check, config, model, args.stage, args.scope)
        settings = settings_from_args(config, args, device)
        run = run_profile(config, model, settings, args.stage, device, progress=not args.quiet)
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
