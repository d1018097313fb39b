"""Child of test_torchtitan_moves.py: with some modules made unimportable, use the
recipe's data loader and checkpoint manager for real, and print what they did as JSON.

    python hidden_modules_worker.py MODULE[,MODULE...] DUMP_FOLDER   ("" hides nothing)
"""

from __future__ import annotations

import hashlib
import importlib.abc
import json
import os
import sys


class Hide(importlib.abc.MetaPathFinder):
    """Answers an import of any hidden module as a TorchTitan without it would."""

    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, name, path, target=None):
        if name in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def digest(batches) -> str:
    h = hashlib.sha256()
    for inputs, labels in batches:
        for t in (inputs["input"], inputs["positions"], labels):
            h.update(t.numpy().tobytes())
    return h.hexdigest()


def take(it, n: int) -> list:
    return [next(it) for _ in range(n)]


def main(hidden: set[str], dump: str) -> dict:
    sys.meta_path.insert(0, Hide(hidden))
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.stateful import Stateful
    from torchtitan.config import Configurable

    from sb_titan.compat.data import BaseDataLoader
    from sb_titan.data.loader import SBDataLoader
    from sb_titan.runtime.checkpoint import (
        MANIFEST,
        CheckpointIntegrityError,
        IntegrityCheckpointManager,
    )

    out = {"base": f"{BaseDataLoader.__module__}.{BaseDataLoader.__qualname__}"}

    # The loader, built as TorchTitan's trainer builds it; a resume from its state.
    def build():
        config = SBDataLoader.Config(synthetic_docs=64, prefetch_factor=1)
        return config.build(
            dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=256, local_batch_size=2
        )

    loader = build()
    out["contract"] = [isinstance(loader, c) for c in (Stateful, Configurable, BaseDataLoader)]
    it = iter(loader)
    first = take(it, 3)
    state = loader.state_dict()
    rest = take(it, 2)
    loader.close()
    resumed = build()
    resumed.load_state_dict(state)
    again = take(iter(resumed), 2)
    resumed.close()
    out["batches"] = digest(first + rest)
    out["resume_matches"] = digest(again) == digest(rest)

    # The checkpoint manager: saves with manifests, purge, load, refusal of a flipped byte.
    class Box:
        def __init__(self):
            self.v = torch.zeros(3)

        def state_dict(self):
            return {"v": self.v}

        def load_state_dict(self, sd):
            self.v.copy_(sd["v"])

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    config = IntegrityCheckpointManager.Config(
        enable=True, interval=1, keep_latest_k=2, last_save_model_only=False
    )
    parts = dict(model_parts=[model], optimizers=Box(), lr_schedulers=Box(), states={})
    manager = config.build(dataloader=None, sd_adapter=None, base_folder=dump, **parts)
    out["saved"] = [manager.save(step) for step in (1, 2, 3, 4)]
    manager.close()  # joins the purge thread
    folder = os.path.join(dump, "checkpoint")
    out["folders"] = sorted(os.listdir(folder))
    out["manifests"] = [os.path.exists(os.path.join(folder, d, MANIFEST)) for d in out["folders"]]
    weight = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    loader_manager = config.build(dataloader=None, sd_adapter=None, base_folder=dump, **parts)
    out["loaded"] = loader_manager.load(-1)
    out["weights_restored"] = torch.equal(model.weight, weight)
    data = os.path.join(folder, "step-4", "__0_0.distcp")
    with open(data, "r+b") as f:
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        loader_manager.load(4)
        out["refused"] = None
    except CheckpointIntegrityError as e:
        out["refused"] = str(e)
    loader_manager.close()
    dist.destroy_process_group()
    out["hidden_imported"] = sorted(hidden & set(sys.modules))
    return out


if __name__ == "__main__":
    names = {n for n in sys.argv[1].split(",") if n}
    print(json.dumps(main(names, sys.argv[2])))
