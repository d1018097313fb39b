"""Checkpoint integrity (sb_titan/runtime/checkpoint.py): manifests written last,
verified before DCP loads; corrupted, truncated or incomplete checkpoints are refused
with one line naming the file and step, or skipped with a warning when asked."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import (
    DEBUG_TOML,
    REPO,
    TINY,
    cpu_env,
    forked_train_cli,
    losses,
    sample_log,
    scalars,
    torchrun,
)

from sb_titan.config.toml import load_config
from sb_titan.eval.checkpoint import load_from_config
from sb_titan.runtime.checkpoint import (
    MANIFEST,
    CheckpointIntegrityError,
    check_checkpoint_folder,
    choose_step,
    finalize,
    stale_steps,
    verify,
)


# -- synthetic folders (no torchrun) ------------------------------------------------------------
def _fake_step(folder: Path, step: int, marker: bool = True) -> Path:
    d = folder / f"step-{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"meta" * 10)
    for r in range(2):
        (d / f"__{r}_0.distcp").write_bytes(bytes(range(256)) * (40 + r))
    if marker:
        finalize(d)
    return d


def _flip(path: Path, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_and_verifies(tmp_path):
    d = _fake_step(tmp_path, 4)
    files = json.loads((d / MANIFEST).read_text())["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert files["__1_0.distcp"]["bytes"] == 256 * 41
    verify(d)


@pytest.mark.parametrize(
    "damage, expected",
    [
        (
            lambda d: _flip(d / "__1_0.distcp"),
            "checkpoint step 4 is corrupted: {d}/__1_0.distcp has",
        ),
        (
            lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:100]),
            "checkpoint step 4 is corrupted: {d}/__0_0.distcp has 100 bytes",
        ),
        (
            lambda d: (d / ".metadata").unlink(),
            "checkpoint step 4 is corrupted: {d}/.metadata is missing",
        ),
        (
            lambda d: (d / MANIFEST).unlink(),
            f"checkpoint step 4 is incomplete: {{d}}/{MANIFEST} is missing",
        ),
        (
            lambda d: (d / "__2_0.distcp").write_bytes(b"x"),
            f"{{d}}/__2_0.distcp is not in {MANIFEST}",
        ),
        (lambda d: (d / MANIFEST).write_text("{"), f"unreadable {{d}}/{MANIFEST}"),
    ],
    ids=["bitflip", "truncated", "missing_file", "no_marker", "unlisted", "bad_manifest"],
)
def test_damage_is_refused_naming_file_and_step(tmp_path, damage, expected):
    d = _fake_step(tmp_path, 4)
    damage(d)
    with pytest.raises(CheckpointIntegrityError) as e:
        verify(d)
    msg = str(e.value)
    assert "\n" not in msg and expected.format(d=d) in msg, msg


def test_checksums_are_split_over_ranks(tmp_path):
    d = _fake_step(tmp_path, 4)
    _flip(d / "__1_0.distcp")
    verify(d, rank=0, world=2)  # rank 0 checksums .metadata and its own file only
    with pytest.raises(CheckpointIntegrityError, match="__1_0.distcp"):
        verify(d, rank=1, world=2)
    verify(d, checksums=False)  # sizes alone cannot see a flip


def test_choose_step_newest_refuses_or_falls_back(tmp_path):
    _fake_step(tmp_path, 2)
    _flip(_fake_step(tmp_path, 4) / "__0_0.distcp")
    _fake_step(tmp_path, 6, marker=False)  # a save that died: no marker, skipped
    with pytest.raises(CheckpointIntegrityError, match="step 4 is corrupted.*fallback_to_previous"):
        choose_step(tmp_path, -1, fallback=False, allow_unverified=False, check=verify)
    step, warning = choose_step(tmp_path, -1, fallback=True, allow_unverified=False, check=verify)
    assert step == 2 and "\n" not in warning
    assert "skipping incomplete checkpoint step-6" in warning and "step 4 is corrupted" in warning
    assert "loading checkpoint step 2" in warning
    (tmp_path / "step-2" / MANIFEST).unlink()
    with pytest.raises(
        CheckpointIntegrityError, match="step 4 is corrupted.*no earlier checkpoint"
    ):
        choose_step(tmp_path, 4, fallback=True, allow_unverified=False, check=verify)


def test_incomplete_newest_is_skipped_for_the_newest_complete(tmp_path):
    """A crash between a save and its manifest: the restart loads the step before it,
    with or without fallback_to_previous, and says so in one line naming both."""
    _fake_step(tmp_path, 2)
    _fake_step(tmp_path, 4)
    _fake_step(tmp_path, 6, marker=False)  # DCP finished (.metadata), hashing did not
    (_fake_step(tmp_path, 8, marker=False) / ".metadata").unlink()  # DCP did not finish
    for fallback in (False, True):
        step, note = choose_step(
            tmp_path, -1, fallback=fallback, allow_unverified=False, check=verify
        )
        assert step == 4 and "\n" not in note, note
        assert note == (
            f"skipping incomplete checkpoint step-8, step-6 in {tmp_path} ({MANIFEST} missing: "
            "the save did not finish); resuming from checkpoint step 4, the newest complete one"
        )
    # allow_unverified: a folder whose DCP save finished counts as complete (loaded
    # unverified); one without .metadata is still skipped
    step, note = choose_step(tmp_path, -1, fallback=False, allow_unverified=True, check=verify)
    assert step == 6 and "skipping incomplete checkpoint step-8 " in note
    assert "step 6 has no sb_integrity.json: loading it unverified" in note
    # an explicit load_step is checked as it is: no skipping
    with pytest.raises(CheckpointIntegrityError, match="step 6 is incomplete"):
        choose_step(tmp_path, 6, fallback=False, allow_unverified=False, check=verify)


def test_nothing_complete(tmp_path):
    # only a save that died inside DCP: nothing was ever saved, start without a checkpoint
    (_fake_step(tmp_path, 2, marker=False) / ".metadata").unlink()
    step, note = choose_step(tmp_path, -1, fallback=False, allow_unverified=False, check=verify)
    assert step == -1 and "skipping incomplete checkpoint step-2" in note and "none is" in note
    # a DCP-complete folder without manifest may predate integrity checks: refused as
    # before, pointing at allow_unverified (never silently trained over, or purged)
    _fake_step(tmp_path, 4, marker=False)
    with pytest.raises(CheckpointIntegrityError, match="step 4 is incomplete.*allow_unverified"):
        choose_step(tmp_path, -1, fallback=False, allow_unverified=False, check=verify)


def test_purge_counts_only_complete_steps(tmp_path):
    for step in (2, 4, 6):
        _fake_step(tmp_path, step)
    _fake_step(tmp_path, 3, marker=False)  # a crash's leftovers, older than step 6
    _fake_step(tmp_path, 10, marker=False)  # a crash's leftovers, newer than any complete
    saving = _fake_step(tmp_path, 8, marker=False)  # the save TorchTitan purges inside
    # keep 2 complete: 2 and the leftover 3 go; 4 and 6 stay until 8 is finalised.
    # (TorchTitan's own rule, the 2 highest step numbers, would keep only 8 and 10:
    # neither is complete, so a crash now would leave nothing to resume from.)
    assert stale_steps(tmp_path, 2, False, saving) == [tmp_path / "step-2", tmp_path / "step-3"]
    assert stale_steps(tmp_path, 1, False, saving) == [
        tmp_path / "step-2",
        tmp_path / "step-3",
        tmp_path / "step-4",
    ]
    finalize(saving)
    assert stale_steps(tmp_path, 2, False) == [
        tmp_path / "step-2",
        tmp_path / "step-3",
        tmp_path / "step-4",
    ]
    assert stale_steps(tmp_path / "none", 2, False) == []


def _config(dump: Path, *extra: str):
    return load_config(DEBUG_TOML, ["--dump_folder", str(dump), "--checkpoint.enable", *extra])


def test_launch_check(tmp_path):
    check_checkpoint_folder(_config(tmp_path))  # nothing to resume: fine
    d = _fake_step(tmp_path / "checkpoint", 4)
    check_checkpoint_folder(_config(tmp_path))
    _flip(d / "__0_0.distcp")
    with pytest.raises(CheckpointIntegrityError, match="step 4 is corrupted.*__0_0.distcp"):
        check_checkpoint_folder(_config(tmp_path))
    check_checkpoint_folder(_config(tmp_path, "--checkpoint.no-verify_before_launch"))
    with pytest.raises(CheckpointIntegrityError, match="load_step = 3.*does not exist"):
        check_checkpoint_folder(_config(tmp_path / "none", "--checkpoint.load_step", "3"))


# -- real torchrun runs --------------------------------------------------------------------------
TRAINED = ["--training.steps", "4", "--checkpoint.async_mode", "async", "--dataloader.sample_log"]
"""How `trained` ran, besides the checkpoint flags."""


def _ckpt(*args: str) -> list[str]:
    return ["--checkpoint.enable", "--checkpoint.interval", "2", *args]


def _entry(dump: Path, *args: str) -> list[str]:
    """`python -m sb_titan.tools.train` arguments, as conftest.torchrun passes them."""
    return ["--config_file", str(DEBUG_TOML), "--dump_folder", str(dump), *TINY, *_ckpt(*args)]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """4 steps on 2 ranks; step-2 saved asynchronously (its manifest comes when the
    step-4 save waits for it), step-4 synchronously (the last step)."""
    dump = tmp_path_factory.mktemp("trained")
    torchrun(2, _ckpt(*TRAINED), dump)
    return dump


def _resume_copy(trained: Path, dest: Path) -> Path:
    shutil.copytree(trained / "checkpoint", dest / "checkpoint")
    return dest


@pytest.mark.torchrun
def test_saves_get_manifests_written_last(trained):
    for step in (2, 4):
        d = trained / "checkpoint" / f"step-{step}"
        files = json.loads((d / MANIFEST).read_text())["files"]
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(files), files
        verify(d)


@pytest.mark.torchrun
def test_flipped_bytes_stop_the_resume_before_any_step(trained, tmp_path):
    dump = _resume_copy(trained, tmp_path)
    bad = dump / "checkpoint" / "step-4" / "__1_0.distcp"
    _flip(bad)
    proc = torchrun(2, _ckpt("--training.steps", "6"), dump, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in out.splitlines() if line.startswith("sb_titan: checkpoint error:")]
    assert len(lines) == 1, out[-4000:]  # one line, from rank 0
    assert f"checkpoint step 4 is corrupted: {bad} has xxh3_64" in lines[0]
    assert "Training starts" not in out and not scalars(dump, "loss_metrics/global_avg_loss")
    # The launcher's check (run_train.sh runs it before torchrun) says the same.
    check = forked_train_cli(["--check-config", *_entry(dump)])
    assert check.returncode == 2 and f"checkpoint step 4 is corrupted: {bad}" in check.stderr
    # So do sb-export / sb-eval, which load the weights without the trainer.
    with pytest.raises(CheckpointIntegrityError, match="step 4 is corrupted.*__1_0.distcp"):
        load_from_config(dump / "checkpoint" / "step-4", DEBUG_TOML)


@pytest.mark.torchrun
def test_fallback_resumes_from_previous_checkpoint(trained, tmp_path):
    dump = _resume_copy(trained, tmp_path)
    bad = dump / "checkpoint" / "step-4" / "__0_0.distcp"
    bad.write_bytes(bad.read_bytes()[:1000])  # truncated
    proc = torchrun(2, _ckpt("--training.steps", "4", "--checkpoint.fallback_to_previous"), dump)
    out = proc.stdout + proc.stderr
    assert f"checkpoint step 4 is corrupted: {bad} has 1000 bytes" in out
    assert "loading checkpoint step 2 instead" in out and "Training starts at step 3" in out
    # Steps 3 and 4 retrained from the async-saved step 2 match the original run, and
    # the new step-4 checkpoint verifies.
    resumed, original = scalars(dump, "loss_metrics/global_avg_loss"), losses(trained)
    assert sorted(resumed) == [3, 4]
    assert max(abs(resumed[s] - original[s - 1]) for s in (3, 4)) <= 1e-5, (resumed, original)
    verify(dump / "checkpoint" / "step-4")


@pytest.mark.torchrun
def test_crash_between_save_and_manifest_restarts_from_last_complete_step(
    trained, tmp_path, monkeypatch
):
    """Every rank dies after DCP wrote step 4 and before its manifest (a hook, first
    attempt only); torchrun's restart skips the incomplete step-4 for step-2, without
    fallback_to_previous, and retrains to the uninterrupted run's losses, bit for bit."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as sb-launch, for the restart
    proc = torchrun(
        2,
        _ckpt("--training.steps", "4", "--sab.policy", "sequential"),
        tmp_path,
        check=False,
        fixture="crash_before_finalize",
        max_restarts=1,
        rank_env={"SB_TEST_CRASH_BEFORE_FINALIZE": "4"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "test crash: rank 0 before finalizing step-4" in out  # it did die there
    skip = [line for line in out.splitlines() if "skipping incomplete checkpoint" in line]
    assert skip and all(
        line.endswith(
            f"skipping incomplete checkpoint step-4 in {tmp_path / 'checkpoint'} ({MANIFEST} "
            "missing: the save did not finish); resuming from checkpoint step 2, the newest "
            "complete one"
        )
        for line in skip
    ), skip
    assert "Training starts at step 3" in out
    assert losses(tmp_path) == losses(trained) and len(losses(trained)) == 4
    verify(tmp_path / "checkpoint" / "step-4")  # the retrained step 4 is complete
    # rank 0 took the dump-folder lock for its parent (torchrun's agent; here the server
    # it was forked from); the restart accepted it as its own run's and released it
    assert not (tmp_path / "sb_titan.lock").exists()


# -- the run record: config and layout, in every step folder ------------------------------------
def _trained_args() -> list[str]:
    """The overrides `trained` ran with, as conftest.torchrun passed them."""
    return [*TINY, *_ckpt(*TRAINED)]


@pytest.mark.torchrun
def test_run_record_in_every_step_and_covered_by_the_manifest(trained, tmp_path):
    from sb_titan.config.toml import config_from_table
    from sb_titan.runtime.run_record import RECORD, config_table, read_record

    # The resolved config: the TOML with the command line's overrides on top.
    want = config_table(load_config(DEBUG_TOML, ["--dump_folder", str(trained), *_trained_args()]))
    want = json.loads(json.dumps(want))
    layout = {"world": 2, "dp": 2, "pp": 1, "cp": 1, "tp": 1, "microbatches": 1}
    for step in (2, 4):  # step-2 saved asynchronously, step-4 synchronously
        d = trained / "checkpoint" / f"step-{step}"
        assert RECORD in json.loads((d / MANIFEST).read_text())["files"]
        record = read_record(d)
        assert record["config"] == want
        assert record["layout"] == {**layout, "global_batch": 4}  # 2 ranks x 2 rows
        again = config_table(config_from_table(record["config"], str(d / RECORD)))
        assert json.loads(json.dumps(again)) == want
    assert read_record(trained) == read_record(trained / "checkpoint" / "step-4")  # dump folder
    # The manifest covers it: an edited record is caught like any other file.
    dump = _resume_copy(trained, tmp_path)
    edited = dump / "checkpoint" / "step-4" / RECORD
    edited.write_text(edited.read_text().replace('"world": 2', '"world": 3'))
    with pytest.raises(CheckpointIntegrityError, match=f"step 4 is corrupted: {edited}"):
        verify(edited.parent)


@pytest.mark.torchrun
def test_resume_on_another_world_size_is_refused_before_spawn(
    trained, tmp_path, capsys, monkeypatch
):
    """2 ranks saved it: `--check-config` (run_train.sh, before torchrun) for 1 or 4
    ranks refuses in one line naming both layouts; `--checkpoint.reshard` passes once
    the global batch is the saved one."""
    from sb_titan.tools.train import main

    dump = _resume_copy(trained, tmp_path)

    def check(world: str, *extra: str) -> int:
        monkeypatch.setenv("WORLD_SIZE", world)
        argv = ["--check-config", *_entry(dump, "--training.steps", "6", *extra)]
        try:
            main(argv)
        except SystemExit as e:
            return e.code
        return 0

    def errors() -> list[str]:
        return [x for x in capsys.readouterr().err.splitlines() if x.startswith("sb_titan:")]

    saved = (
        "sb_titan: checkpoint error: checkpoint step 4 was saved on world 2 (DP 2, PP 1, CP 1, "
        "TP 1), 1 micro-batch(es) per DP rank, global batch 4; this run has "
    )
    assert check("1") == 2
    assert errors() == [
        f"{saved}world 1 (DP 1, PP 1, CP 1, TP 1), 1 micro-batch(es) per DP rank, global "
        "batch 2; resume it on the layout it was saved on, or reshard it (checkpoint.reshard)"
    ]
    assert check("4") == 2
    assert errors() == [
        f"{saved}world 4 (DP 4, PP 1, CP 1, TP 1), 1 micro-batch(es) per DP rank, global "
        "batch 8; resume it on the layout it was saved on, or reshard it (checkpoint.reshard)"
    ]
    assert check("1", "--checkpoint.reshard") == 2
    assert errors()[0].endswith(
        "; checkpoint.reshard keeps the global batch: set training.global_batch_size = 4"
    )
    assert check("1", "--checkpoint.reshard", "--training.global_batch_size", "4") == 0
    assert check("2") == 0


@pytest.mark.torchrun
def test_reshard_resumes_two_ranks_on_one_at_the_same_global_batch(trained, tmp_path):
    """2 -> 1 with checkpoint.reshard, the global batch kept by accumulating 2 micro-
    batches: DCP reshards the FSDP weights and optimizer, and the one rank trains steps
    3-4 on exactly the pieces the two ranks trained there, in their order, to the same
    losses and gradient norms."""
    step2 = Path("checkpoint") / "step-2"
    shutil.copytree(trained / step2, tmp_path / step2)
    args = [*TRAINED, "--checkpoint.reshard", "--training.global_batch_size", "4"]
    proc = torchrun(1, _ckpt(*args), tmp_path)
    out = proc.stdout + proc.stderr
    assert "was saved on world 2 (DP 2, PP 1, CP 1, TP 1)" in out and "resharding it" in out
    assert "Training starts at step 3" in out
    before = [sample_log(trained, rank) for rank in (0, 1)]
    after = sample_log(tmp_path)
    assert [e["step"] for e in after] == [3, 3, 4, 4]
    for step in (3, 4):
        one = [e["rows"] for e in after if e["step"] == step]  # micro-batches 0, 1
        two = [e["rows"] for log in before for e in log if e["step"] == step]  # ranks 0, 1
        assert one == two, step
    # every piece of the epoch's order once: the two ranks' steps 1-2, then the one rank's
    pieces = [
        tuple(p) for log in before for e in log if e["step"] <= 2 for r in e["rows"] for p in r
    ]
    pieces += [tuple(p) for e in after for r in e["rows"] for p in r]
    assert len(pieces) == len(set(pieces))
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        a, b = scalars(trained, tag), scalars(tmp_path, tag)
        assert sorted(b) == [3, 4]
        for step in (3, 4):
            assert abs(b[step] - a[step]) <= 1e-4 * abs(a[step]), (tag, step, a, b)


@pytest.mark.torchrun
def test_ranks_refuse_another_layout_too(trained, tmp_path):
    """A launch that skips run_train.sh's check (a bare torchrun, TorchTitan's launcher):
    the rank refuses before DCP loads anything, in one line, recorded as not retryable."""
    dump = _resume_copy(trained, tmp_path)
    proc = torchrun(1, _ckpt("--training.steps", "6"), dump, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in out.splitlines() if line.startswith("sb_titan: checkpoint error:")]
    assert len(lines) == 1, out[-4000:]
    assert "checkpoint step 4 was saved on world 2 (DP 2, PP 1, CP 1, TP 1)" in lines[0]
    assert "this run has world 1 (DP 1, PP 1, CP 1, TP 1)" in lines[0]
    assert "Loading the checkpoint" not in out and "Training starts" not in out
    fatal = json.loads((dump / "fatal_error.json").read_text())  # a restart stops at once
    assert "was saved on world 2" in fatal["cause"]


@pytest.mark.torchrun
def test_export_reads_the_checkpoints_own_config(trained, tmp_path):
    from sb_titan.eval.checkpoint import load_from_hf
    from sb_titan.tools.export import main as export_main

    out = tmp_path / "hf"
    export_main(["--checkpoint", str(trained / "checkpoint"), "--out", str(out)])
    exported = load_from_hf(out).model.state_dict()
    direct = load_from_config(trained / "checkpoint" / "step-4", DEBUG_TOML).model.state_dict()
    assert exported.keys() == direct.keys()
    assert all((exported[k] == direct[k]).all() for k in direct)
    # A --config the checkpoint was not trained with is refused, naming the keys.
    other = tmp_path / "other.toml"
    other.write_text(DEBUG_TOML.read_text().replace("[model]\n", "[model]\nrope_theta = 50000.0\n"))
    argv = ["--checkpoint", str(trained / "checkpoint"), "--config", str(other)]
    with pytest.raises(SystemExit) as exit_:
        export_main([*argv, "--out", str(tmp_path / "no")])
    step4 = trained / "checkpoint" / "step-4"
    assert str(exit_.value.code) == (
        f"sb-export: error: --config {other} disagrees with the config checkpoint {step4} was "
        "trained with (run_record.json) on model.rope_theta = 50000.0 (checkpoint: None); "
        "leave out --config to use the checkpoint's own"
    )
    assert not (tmp_path / "no").exists()


@pytest.mark.torchrun
def test_plan_reads_the_checkpoints_config_and_world_size(trained, capsys):
    from sb_titan.tools.plan import main as plan_main

    args = ["--data", "synthetic", "--checkpoint", str(trained), "--steps", "2", "--docs", "200"]
    assert plan_main([*args, "--policy", "sequential"]) == 0
    assert "shape: seq_len=512 dp=2 microbatches=1 rows=2; 2 steps" in capsys.readouterr().out
    assert plan_main([*args, "--config", str(DEBUG_TOML)]) == 2  # seq_len 1024 there
    err = capsys.readouterr().err.strip()
    assert err.startswith("sb-plan: error: --config ") and "\n" not in err
    assert "on training.seq_len = 1024 (checkpoint: 512); leave out --config" in err
