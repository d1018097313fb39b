"""The run record (sb_titan/runtime/run_record.py): a config written as tables reads back
into the same config, a layout mismatch is one line naming both layouts, and the config
a checkpoint was trained with is its record's unless a --config that agrees is given
(sb_titan/config/recorded.py). The records of real runs: tests/test_checkpoint_integrity.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import DEBUG_TOML, REPO

from sb_titan.config.recorded import MODEL_KEYS, checkpoint_config, differing_keys
from sb_titan.config.toml import ConfigError, config_from_table, load_config
from sb_titan.runtime.checkpoint import (
    CheckpointIntegrityError,
    CheckpointLayoutError,
    check_layout,
    load_failure,
)
from sb_titan.runtime.elastic import is_permanent
from sb_titan.runtime.run_record import (
    RECORD,
    Layout,
    config_table,
    layout_of,
    make_record,
    read_record,
    write_record,
)

CONFIGS = sorted((REPO / "train_configs").glob("*.toml"))


def _plain(table: dict) -> dict:
    return json.loads(json.dumps(table))  # as the file holds it


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_round_trip(path):
    config = load_config(path)
    table = _plain(config_table(config))
    assert _plain(config_table(config_from_table(table, "record"))) == table


def test_component_tables_round_trip(tmp_path):
    """The two tables that choose a component ([activation_checkpoint], [loss]) come
    back as the component, not as its fields."""
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    toml = tmp_path / "run.toml"
    for mode, cls in (("full", FullAC.Config), ("selective", SelectiveAC.Config)):
        extra = f"\n[activation_checkpoint]\nmode = '{mode}'\n[loss]\nnum_chunks = 4\n"
        toml.write_text(DEBUG_TOML.read_text() + extra)
        table = _plain(config_table(load_config(toml)))
        assert table["activation_checkpoint"] == {"mode": mode}
        assert table["loss"] == {"num_chunks": 4}
        again = config_from_table(table, "record")
        assert isinstance(again.activation_checkpoint, cls)
        assert isinstance(again.loss, ChunkedLossWrapper.Config) and again.loss.num_chunks == 4


def test_layout_of_a_pipelined_config():
    config = load_config(
        DEBUG_TOML,
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "1",
            "--training.global_batch_size",
            "8",
            "--model.tie_embeddings",
            "False",
        ],
    )
    # 4 ranks / PP 2 = DP 2; 8 rows / (2 rows x 2 DP) = 2 accumulation steps of 2 micro-batches
    assert layout_of(config, 4) == Layout(4, 2, 2, 1, 1, 4, 8)


def _step(folder: Path, step: int, world: int, *overrides: str) -> Path:
    config = load_config(DEBUG_TOML, list(overrides))
    d = folder / f"step-{step}"
    write_record(d, make_record(config, world))
    return d


def test_check_layout(tmp_path):
    config = load_config(DEBUG_TOML)
    two, one = layout_of(config, 2), layout_of(config, 1)
    d = _step(tmp_path, 6, 2)
    check_layout(d, two, reshard=False)  # the same: resumes
    with pytest.raises(CheckpointLayoutError) as e:
        check_layout(d, one, reshard=False)
    assert str(e.value) == (
        "checkpoint step 6 was saved on world 2 (DP 2, PP 1, CP 1, TP 1), 1 micro-batch(es) "
        "per DP rank, global batch 4; this run has world 1 (DP 1, PP 1, CP 1, TP 1), 1 "
        "micro-batch(es) per DP rank, global batch 2; resume it on the layout it was saved "
        "on, or reshard it (checkpoint.reshard)"
    )
    assert is_permanent(e.value)  # a restart would repeat it
    # resharding keeps the global batch: 1 rank accumulating 2 micro-batches of 2 rows
    with pytest.raises(CheckpointLayoutError, match="set training.global_batch_size = 4$"):
        check_layout(d, one, reshard=True)
    one_accumulating = layout_of(load_config(DEBUG_TOML, ["--training.global_batch_size", "4"]), 1)
    check_layout(d, one_accumulating, reshard=True)
    # The same world size with another global batch is another layout too.
    more = layout_of(load_config(DEBUG_TOML, ["--training.global_batch_size", "8"]), 2)
    with pytest.raises(CheckpointLayoutError, match="global batch 4; this run has .* batch 8"):
        check_layout(d, more, reshard=False)
    # A seed checkpoint (step 0, loaded model-only) and one without a record fit any.
    check_layout(_step(tmp_path, 0, 2), one, reshard=False)
    (tmp_path / "step-9").mkdir()
    check_layout(tmp_path / "step-9", one, reshard=False)
    (d / RECORD).write_text("{")
    with pytest.raises(CheckpointIntegrityError, match=f"unreadable run record {d / RECORD}"):
        check_layout(d, two, reshard=False)


def test_load_errors_are_classified():
    """DCP's CheckpointException is a BaseException: one line naming checkpoint, cause
    and rank; a missing key is permanent (not retried), an I/O error is not."""
    from torch.distributed.checkpoint import CheckpointException

    missing = RuntimeError("Missing key in checkpoint state_dict: dataloader.dp_rank_2.")
    error = load_failure(CheckpointException("load", {2: (missing, None)}), "ck/step-4")
    assert isinstance(error, CheckpointIntegrityError) and is_permanent(error)
    assert str(error) == (
        "cannot load checkpoint ck/step-4: RuntimeError: Missing key in checkpoint "
        "state_dict: dataloader.dp_rank_2. (rank 2)"
    )
    io = load_failure(CheckpointException("load", {0: (OSError("disk gone"), None)}), "ck")
    assert type(io) is RuntimeError and not is_permanent(io)


def test_checkpoint_config(tmp_path):
    d = _step(tmp_path, 3, 2, "--model.rope_theta", "50000.0", "--training.seq_len", "512")
    # Without --config: the record's.
    config = checkpoint_config(d)
    assert config.model.rope_theta == 50000.0 and config.training.seq_len == 512
    # An agreeing --config (other keys may differ: the step count, the dump folder).
    agree = ["--model.rope_theta", "50000.0", "--training.steps", "7"]
    assert checkpoint_config(d, DEBUG_TOML, agree).training.steps == 7
    with pytest.raises(ConfigError) as e:
        checkpoint_config(d, DEBUG_TOML)
    assert "on model.rope_theta = None (checkpoint: 50000.0); leave out --config" in str(e.value)
    # A DCP initial load (a seed checkpoint) does not shape the model: its path may differ.
    seeded = _step(tmp_path / "seeded", 2, 2, "--checkpoint.initial_load_path", str(tmp_path))
    assert checkpoint_config(seeded, DEBUG_TOML).checkpoint.initial_load_path is None
    # No record (a checkpoint saved before runs kept one): --config is needed.
    (tmp_path / "step-4").mkdir()
    with pytest.raises(ConfigError, match="has no run_record.json .* pass --config"):
        checkpoint_config(tmp_path / "step-4")
    assert checkpoint_config(tmp_path / "step-4", DEBUG_TOML).training.seq_len == 1024


def test_differing_keys():
    a = {"model": {"flavor": "debug", "rope_theta": None}, "training": {"steps": 4}}
    b = {"model": {"flavor": "debug4", "rope_theta": None}, "training": {"steps": 9}}
    assert differing_keys(a, b, MODEL_KEYS) == ["model.flavor = 'debug4' (checkpoint: 'debug')"]
    assert read_record(Path("/nonexistent")) is None
