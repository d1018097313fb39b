"""The key-value retrieval probe: construction, scoring and the CLI on a tiny checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

import sb_titan.eval.retrieval as retrieval
from sb_titan.data.tokenizer import load_tokenizer
from sb_titan.eval.checkpoint import load_from_config
from sb_titan.eval.generate import GenerationResult
from sb_titan.eval.retrieval import ProbeBuilder, RetrievalConfig, parse_lengths, run_retrieval
from sb_titan.tools.eval import main as eval_main

DEBUG_TOML = Path(__file__).resolve().parents[1] / "train_configs" / "debug_cpu.toml"


def test_parse_lengths():
    assert parse_lengths("1k, 2k,512,0.5k") == [1024, 2048, 512, 512]


def test_probe_layout_matches_the_training_corpus():
    tok = load_tokenizer()
    builder = ProbeBuilder(tok)
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    for depth in (0.0, 0.5, 1.0):
        probe = builder.build(300, depth, np.random.default_rng(0))
        assert len(probe.ids) == 300 and probe.ids[0] == tok.token_to_id("<|bos|>")
        text = tok.decode(probe.ids[probe.fact_at :])
        assert text.startswith(" key ") and text.split()[2] == ":"
        key = text.split()[1]
        query = enc(f" recall key {key} :")
        assert probe.ids[-len(query) :] == query
        # the query + value tokenise exactly as the corpus's " recall key K : V ."
        value = tok.decode(probe.answer)
        assert enc(f" recall key {key} :{value} .") == query + probe.answer + enc(" .")
        assert f" key {key} :{value} ." in tok.decode(probe.ids)
    first = builder.build(300, 0.0, np.random.default_rng(0))
    last = builder.build(300, 1.0, np.random.default_rng(0))
    assert first.fact_at == 1 and last.fact_at + len(enc(" key 1 : 2 .")) <= 300


def test_exact_match_scoring(monkeypatch):
    """An oracle decoder scores 1.0 everywhere; one that is off by a token scores 0."""
    builder = ProbeBuilder(load_tokenizer())
    cfg = RetrievalConfig(lengths=[128], depths=[0.0, 1.0], trials=3, batch_size=2)
    answers = {}
    for di, depth in enumerate(cfg.depths):
        rng = np.random.default_rng([cfg.seed, 0, di])
        for _ in range(cfg.trials):
            p = builder.build(128, depth, rng)
            answers[tuple(p.ids)] = p.answer

    def oracle(model, prompt, n_new, **kwargs):
        return GenerationResult([answers[tuple(row.tolist())] for row in prompt], torch.zeros(1))

    monkeypatch.setattr(retrieval, "greedy_generate", oracle)
    report = run_retrieval(None, builder.tokenizer, cfg, progress=lambda *_: None)
    assert report["accuracy"] == {"128": {"0": 1.0, "1": 1.0}}

    def off_by_one(model, prompt, n_new, **kwargs):
        return GenerationResult(
            [[t + 1 for t in answers[tuple(r.tolist())]] for r in prompt], torch.zeros(1)
        )

    monkeypatch.setattr(retrieval, "greedy_generate", off_by_one)
    assert run_retrieval(None, builder.tokenizer, cfg, progress=lambda *_: None)["mean"] == 0.0


def test_cli_on_a_tiny_checkpoint(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = load_from_config(None, DEBUG_TOML).model
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "checkpoint" / "step-2"))
    out = tmp_path / "eval"
    eval_main(
        [
            "retrieval",
            "--checkpoint",
            str(tmp_path),
            "--config",
            str(DEBUG_TOML),
            "--lengths",
            "200,0.25k",
        ]
        + [
            "--depths",
            "0,1",
            "--trials",
            "2",
            "--batch-size",
            "2",
            "--out",
            str(out),
            "--threads",
            "1",
        ]
    )
    printed = capsys.readouterr().out
    assert "length \\ depth" in printed and "sparse prefill, budget 0.9" in printed
    report = json.loads((out / "retrieval.json").read_text())
    assert set(report["accuracy"]) == {"200", "256"}
    assert all(0.0 <= v <= 1.0 for row in report["accuracy"].values() for v in row.values())
    assert (out / "retrieval.png").read_bytes()[:4] == b"\x89PNG"
