"""The README's "Train your own" section, run end to end on CPU from its own code blocks,
in a scratch checkout (so the docs cannot drift: a changed command is the command run).

Every substitution, and nothing else:
  1 install      not run: the scratch checkout's .venv runs this test's interpreter.
  2 download     not run: a tiny Qwen2 with the debug flavor's shapes and a
                 Qwen2.5-style tokenizer are written to the command's --local-dir.
  3 sb-prep      run as written; the test writes the corpus it reads (CORPUS).
  4 sb-profile   run with CPU + TINY_GRID appended (a 2 x 2 grid on CPU).
  5 edit         the bash block runs as written; the toml block's keys are then set in
                 the file it copied to, as a user would edit it.
  6 launch       run with NGPU=1 and CPU + STEPS appended.
  7 tensorboard  not served: its --logdir must hold the run's loss.
A step's ```text block is its expected output: each line must appear in what the step
printed (ANSI colours and repeated spaces aside); `<...>` in it matches anything.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import DEBUG_HF_SHAPE, REPO, tiny_hf_qwen2, tiny_qwen_tokenizer

from sb_titan.runtime.tensorboard import read_scalars

pytest.importorskip("transformers")

SECTION = "## Train your own"
# The 0.5B config shrunk to a CPU run: the debug flavor's shapes, 1024-token rows, one
# process (no PP, no FSDP), fp32 compute.
CPU = [
    "--model.flavor", "debug",
    "--training.seq_len", "1024",
    "--training.local_batch_size", "1",
    "--training.mixed_precision_param", "float32",
    "--parallelism.pipeline_parallel_degree", "1",
    "--parallelism.data_parallel_shard_degree", "-1",
]  # fmt: skip
TINY_GRID = ["--device", "cpu", "--lengths", "256", "1024", "--densities", "0.5", "1.0"]
TINY_GRID += ["--repeats", "1"]
STEPS = ["--training.steps", "3"]
CORPUS = "my_corpus/*.jsonl.gz"
WORDS = "the long context of a book keeps its sparse attention balanced across ranks".split()
ANSI = re.compile(r"\x1b\[[0-9;]*m")


# -- reading the section -------------------------------------------------------------------
def readme_steps() -> dict[int, list[tuple[str, str]]]:
    """Step number -> its fenced blocks (language, text), in order."""
    text = (REPO / "README.md").read_text()
    assert SECTION in text, f"README.md: no section '{SECTION}'"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    steps: dict[int, list[tuple[str, str]]] = {}
    parts = re.split(r"^### (\d+)\. .*$", section, flags=re.M)
    for number, body in zip(parts[1::2], parts[2::2], strict=True):
        blocks = re.findall(r"^```(\w+)\n(.*?)^```$", body, flags=re.M | re.S)
        steps[int(number)] = blocks
    return steps


def blocks(step: list[tuple[str, str]], lang: str) -> list[str]:
    return [text for kind, text in step if kind == lang]


def commands(step: list[tuple[str, str]]) -> list[str]:
    """The step's shell commands (continuation lines joined, comments dropped)."""
    joined = "\n".join(blocks(step, "bash")).replace("\\\n", " ")
    return [c.strip() for c in joined.splitlines() if c.strip() and not c.startswith("#")]


def expect(step: list[tuple[str, str]], output: str) -> None:
    got = [" ".join(ANSI.sub("", line).split()) for line in output.splitlines()]
    for want in "\n".join(blocks(step, "text")).splitlines():
        parts = [re.escape(" ".join(p.split())) for p in re.split(r"<[^>]*>", want)]
        pattern = re.compile(".*".join(parts))
        assert any(pattern.search(line) for line in got), (
            f"expected output line not printed: {want!r}\n{output[-3000:]}"
        )


# -- the scratch checkout ---------------------------------------------------------------------
def scratch_checkout(root: Path) -> dict[str, str]:
    """What the commands read from a clone, with a .venv running this interpreter
    (stamped as set up, so run_train.sh installs nothing); returns their environment."""
    for name in ("run_train.sh", "pyproject.toml"):
        shutil.copy2(REPO / name, root / name)
    for name in ("scripts", "train_configs"):
        shutil.copytree(REPO / name, root / name)
    bin_dir = Path(sys.executable).parent
    venv = root / ".venv" / "bin"
    venv.mkdir(parents=True)
    for tool, target in (("python", sys.executable), ("torchrun", bin_dir / "torchrun")):
        (venv / tool).write_text(f'#!/bin/sh\nexec "{target}" "$@"\n')
        (venv / tool).chmod(0o755)
    stamp = hashlib.sha1((root / "pyproject.toml").read_bytes()).hexdigest()
    (root / ".venv" / ".sb_titan_deps").write_text(stamp + "\n")
    for tool in ("sb-prep", "sb-profile", "torchrun"):
        if not (bin_dir / tool).exists():
            pytest.skip(f"{tool} is not installed beside {sys.executable} (pip install -e .)")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def run(command: str, root: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + command],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"README command failed ({proc.returncode}): {command}\n{out[-6000:]}"
    )
    return out


def write_corpus(root: Path) -> str:
    """Two gzipped JSONL shards of documents from a few dozen to ~1500 words."""
    rng = random.Random(0)
    texts = []
    for shard in range(2):
        docs = [" ".join(rng.choices(WORDS, k=rng.choice([30, 200, 600, 1500]))) for _ in range(40)]
        texts += docs
        lines = "".join(json.dumps({"text": d}) + "\n" for d in docs)
        path = root / CORPUS.replace("*", f"part-{shard:03d}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(gzip.compress(lines.encode()))
    return " ".join(texts)


def set_keys(config: Path, edit: str) -> None:
    """Set the TOML `edit`'s keys in `config` by editing lines, as a user would: a key
    present (or commented out) in its section is replaced, else added to the section,
    else the section is appended."""
    lines = config.read_text().splitlines()
    section = ""
    for raw in edit.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key = line.split("=", 1)[0].strip()
        lines = _set_line(lines, section, key, line)
    config.write_text("\n".join(lines) + "\n")
    got, want = tomllib.loads(config.read_text()), tomllib.loads(edit)
    for name, value in want.items():
        assert got.get(name) == value or all(got[name][k] == v for k, v in value.items())


def _set_line(lines: list[str], section: str, key: str, new: str) -> list[str]:
    headers = [i for i, line in enumerate(lines) if line.lstrip().startswith("[")]
    if section:
        named = [i for i in headers if lines[i].strip() == f"[{section}]"]
        if not named:  # no such section: append it
            return [*lines, "", f"[{section}]", new]
        start = named[0] + 1
    else:
        start = 0
    end = next((i for i in headers if i >= start), len(lines))
    key_line = re.compile(rf"^#?\s*{re.escape(key)}\s*=")
    for i in range(start, end):
        if key_line.match(lines[i]):
            return [*lines[:i], new, *lines[i + 1 :]]
    while end > start and not lines[end - 1].strip():
        end -= 1
    return [*lines[:end], new, *lines[end:]]


# -- the test -----------------------------------------------------------------------------------
@pytest.mark.torchrun
def test_train_your_own_runs_as_written(tmp_path):
    steps = readme_steps()
    assert sorted(steps) == [1, 2, 3, 4, 5, 6, 7], sorted(steps)
    root = tmp_path / "checkout"
    root.mkdir()
    env = scratch_checkout(root)

    # 1. Install: replaced (this environment is the installed one); the block must be
    # the GPU install.
    install = "\n".join(commands(steps[1]))
    assert "download.pytorch.org/whl/cu" in install and "pip install -e" in install

    # 2. Download: replaced by a tiny local checkpoint where the command puts it.
    [download] = commands(steps[2])
    argv = shlex.split(download)
    assert argv[:3] == ["hf", "download", argv[2]] and argv[2].startswith("Qwen/Qwen2.5-")
    local_dir = root / argv[argv.index("--local-dir") + 1]
    text = write_corpus(root)
    tiny_hf_qwen2(local_dir, False, **DEBUG_HF_SHAPE)
    tiny_qwen_tokenizer(local_dir, vocab_size=1024, text=text)

    # 3. sb-prep, as written.
    assert any(CORPUS in c for c in commands(steps[3])), f"step 3 no longer reads {CORPUS}"
    expect(steps[3], run("\n".join(commands(steps[3])), root, env))

    # 4. sb-profile, on CPU with a tiny grid.
    profile = [c + " " + shlex.join(CPU + TINY_GRID) for c in commands(steps[4])]
    assert all(c.startswith("sb-profile ") for c in profile), profile
    expect(steps[4], run("\n".join(profile), root, env))

    # 5. Copy a shipped config, then set the keys the toml block shows.
    [copy] = commands(steps[5])
    run(copy, root, env)
    [edit] = blocks(steps[5], "toml")
    set_keys(root / shlex.split(copy)[-1], edit)

    # 6. Launch: one CPU process, a few steps.
    launch = [re.sub(r"\bNGPU=\d+", "NGPU=1", c) for c in commands(steps[6])]
    assert all("./run_train.sh" in c for c in launch), launch
    out = run("\n".join(c + " " + shlex.join(CPU + STEPS) for c in launch), root, env)
    expect(steps[6], out)

    # 7. TensorBoard: not served; the folder it is pointed at holds the run's loss.
    [board] = commands(steps[7])
    argv = shlex.split(board)
    assert argv[0] == "tensorboard"
    logdir = root / argv[argv.index("--logdir") + 1]
    assert logdir.name == "tb"
    assert 1 in read_scalars(logdir.parent)["loss_metrics/global_avg_loss"]
