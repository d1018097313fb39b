"""TOML train configs → the TorchTitan config tree (precedence: CLI > TOML > defaults).

Tables mirror the config tree (`[training]`, `[parallelism]`, `[checkpoint]`, ...)
plus the recipe's sections (`[model]`, `[sparse_attention]`, `[sab]`, `[dst]`).
Two tables choose a component rather than fill one: `[activation_checkpoint] mode` and
`[loss] num_chunks` (1: TorchTitan's CrossEntropyLoss; N > 1: its ChunkedLossWrapper,
lm_head + cross-entropy over 1/N of the row at a time, as TorchTitan's own configs do).
Every key is checked against the dataclass it lands in: an unknown key or a value of
the wrong type is a ConfigError naming the file and the dotted key path. CLI
overrides use TorchTitan's names (`--training.steps 4`) and are applied by tyro on
top of the TOML-filled tree, which re-runs the dataclasses' validation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomli

from sb_titan.runtime.elastic import NotRetryable

if TYPE_CHECKING:
    from torchtitan.protocols.model_spec import ModelSpec

AC_MODES = ("none", "selective", "full")
_tyro_rules_registered = False


class ConfigError(ValueError, NotRetryable):
    """A config problem a user can fix; the message says where."""


def load_config(path: str | Path | None, cli_args: list[str] | None = None):
    """Defaults ← TOML file ← CLI overrides. The model spec is not part of it: whatever
    builds the model derives it from the returned config (models.qwen2_5.derive_model_spec)."""
    from sb_titan.config.defaults import sb_titan_base

    config = sb_titan_base()
    if path is not None:
        path = Path(path)
        data = read_toml(path)
        apply_table(config, data, str(path), prefix="")
    config = _apply_cli(config, cli_args or [])
    return _finish(config, path)


def config_from_table(table: dict[str, Any], where: str):
    """A config from nested tables (a run record's, runtime/run_record.py), checked as a
    TOML file's would be; `where` names their file in errors."""
    from sb_titan.config.defaults import sb_titan_base

    config = sb_titan_base()
    apply_table(config, table, where, prefix="")
    return _finish(config, where)


def _finish(config, path: str | Path | None):
    """The checks of a whole config."""
    check_run_length(config, path)
    check_compile(config, path)
    check_loss_chunks(config, path)
    return config


def checked_model_spec(config, path: str | Path | None) -> ModelSpec:
    """The model spec `config` builds (models.qwen2_5.derive_model_spec), for a tool that
    checks, prices or profiles a run; a problem with it (a flavor, an HF initial load's
    config.json, a row beyond the RoPE length) is a ConfigError naming the file."""
    from sb_titan.models.registry import derive_model_spec

    try:
        return derive_model_spec(config)
    except ValueError as e:
        raise ConfigError(f"{path or '<defaults>'}: {e}") from None


def check_run_length(config, path: str | Path | None) -> None:
    """A run that would train nothing is a mistake, not a success (exit 0 after spawning
    every rank would hide it); only a seed checkpoint run trains no step."""
    if config.checkpoint.create_seed_checkpoint:
        return
    if config.training.steps < 1:
        raise ConfigError(
            f"{path or '<defaults>'}: 'training.steps' = {config.training.steps}, expected "
            ">= 1 (steps to train)"
        )


def check_compile(config, path: str | Path | None) -> None:
    """The attention recorder (a debug log) is Python inside the transformer block,
    which `--compile.enable` compiles with fullgraph=True: refuse the pair up front."""
    compiled = config.compile.enable and "model" in config.compile.components
    if compiled and config.sparse_attention.record:
        raise ConfigError(
            f"{path or '<defaults>'}: 'sparse_attention.record' logs from inside the "
            "compiled transformer block; set compile.enable = false to record"
        )


def check_training_backend(config, path: str | Path | None, device_type: str) -> None:
    """FlexAttention has a CPU forward but no CPU backward: a training run (or a
    profile of its steps) with the `flex` backend off CUDA would fail in every rank's
    first backward, so say so before any rank spawns."""
    attention = config.sparse_attention
    if attention.enabled and attention.backend == "flex" and device_type != "cuda":
        raise ConfigError(
            f"{path or '<defaults>'}: 'sparse_attention.backend' = 'flex' trains on CUDA "
            f"only (FlexAttention has no {device_type} backward); use 'auto' or 'torch' here"
        )


def check_loss_chunks(config, path: str | Path | None) -> None:
    """ChunkedLossWrapper splits each row into equal chunks; say so before ranks spawn."""
    from torchtitan.components.loss import ChunkedLossWrapper

    loss = config.loss
    if not isinstance(loss, ChunkedLossWrapper.Config):
        return
    seq_len = config.training.seq_len
    if loss.num_chunks < 2 or seq_len % loss.num_chunks:
        raise ConfigError(
            f"{path or '<defaults>'}: 'loss.num_chunks' = {loss.num_chunks}, expected an "
            f"integer >= 2 that divides training.seq_len = {seq_len}"
        )


def read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open("rb") as f:
            return tomli.load(f)
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def apply_table(obj: Any, table: dict[str, Any], file: str, prefix: str) -> None:
    """Set `table`'s keys on the dataclass `obj`, recursing into sub-tables."""
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in table.items():
        where = f"{prefix}{key}"
        if key not in names or key == "model_spec":
            allowed = ", ".join(sorted(n for n in names if n != "model_spec"))
            raise ConfigError(f"{file}: unknown key '{where}' (allowed here: {allowed})")
        if key == "activation_checkpoint":
            setattr(obj, key, _activation_checkpoint(value, file, where))
            continue
        if key == "loss" and not prefix:
            setattr(obj, key, _loss(value, file, where))
            continue
        current = getattr(obj, key)
        item_cls = _dataclass_list_item(hints.get(key))
        if item_cls is not None:
            setattr(obj, key, _build_list(item_cls, value, file, where))
            continue
        if dataclasses.is_dataclass(current) and not isinstance(current, type):
            if not isinstance(value, dict):
                raise ConfigError(f"{file}: '{where}' must be a table ([{where}])")
            apply_table(current, value, file, prefix=f"{where}.")
            continue
        setattr(obj, key, _check_type(value, hints.get(key, Any), file, where))
    _revalidate(obj, file, prefix)


def _dataclass_list_item(hint: Any) -> type | None:
    """`list[SomeDataclass]` → SomeDataclass (an array of tables in TOML)."""
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint) or (None,)
        if dataclasses.is_dataclass(item):
            return item
    return None


def _build_list(cls: type, value: Any, file: str, where: str) -> list:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{file}: '{where}' must be an array of tables ([[{where}]])")
    out = []
    for i, table in enumerate(value):
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, v in table.items():
            if key not in names:
                allowed = ", ".join(sorted(names))
                raise ConfigError(f"{file}: unknown key '{where}[{i}].{key}' (allowed: {allowed})")
            kwargs[key] = _check_type(v, hints.get(key, Any), file, f"{where}[{i}].{key}")
        try:
            out.append(cls(**kwargs))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{file}: '{where}[{i}]': {e}") from None
    return out


def _check_type(value: Any, hint: Any, file: str, where: str) -> Any:
    if _matches(value, hint):
        if isinstance(value, int) and not isinstance(value, bool) and _is_float_hint(hint):
            return float(value)
        return value
    kind = "," if _has_literal(hint) else f" has type {type(value).__name__},"
    raise ConfigError(f"{file}: '{where}' = {value!r}{kind} expected {_describe(hint)}")


def _has_literal(hint: Any) -> bool:
    """A choice of values (e.g. `sab.policy`): the value is wrong, not its type."""
    if typing.get_origin(hint) is typing.Literal:
        return True
    return any(_has_literal(h) for h in typing.get_args(hint))


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return _matches(value, typing.get_args(hint)[0])
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin in (list, tuple):
        args = typing.get_args(hint)
        if not isinstance(value, list):
            return False
        item = args[0] if args else Any
        return all(_matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def _is_float_hint(hint: Any) -> bool:
    if hint is float:
        return True
    args = typing.get_args(hint)
    return float in args and int not in args


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return _describe(typing.get_args(hint)[0])
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "nothing (omit the key)"
    return getattr(hint, "__name__", str(hint))


def _revalidate(obj: Any, file: str, prefix: str) -> None:
    """Re-run a section's own validation (e.g. allowed policy names) after filling it."""
    post_init = getattr(obj, "__post_init__", None)
    if post_init is None:
        return
    try:
        post_init()
    except ValueError as e:
        raise ConfigError(f"{file}: [{prefix.rstrip('.') or 'root'}] {e}") from None


def _activation_checkpoint(value: Any, file: str, where: str):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    if not isinstance(value, dict) or set(value) - {"mode"}:
        raise ConfigError(f"{file}: '{where}' must be a table with only 'mode' ({AC_MODES})")
    mode = value.get("mode", "none")
    if mode not in AC_MODES:
        raise ConfigError(f"{file}: '{where}.mode' = {mode!r}, expected one of {AC_MODES}")
    return {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[mode]


def _loss(value: Any, file: str, where: str):
    """`[loss] num_chunks = N`: the training loss TorchTitan builds (module docstring)."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    if not isinstance(value, dict) or set(value) - {"num_chunks"}:
        raise ConfigError(f"{file}: '{where}' must be a table with only 'num_chunks'")
    n = value.get("num_chunks", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{file}: '{where}.num_chunks' = {n!r}, expected an integer >= 1")
    if n == 1:
        return CrossEntropyLoss.Config()
    return ChunkedLossWrapper.Config(num_chunks=n, loss_fn=CrossEntropyLoss.Config())


def _apply_cli(config, cli_args: list[str]):
    """tyro applies the overrides; an unknown key or a value tyro refuses is one line."""
    if not cli_args:
        return config
    import tyro
    from torchtitan.config.manager import ConfigManager, custom_registry

    from sb_titan.config.cli import first_line, unknown_key

    bad = unknown_key(config, cli_args)
    if bad is not None:
        raise ConfigError(f"{bad}; `sb-train --help-all` lists every key")
    global _tyro_rules_registered
    if not _tyro_rules_registered:
        ConfigManager.register_tyro_rules(custom_registry)
        _tyro_rules_registered = True
    complaint = io.StringIO()
    try:
        with contextlib.redirect_stderr(complaint):
            return tyro.cli(type(config), args=cli_args, default=config, registry=custom_registry)
    except SystemExit as e:
        if e.code in (0, None):  # --help: tyro printed it; not an error
            sys.stderr.write(complaint.getvalue())
            raise
        raise ConfigError(f"command line: {first_line(complaint.getvalue())}") from None
