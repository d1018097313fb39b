"""sb_titan: SparseBalance (load-balanced dynamic sparse attention) for TorchTitan.

Importing the package has no side effects: entry points (sb-train and the other tools,
and models/qwen2_5/config_registry.py for TorchTitan's own launcher) install the
compatibility shims explicitly (sb_titan.compat.install).
"""

__version__ = "0.1.0"
