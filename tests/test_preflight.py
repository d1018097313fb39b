"""Everything a launch can check from files runs before ranks spawn, as one line."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from conftest import DEBUG_TOML, REPO, cpu_env, indexed_args, prelaunch_refused

from sb_titan.data.indexed import META, DatasetError, IndexedDataset, IndexedWriter
from sb_titan.data.tokenizer import BOS, EOS, PAD, TOKENIZER_DIR
from sb_titan.tools import prep
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
    assert "sab.policy='sab' needs a latency profile" in line
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


# -- every case a launch refuses: exit 2, one line naming file and key, no rank ------------
E2E_PROFILE = REPO / "profiles" / "e2e_cpu.json"
DEBUG_PROFILE = REPO / "profiles" / "debug_cpu.json"


def _other_tokenizer(path):
    """A real byte-level BPE trained here: another tokenizer with a small vocabulary, so
    its ids fit the debug model's and only the tokenizer check can tell."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    return path


def _prepared(tmp_path, tokenizer=TOKENIZER_DIR):
    """A dataset made by sb-prep itself, with the tokenizer given."""
    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": f"doc {i} " * 300}) + "\n" for i in range(8)))
    out = tmp_path / f"prepared_{tokenizer.name}"
    args = ["--input", str(text), "--out", str(out), "--tokenizer", str(tokenizer), "--quiet"]
    assert prep.main(args) == 0
    return out


CASES = {
    "sab_without_profile": (["--sab.policy", "sab"], ["sab.policy='sab' needs a latency profile"]),
    "dst_without_profile": (["--dst.enabled"], ["dst.enabled needs a latency profile"]),
    "profile_missing": (
        ["--dst.enabled", "--cost_model.profile", "nope.json"],
        ["no latency profile at nope.json"],
    ),
    "fingerprint_mismatch": (
        ["--dst.enabled", "--cost_model.strict_fingerprint"]
        + ["--cost_model.profile", str(E2E_PROFILE)],
        [f"{E2E_PROFILE}: profile fingerprint mismatch", "cost_model.strict_fingerprint"],
    ),
    "profile_of_another_model_shape": (  # refused without strict_fingerprint
        ["--dst.enabled", "--cost_model.profile", str(DEBUG_PROFILE), "--model.flavor", "debug4"],
        [
            f"{DEBUG_PROFILE}: profile measured for another model shape",
            "profile [family=qwen2_5 flavor=debug hidden=256 heads=4 kv_heads=2 head_dim=64",
            "layers=2 stage_modules=['layers.0','layers.1']]",
            "this run [family=qwen2_5 flavor=debug4 hidden=256",
            "cost_model.allow_shape_mismatch = true",
        ],
    ),
    "dataset_path_missing": (
        ["--dataloader.dataset", "indexed"],
        ["dataloader.dataset_path: required when dataloader.dataset = 'indexed'"],
    ),
    "dataset_path_not_found": (
        ["--dataloader.dataset", "indexed", "--dataloader.dataset_path", "no/such/dir"],
        ["dataloader.dataset_path = no/such/dir: dataset directory not found"],
    ),
    "hf_assets_path_not_found": (
        ["--hf_assets_path", "no/such/assets"],
        ["hf_assets_path = no/such/assets: no such folder"],
    ),
}


@pytest.mark.parametrize("how", ["prelaunch", "check-config"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_case_is_refused_before_launch(capsys, tmp_path, case, how):
    args, needles = CASES[case]
    line = prelaunch_refused(capsys, tmp_path, *args, how=how)
    assert all(n in line for n in needles), line


def test_the_shape_override_accepts_a_profile_of_another_shape_with_a_warning(capsys):
    """The case refused above, with cost_model.allow_shape_mismatch: checked, warned (a
    log record: TorchTitan's logger writes to stdout)."""
    args = ["--dst.enabled", "--cost_model.profile", str(DEBUG_PROFILE), "--model.flavor"]
    override = ["debug4", "--cost_model.allow_shape_mismatch"]
    main(["--check-config", "--config_file", str(DEBUG_TOML), *args, *override])
    (warning,) = [line for line in capsys.readouterr().out.splitlines() if "shape" in line]
    assert f"{DEBUG_PROFILE}: profile fingerprint mismatch" in warning
    assert "layers: profile=2 current=4" in warning and "used anyway" in warning


def test_vocabulary_mismatch_is_refused_before_launch(capsys, tmp_path):
    data = _dataset(tmp_path / "big_ids", top_id=5000)
    line = prelaunch_refused(capsys, tmp_path, *indexed_args(data))
    assert "token id 5000 does not fit the model's vocabulary of 1024 (model.flavor" in line


def test_tokenizer_mismatch_is_refused_before_launch(capsys, tmp_path):
    """sb-prep with another tokenizer: every id fits the vocabulary, the hash does not."""
    data = _prepared(tmp_path, _other_tokenizer(tmp_path / "other"))
    line = prelaunch_refused(capsys, tmp_path, *indexed_args(data))
    assert f"{data / META}: tokenizer.sha256 = " in line, line
    assert f"hf_assets_path = {str(TOKENIZER_DIR)!r}" in line, line


def test_the_model_tokenizer_passes_and_older_datasets_get_a_note(capsys, tmp_path, monkeypatch):
    """A match passes silently; meta.json without the hash passes with a note (a log
    record: TorchTitan's logger writes to stdout)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    data = _prepared(tmp_path)
    main(["--check-config", "--config_file", str(DEBUG_TOML), *indexed_args(data)])
    assert "tokenizer.sha256" not in capsys.readouterr().out
    meta = json.loads((data / META).read_text())
    meta.pop("tokenizer", None)
    (data / META).write_text(json.dumps(meta))
    main(["--check-config", "--config_file", str(DEBUG_TOML), *indexed_args(data)])
    out = capsys.readouterr().out
    assert f"{data / META}: no tokenizer.sha256 (prepared by an older sb-prep)" in out


@pytest.mark.parametrize(
    "name", ["qwen2.5_0.5b_64k", "qwen2.5_3b_128k", "qwen3_4b_128k", "llama3_8b_64k"]
)
def test_shipped_cluster_configs_ask_for_a_profile(capsys, tmp_path, name):
    """They turn on SAB and DST for GPUs this repo cannot profile: the launch stops at
    the missing profile, naming both keys that would fix it (see the configs' comments)."""
    config = REPO / "train_configs" / f"{name}.toml"
    line = prelaunch_refused(capsys, tmp_path, config=config)
    assert "dst.enabled and sab.policy='sab' need a latency profile" in line
    assert "cost_model.profile" in line and "cost_model.analytic_device" in line
    # With the analytic fallback the next thing the user must supply is named.
    line = prelaunch_refused(
        capsys, tmp_path, "--cost_model.analytic_device", "h100", config=config
    )
    assert "hf_assets_path = ./assets/" in line, line


def test_run_train_sh_stops_a_cluster_config_before_spawning(tmp_path):
    """run_train.sh's refusal path, whatever the check that refuses (each is tested in
    process above): one line, exit 2, no rank started and no folder made."""
    config = REPO / "train_configs" / "qwen2.5_0.5b_64k.toml"
    proc = subprocess.run(
        ["./run_train.sh", "--dump_folder", str(tmp_path / "out")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env=cpu_env(CONFIG_FILE=str(config), NGPU="8"),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "need a latency profile" in lines[0], proc.stderr
    assert "[rank" not in proc.stdout + proc.stderr and not (tmp_path / "out").exists()
