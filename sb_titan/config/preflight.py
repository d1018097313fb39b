"""Checks that run once, before any rank spawns (`sb-train --check-config`, which
run_train.sh calls first): a problem here is one line and exit status 2, not the same
traceback from every rank 15-35 s into the job.

What can be known from files and metadata alone is checked here: the config, the
latency profile (present, parseable, matching), the step shape for the launch's world
size, the model's tokenizer folder, the dataset's files and their consistency, that its
token ids fit the model's vocabulary and come from the model's tokenizer (its
index.npy against its checksums; tokens.bin is verified chunk by chunk as ranks read
it), and the checkpoint a resume would load (intact, and saved on this launch's layout).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torchtitan.tools.logging import logger

from sb_titan.config.toml import ConfigError, checked_model_spec
from sb_titan.data.source import check_tokenizer, check_vocabulary, integrity_note


def preflight(config: Any, path: str | Path | None) -> None:
    """Raise ConfigError, naming the config file, on the first problem found."""
    from sb_titan.balance.step_shape import check_context_parallel
    from sb_titan.data.loader import build_source
    from sb_titan.runtime.checkpoint import check_checkpoint_folder
    from sb_titan.runtime.run_record import layout_of
    from sb_titan.runtime.trainer import build_run_cost_model

    where = str(path or "<defaults>")
    model = checked_model_spec(config, path).model  # [model], an HF load's config.json
    layout = None  # unknown for an elastic world size (NNODES=min:max): the ranks check
    try:
        world = os.environ.get("WORLD_SIZE")
        if world is not None:
            layout = layout_of(config, int(world))  # the step shape; checks CP too
        elif config.parallelism.context_parallel_degree > 1:
            check_context_parallel(config)
        build_run_cost_model(config, model)
        check_assets(config.hf_assets_path)
        source = build_source(config.dataloader, config.training.seq_len)
        check_vocabulary(source, model.vocab_size, config.model.flavor)
        notes = [check_tokenizer(source, config.hf_assets_path)]
    except ValueError as e:  # ProfileError, DatasetError, VocabularyError included
        raise ConfigError(f"{where}: {e}") from None
    notes.append(integrity_note(source))
    for note in filter(None, notes):
        logger.warning(note)
    # raises CheckpointIntegrityError naming file and step, or both layouts
    check_checkpoint_folder(config, layout)


def check_assets(hf_assets_path: str) -> None:
    """TorchTitan builds the model's tokenizer from hf_assets_path on every rank."""
    if not os.path.isdir(hf_assets_path):
        raise ValueError(
            f"hf_assets_path = {hf_assets_path}: no such folder (the model's tokenizer, "
            "tokenizer.json; the shipped one is sb_titan/assets/tokenizer)"
        )
