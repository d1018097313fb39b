"""sb_titan: SparseBalance (load-balanced dynamic sparse attention) for TorchTitan.

Importing the package installs the feature-detected compatibility shims first, so
TorchTitan's device handling sees the CPU when there is no accelerator.
"""

from sb_titan import compat

compat.install()

__version__ = "0.1.0"
