"""TorchTitan's own launcher (launched by tests/test_model_spec.py under torchrun):
`torchtitan.train.main` parses with TorchTitan's ConfigManager (the recipe's config
registry, then the command-line overrides), builds the trainer with `config.build()`
and trains. Before training, rank 0 writes what was built to $PROBE_OUT: the model's
layers, parameters and attention block sizes, and what the cost model prices. Nothing
of sb_titan is imported here before the registry imports it, as with
`python -m torchtitan.train`."""

from __future__ import annotations

import json
import os

import torch.distributed as dist
import torchtitan.tools.utils
import torchtitan.train
from torchtitan.trainer import Trainer

PRICED = ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "layers", "block_size")


def _report(trainer: Trainer) -> None:
    from sb_titan.models.attention import SBAttention  # built by now, through the registry

    (model,) = trainer.model_parts
    attention = [m for m in model.modules() if isinstance(m, SBAttention)]
    profile = trainer.balancer.cost_model.profile
    built = {
        "layers": len(model.layers),
        "params": sum(p.numel() for p in model.parameters()),
        "block_sizes": sorted({m.config.block_size for m in attention}),
        "priced": {key: profile.fingerprint[key] for key in PRICED},
        "priced_block_size": profile.block_size,
        "spec_left_on_config": trainer.config.model_spec is not None,
        "device_type": torchtitan.tools.utils.device_type,
    }
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump(built, f)


_train = Trainer.train


def _report_then_train(trainer: Trainer) -> None:
    if dist.get_rank() == 0:
        _report(trainer)
    _train(trainer)


Trainer.train = _report_then_train  # what the launcher's `trainer.train()` calls
torchtitan.train.main()
