"""Running from a source checkout: `sb_titan_kernels` without `pip install -e`.

pyproject.toml ships kernels/ as the package `sb_titan_kernels`, so that name exists
only after an install. On a machine where nothing can be installed (a GPU machine
with only torch, Triton and numpy), the entry points that run from the source tree
(bench/gpu.py, tests/conftest.py, tests/test_kernels.py's child processes) call
`use_source_kernels()` first. It adds an import finder, last on `sys.meta_path`, that
answers `import sb_titan_kernels` with this checkout's kernels/ (submodules and
relative imports included): an installed `sb_titan_kernels` is found first and wins.
Nothing is imported until someone imports the kernels (so Triton's interpreter mode,
chosen when they are first imported, stays the importer's choice). This is the only
place that does it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

NAME = "sb_titan_kernels"
KERNELS = Path(__file__).resolve().parents[2] / "kernels"


class SourceKernels(importlib.abc.MetaPathFinder):
    """Finds `sb_titan_kernels` in a kernels/ folder of the source tree."""

    def __init__(self, kernels: Path):
        self.kernels = kernels

    def find_spec(self, name, path=None, target=None):
        if name != NAME:
            return None  # submodules are found through the package's __path__
        return importlib.util.spec_from_file_location(
            NAME, self.kernels / "__init__.py", submodule_search_locations=[str(self.kernels)]
        )


def use_source_kernels(kernels: Path = KERNELS) -> bool:
    """Make `import sb_titan_kernels` work from the source tree (idempotent). True if
    this call added the finder."""
    if any(isinstance(f, SourceKernels) for f in sys.meta_path):
        return False
    if not (kernels / "__init__.py").is_file():
        return False  # an installed sb_titan without its source tree
    sys.meta_path.append(SourceKernels(kernels))
    return True
