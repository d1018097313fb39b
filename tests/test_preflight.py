"""Everything a launch can check from files runs before ranks spawn, as one line."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from conftest import DEBUG_TOML, REPO, cpu_env, indexed_args

from sb_titan.data.indexed import META, DatasetError, IndexedDataset, IndexedWriter
from sb_titan.tools.train import main

VOCAB = 1024  # the debug flavor's


def _dataset(path, top_id: int = VOCAB - 1):
    writer = IndexedWriter(path)
    rng = np.random.default_rng(0)
    for n in (300, 700, 64):
        writer.add(rng.integers(3, top_id, n))
    writer.add([top_id])
    writer.close({"source": "tests"})
    return path


def _check(capsys, *args: str, world: str | None = None, monkeypatch=None) -> str:
    """`sb-train --check-config` in-process: exit status 2 and one line on stderr."""
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as exit_:
        main(["--check-config", "--config_file", str(DEBUG_TOML), *args])
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "config error" in line]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_good_config_passes(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    main(["--check-config", "--config_file", str(DEBUG_TOML)])
    main(["--check-config", "--config_file", str(DEBUG_TOML), *indexed_args(_dataset(tmp_path))])


def test_token_ids_beyond_the_vocabulary(tmp_path, capsys):
    """Died with `IndexError: index out of range in self` from the embedding, 237 lines."""
    data = _dataset(tmp_path / "other_tokenizer", top_id=5000)
    line = _check(capsys, *indexed_args(data))
    assert f"indexed({data}): token id 5000 does not fit the model's vocabulary of 1024" in line


def test_older_datasets_without_max_token_id_are_scanned(tmp_path, capsys):
    data = _dataset(tmp_path / "old", top_id=4000)
    meta = json.loads((data / META).read_text())
    del meta["max_token_id"]
    (data / META).write_text(json.dumps(meta))
    assert IndexedDataset(data).max_token_id() == 4000
    assert "token id 4000" in _check(capsys, *indexed_args(data))


def test_an_edited_max_token_id_is_caught_when_reading(tmp_path):
    data = _dataset(tmp_path / "edited", top_id=900)
    meta = json.loads((data / META).read_text())
    (data / META).write_text(json.dumps({**meta, "max_token_id": 10}))
    with pytest.raises(DatasetError, match=r"meta\.json: sample 0 holds token id \d+, above"):
        IndexedDataset(data).read(0, 0, 300)


@pytest.mark.parametrize(
    "breakage, needle",
    [
        ("truncate_tokens", "tokens.bin: "),
        ("edit_meta", "lengths add up to"),
        ("drop_index", "index.npy: missing"),
    ],
)
def test_corrupt_datasets(tmp_path, capsys, breakage, needle):
    data = _dataset(tmp_path / "ds")
    if breakage == "truncate_tokens":
        raw = (data / "tokens.bin").read_bytes()
        (data / "tokens.bin").write_bytes(raw[:-8])
    elif breakage == "edit_meta":
        meta = json.loads((data / META).read_text())
        (data / META).write_text(json.dumps({**meta, "num_tokens": meta["num_tokens"] + 1}))
    else:
        (data / "index.npy").unlink()
    line = _check(capsys, *indexed_args(data))
    assert str(DEBUG_TOML) in line and needle in line, line


def test_latency_profile_problems(tmp_path, capsys):
    line = _check(capsys, "--sab.policy", "sab")
    assert "sab.policy='sab' need a latency profile" in line
    line = _check(capsys, "--dst.enabled", "--cost_model.profile", str(tmp_path / "nope.json"))
    assert f"no latency profile at {tmp_path / 'nope.json'}" in line
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert str(bad) in _check(capsys, "--dst.enabled", "--cost_model.profile", str(bad))
    # A profile of another config, with strict fingerprints, is refused by key.
    other = REPO / "profiles" / "e2e_cpu.json"
    args = ["--dst.enabled", "--cost_model.profile", str(other), "--cost_model.strict_fingerprint"]
    assert "row_len: profile=4096 current=1024" in _check(capsys, *args)


def test_step_shape_for_the_launch_world_size(capsys, monkeypatch):
    args = ["--training.global_batch_size", "6"]
    line = _check(capsys, *args, world="4", monkeypatch=monkeypatch)
    assert "training.global_batch_size (6)" in line


def test_run_train_sh_stops_before_spawning(tmp_path):
    data = _dataset(tmp_path / "ds", top_id=5000)
    proc = subprocess.run(
        ["./run_train.sh", "--dump_folder", str(tmp_path / "out"), *indexed_args(data)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env=cpu_env(),
    )
    assert proc.returncode == 2
    assert "token id 5000 does not fit" in proc.stderr
    assert "Traceback" not in proc.stderr and "[rank" not in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()
