"""Shared helpers: launch real torchrun jobs and read what they wrote."""

from __future__ import annotations

import contextlib
import json
import multiprocessing.forkserver
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from sb_titan.util.source_tree import use_source_kernels

# Only torch-free or torch-only imports up here: the kernel tests must collect on a
# machine with torch, Triton and numpy alone (no install, no torchtitan, no
# tensorboard); what needs more is imported inside the function that uses it.
use_source_kernels()

REPO = Path(__file__).resolve().parents[1]
DEBUG_TOML = REPO / "train_configs" / "debug_cpu.toml"
# Small, fast settings on top of the default CPU config (rows <= 4096 tokens).
TINY = [
    "--training.seq_len",
    "512",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--debug.seed",
    "0",
]


def cpu_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def torchrun(
    nproc: int,
    args: list[str],
    dump: Path,
    timeout: int = 300,
    config: Path = DEBUG_TOML,
    env: dict[str, str] | None = None,
    check: bool = True,
    fixture: str | None = None,
    **forked,
) -> subprocess.CompletedProcess:
    """Train `sb_titan.tools.train` on `nproc` CPU ranks under torchrun's elastic agent,
    every rank patched by tests/fixtures/`fixture` if given; a failed run fails the
    test unless `check` is False (then read its returncode). `forked`: forked_torchrun's
    `max_restarts` and `rank_env`.

    Without `env`, the agent runs in this process and forks each rank from a server
    that imported the trainer once (`forked_torchrun`). With `env` (the Triton
    interpreter, which must be on before Triton is imported), sb-launch runs as a
    command: its own server imports the trainer with that environment."""
    argv = ["--config_file", str(config), "--dump_folder", str(dump), *TINY, *args]
    if env is None:
        return forked_torchrun(nproc, argv, timeout, check, fixture, **forked)
    assert fixture is None and not forked, "fixtures and restarts are forked_torchrun's"
    cmd = [sys.executable, "-m", "sb_titan.tools.launch", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", "--", *argv]
    proc = subprocess.run(
        cmd, cwd=REPO, env=cpu_env(**env), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def patched_train(fixture: str | None, rank_env: dict[str, str], argv: list[str]) -> None:
    """A forked process's entry point: set `rank_env`, apply tests/fixtures/`fixture` if
    given, run `sb_titan.tools.train.main(argv)`.
    Each fixture replaces attributes that every caller looks up when it calls (a trainer
    method; `dist.all_gather_object`, which no module imports by name;
    `checkpoint.finalize`), so the patch reaches the modules the forkserver imported."""
    os.environ.update(rank_env)
    if fixture is not None:
        runpy.run_path(str(REPO / "tests" / "fixtures" / fixture / "sitecustomize.py"))
    from sb_titan.tools.train import main

    main(argv)


def forked_torchrun(
    nproc: int,
    argv: list[str],
    timeout: int = 300,
    check: bool = True,
    fixture: str | None = None,
    max_restarts: int = 0,
    rank_env: dict[str, str] | None = None,
    entry: Callable[..., None] | None = None,
) -> subprocess.CompletedProcess:
    """torchrun, with its own parser, rendezvous (what `--standalone` sets), elastic
    agent and restarts, gloo ranks as processes, and the training entry point as a
    function (`sb_titan.tools.train.main`), as torch.distributed.run's API allows; or
    `entry(*argv)` in its place (a function of a test's rank module). The
    ranks are forked from a forkserver (start method "forkserver") that preloaded the
    trainer (sb-launch's FORK_PRELOAD), so a launch costs its training, not ~12 CPU s
    of imports per rank. `rank_env` is set in each rank (the agent passes only its own
    variables). What each rank prints, every attempt in order, goes to its log files,
    returned as the process's stdout / stderr (rank order); the returncode is the
    first failed rank's exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    logs = Path(tempfile.mkdtemp(prefix="torchrun_logs_"))  # outside every run's folder
    launcher = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    launcher += ["--rdzv-id", str(uuid.uuid4()), f"--nproc-per-node={nproc}"]
    launcher += ["--start-method", "forkserver", "--log-dir", str(logs), "--redirects", "3"]
    launcher += [f"--max-restarts={max_restarts}"]
    launch, _, _ = config_from_args(parse_args([*launcher, "-m", "sb_titan.tools.train"]))
    _start_forkserver()
    handlers = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}  # the agent sets them

    def _timed_out(*_):
        raise TimeoutError(f"torchrun ran past {timeout} s")

    signal.signal(signal.SIGALRM, _timed_out)
    signal.alarm(timeout)
    failure, returncode = None, 0
    try:
        if entry is None:
            elastic_launch(launch, patched_train)(fixture, rank_env or {}, argv)
        else:
            elastic_launch(launch, entry)(*argv)
    except ChildFailedError as err:
        failure, returncode = err, err.get_first_failure()[1].exitcode or 1
    except TimeoutError as err:
        failure, returncode, check = err, 1, True
        _kill_forked_ranks()
    finally:
        signal.alarm(0)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    out = [_read_rank_logs(logs, rank, name) for name in ("stdout", "stderr")
           for rank in range(nproc)]  # fmt: skip
    stdout, stderr = "".join(out[:nproc]), "".join(out[nproc:])
    shutil.rmtree(logs, ignore_errors=True)
    if check and failure is not None:
        pytest.fail(f"torchrun failed ({failure}):\n{stdout[-4000:]}\n{stderr[-6000:]}")
    return subprocess.CompletedProcess(["torchrun", *launcher, *argv], returncode, stdout, stderr)


_AGENT_SIGNALS = [getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGALRM")]


def _start_forkserver() -> None:
    """Start this process's forkserver on first use (later calls check it is alive),
    with the trainer preloaded and one intra-op thread per rank (what torchrun sets; a
    forked rank keeps the server's environment)."""
    from sb_titan.tools.launch import FORK_PRELOAD

    multiprocessing.forkserver.set_forkserver_preload(FORK_PRELOAD)
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "PYTHONUNBUFFERED")}
    os.environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value


def forked_train_cli(
    argv: list[str], timeout: int = 300, **env: str
) -> subprocess.CompletedProcess:
    """`python -m sb_titan.tools.train ARGV` as a process of its own (fresh process state,
    its own stdout / stderr and exit status) forked from this test process's server,
    which imported the trainer once: what a command-line check costs, not ~12 CPU s of
    imports. `env` is set in the child."""
    _start_forkserver()
    context = multiprocessing.get_context("forkserver")
    with tempfile.TemporaryDirectory(prefix="sb_train_cli_") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        child = context.Process(target=_train_cli_child, args=(argv, env, out, err))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            pytest.fail(f"sb_titan.tools.train {argv} ran past {timeout} s")
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    cmd = [sys.executable, "-m", "sb_titan.tools.train", *argv]
    return subprocess.CompletedProcess(cmd, child.exitcode, stdout, stderr)


def _train_cli_child(argv: list[str], env: dict[str, str], out: Path, err: Path) -> None:
    for fd, path in ((1, out), (2, err)):  # the process's own stdout / stderr
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    patched_train(None, env, argv)


def pytest_sessionfinish(session, exitstatus) -> None:
    """Stop this process's forkserver and reap it, so that its ranks' CPU time counts as
    this process's children's, as a torchrun command's would (what the suite's CPU
    figures in CONTRIBUTING.md measure)."""
    from sb_titan.compat.forkserver import stop_forkserver

    stop_forkserver()


def _kill_forked_ranks() -> None:
    """Kill the ranks a timed-out launch left running: the forkserver's children, so
    this process's grandchildren."""
    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    children = {pid for pid, ppid in parent.items() if ppid == os.getpid()}
    for pid, ppid in parent.items():
        if ppid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _read_rank_logs(logs: Path, rank: int, name: str) -> str:
    """What local rank `rank` wrote to `name` (the agent's `--log-dir`), every attempt in
    order."""
    found = sorted(
        logs.glob(f"*/attempt_*/{rank}/{name}.log"),
        key=lambda p: int(p.parents[1].name.removeprefix("attempt_")),
    )
    return "".join(path.read_text(errors="replace") for path in found)


def prelaunch_refused(capsys, tmp_path, *args: str, config=DEBUG_TOML, how="prelaunch") -> str:
    """What the launcher runs before any rank spawns (`sb_titan.tools.train.prelaunch`),
    or `--check-config` (`how="check-config"`): exit status 2 and one line on stderr (log
    records go to stdout); nothing is written."""
    from sb_titan.tools.train import main, prelaunch

    dump = tmp_path / "run"
    argv = ["--config_file", str(config), "--dump_folder", str(dump), *args]
    with pytest.raises(SystemExit) as exit_:
        if how == "check-config":
            main(["--check-config", *argv])
        else:
            prelaunch(argv, max_restarts=0)
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sb_titan: config error: "), err
    assert str(config) in lines[0]
    assert not dump.exists()  # no rank spawns, no run folder
    return lines[0]


def scalars(dump: Path, tag: str) -> dict[int, float]:
    """step -> value of a TensorBoard scalar the run wrote under dump/tb."""
    from sb_titan.runtime.tensorboard import read_scalars

    return read_scalars(dump).get(tag, {})


def losses(dump: Path) -> list[float]:
    by_step = scalars(dump, "loss_metrics/global_avg_loss")
    return [by_step[s] for s in sorted(by_step)]


def sample_log(dump: Path, rank: int = 0) -> list[dict]:
    path = dump / f"samples_rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


RUN_DIGESTS = REPO / "tests" / "fixtures" / "run_digests.json"


def assert_run_digest(key: str, dump: Path, ranks: int) -> None:
    """The plans, budgets and cost-model snapshots every rank logged (its sample log)
    are what they were when recorded in tests/fixtures/run_digests.json: a refactoring of
    the balance loop must not change them. Re-record (copy the digest this prints) only
    for a change meant to alter plans or budgets, and say so in the commit."""
    import hashlib

    logs = [sample_log(dump, rank) for rank in range(ranks)]
    digest = hashlib.sha1(json.dumps(logs, sort_keys=True).encode()).hexdigest()
    recorded = json.loads(RUN_DIGESTS.read_text()).get(key)
    assert recorded == digest, f"{key}: recorded {recorded}, this run {digest}"


# The debug flavor's shapes (sb_titan/models/qwen2_5) as transformers Qwen2Config
# arguments: a tiny HF checkpoint that loads into `model.flavor = "debug"`.
DEBUG_HF_SHAPE = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


# transformers' config and model classes by config.json model_type.
HF_CLASSES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}


def tiny_hf(path: Path, model_type: str, tied: bool, **overrides):
    """A small random transformers model of `model_type` (qwen2, qwen3, llama), saved to
    `path`; `overrides` are its config's arguments. Biases (qwen2) and QK-norm weights
    (qwen3) are non-zero / non-one, so that a dropped one would show."""
    import torch
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[model_type])
    kwargs = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )
    config = config_cls(**{**kwargs, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0, 0.5)
            for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
                if norm is not None:
                    norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


def tiny_hf_qwen2(path: Path, tied: bool, **overrides):
    """A small random transformers Qwen2 (non-zero q/k/v biases), saved to `path`;
    `overrides` are Qwen2Config arguments (e.g. rope_theta, or the debug flavor's dims)."""
    return tiny_hf(path, "qwen2", tied, **overrides)


def indexed_args(path: Path) -> list[str]:
    """CLI overrides that train on the sb-prep dataset at `path`."""
    return ["--dataloader.dataset", "indexed", "--dataloader.dataset_path", str(path)]


# Qwen2.5's special tokens and the tokenizer_config.json keys sb_titan reads (the
# released files: no BOS, <|endoftext|> ends documents and pads).
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_TOKENIZER_CONFIG = {
    "bos_token": None,
    "eos_token": "<|endoftext|>",
    "pad_token": "<|endoftext|>",
    "add_bos_token": False,
    "tokenizer_class": "Qwen2Tokenizer",
}


def tiny_qwen_tokenizer(
    path: Path, vocab_size: int = 320, text: str = "", chat_template: bool = False
) -> Path:
    """A small byte-level BPE with Qwen2.5's special tokens and tokenizer_config.json
    (the real one is 151,665 ids; the tiny models here have a few hundred); with
    `chat_template`, the config carries Qwen2.5-Instruct's template (sb-prep --chat)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=QWEN_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = text or "The quick brown fox jumps over the lazy dog. " * 50
    tok.train_from_iterator([corpus], trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = dict(QWEN_TOKENIZER_CONFIG)
    if chat_template:
        template = REPO / "tests" / "fixtures" / "chat_templates" / "qwen2_5_instruct.jinja"
        config["chat_template"] = template.read_text()
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


# -- two workers (./run_tests.sh runs pytest-xdist with --dist loadfile) --------------------------
SLOWEST_MODULES = [
    "test_cp_training",
    "test_launch",
    "test_accuracy_bench",
    "test_elastic",
    "test_train_torchrun",
    "test_kernels",
    "test_checkpoint_integrity",
    "test_triton_training",
    "test_dst_torchrun",
    "test_run_lock",
    "test_flex",
    "test_compile",
    "test_gpu_bench",
    "test_readme",
    "test_family_training",
    "test_preflight",
    "test_dst_balance",
    "test_selection_estimators",
    "test_memory",
    "test_dense_attention",
    "test_dst_solve",
    "test_model_spec",
]
"""Handed out first (the slowest measured with empty compile caches, as on a fresh CI
machine; CONTRIBUTING.md): run_tests.sh gives whole modules (`--dist loadfile`) to the
worker that is free, in this order, so a module's module-scoped runs launch once, and a
long module started last would finish last."""


def pytest_collection_modifyitems(config, items):
    """The slowest modules first."""
    rank = {m: i for i, m in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))


@pytest.fixture
def keep_torch_threads():
    """For a test that runs a bench's `main` in this process (the bench sets torch's
    threads for its timing or scoring): the worker gets its own count back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A randomly initialised debug model saved as a DCP step (the eval CLIs' input)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from sb_titan.eval.checkpoint import load_from_config

    torch.manual_seed(0)
    model = load_from_config(None, DEBUG_TOML).model
    step = tmp_path_factory.mktemp("dump") / "checkpoint" / "step-1"
    dcp.save(model.state_dict(), checkpoint_id=str(step))
    return step


@pytest.fixture(scope="session")
def seed_ckpt(tmp_path_factory) -> Path:
    """One checkpoint every multi-process run starts from, so runs with different
    parallel layouts (1 process, FSDP, PP, CP) start from the same weights."""
    dump = tmp_path_factory.mktemp("seed")
    torchrun(
        1,
        ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint", "--training.steps", "1"],
        dump,
    )
    step0 = dump / "checkpoint" / "step-0"
    assert step0.is_dir()
    return step0


def from_seed(seed_ckpt: Path, steps: int) -> list[str]:
    return [
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1000",
        "--checkpoint.initial_load_path",
        str(seed_ckpt),
        "--training.steps",
        str(steps),
    ]


# -- kernel tests' child processes (tests/test_kernels.py, tests/test_block_max_kernel.py)
KERNEL_CHILD_TIMEOUT_S = 600


def start_kernel_child(script: str, mode: str, env: dict[str, str]) -> subprocess.Popen:
    """`python SCRIPT MODE`: a fresh interpreter, so the Triton interpreter setting (read
    when Triton is imported) never leaks between the interpreter, AOT and GPU runs."""
    env = {**os.environ, **env, "OMP_NUM_THREADS": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    if mode in ("aot", "gpu"):
        env.pop("TRITON_INTERPRET", None)
        env.pop("SB_TRITON_UPCAST", None)
    return subprocess.Popen(
        [sys.executable, script, mode],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def collect_kernel_child(proc: subprocess.Popen) -> dict:
    """The JSON a child printed last; its stderr tail if it failed."""
    try:
        stdout, stderr = proc.communicate(timeout=KERNEL_CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        pytest.fail(f"child failed ({proc.returncode}):\n{stderr[-4000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def stop_kernel_children(procs: dict[str, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
