"""Command-line overrides (`--section.key VALUE`), checked before tyro sees them.

tyro answers an unknown key with a boxed page that ends by listing every override;
the user wants the one key that is wrong and the key they probably meant. The keys are
the config tree's dataclass fields, spelled as tyro accepts them (`-` or `_`, and
`--section.no-flag` for a boolean). Anything this walk cannot judge (a value, a
subcommand, a key below a field that is not a dataclass) is left to tyro, whose own
complaint is then cut to its first line.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator
from typing import Any

HIDDEN = ("model_spec",)  # derived from [model]; tyro does not offer it


def unknown_key(config: Any, args: list[str]) -> str | None:
    """A one-line message for the first `--key` in `args` that names no config field
    (with the closest real key, if one is close), else None."""
    for arg in args:
        if not arg.startswith("--") or arg == "--help":
            continue  # a value, a subcommand, or tyro's own help
        key = arg[2:].partition("=")[0]
        if not _known(config, key.replace("-", "_").split(".")):
            return f"unknown command-line key '--{key}'{_suggestion(config, key)}"
    return None


def _known(obj: Any, parts: list[str]) -> bool:
    for i, part in enumerate(parts):
        if not _is_config(obj):
            return True  # a list item or a dict entry (`param_groups.0`): tyro decides
        fields = _fields(obj)
        last = i == len(parts) - 1
        if part not in fields:
            flag = part.removeprefix("no_")
            return last and flag != part and isinstance(fields.get(flag), bool)
        obj = fields[part]
    return not _is_config(obj)  # a whole section is not a key


def _suggestion(config: Any, key: str) -> str:
    """A real key that ends in the same name (`--optimizer.lr` is
    `--optimizer.param_groups.0.optimizer_kwargs.lr`), else the closest spelling."""
    wanted = key.replace("-", "_")
    every = list(keys(config))
    same = [k for k in every if k.rpartition(".")[2] == wanted.rpartition(".")[2]]
    match = difflib.get_close_matches(wanted, same or every, n=1, cutoff=0 if same else 0.6)
    return f" (did you mean '--{match[0]}'?)" if match else ""


def keys(obj: Any, prefix: str = "") -> Iterator[str]:
    """Every settable dotted key below `obj` (underscore spelling), list items and dict
    entries included as tyro names them."""
    if _is_config(obj):
        items = _fields(obj).items()
    elif isinstance(obj, (list, tuple)) and any(_is_config(v) for v in obj):
        items = ((str(i), v) for i, v in enumerate(obj))
    elif isinstance(obj, dict) and prefix:
        items = obj.items()
    else:
        yield prefix.rstrip(".")
        return
    for name, value in items:
        yield from keys(value, f"{prefix}{name}.")


def _is_config(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _fields(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name not in HIDDEN}


def first_line(tyro_output: str) -> str:
    """The first paragraph of tyro's boxed complaint, as one line: what is wrong, not
    the help that follows it."""
    words: list[str] = []
    for line in tyro_output.splitlines():
        line = line.strip()
        if line.startswith("╭"):
            continue  # the box's title
        text = line.strip("│").strip()
        if line.startswith("╰") or (words and set(text) <= {"─"}):
            break
        words += text.split()
    return " ".join(words) or "tyro rejected the command line"
