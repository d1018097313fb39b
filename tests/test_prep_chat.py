"""`sb-prep --chat`: conversations rendered with the tokenizer's own chat template and a
loss mask on the answers; the loader turns the mask into IGNORE_INDEX labels, which
TorchTitan's loss skips. References: transformers' `apply_chat_template` (text and
ids) for the real Qwen2.5-Instruct, Qwen3 and Llama 3.2 templates
(tests/fixtures/chat_templates), and each family's answers written out by hand."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import REPO

from sb_titan.balance.sab import MicroBatchPlan, Piece
from sb_titan.data.chat import load_chat_template
from sb_titan.data.indexed import IndexedDataset
from sb_titan.data.loader import IGNORE_INDEX, pack_microbatch
from sb_titan.data.tokenizer import load_tokenizer
from sb_titan.tools.prep import main

CHATS = [
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "The long report says the key is 42. What is the key?"},
        {"role": "assistant", "content": "The key is 42."},
    ],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Say 'done'."},
        {"role": "assistant", "content": " done"},
    ],
]
TEMPLATES = REPO / "tests" / "fixtures" / "chat_templates"
QWEN = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
# family: (template, special tokens, added non-special tokens, tokenizer_config keys,
#          end of turn, the answers of CHATS[1] as the model generates them)
FAMILIES = {
    "qwen2.5": (
        "qwen2_5_instruct.jinja",
        QWEN,
        [],
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
        "<|im_end|>",
        ["Hi! How can I help?<|im_end|>", " done<|im_end|>"],
    ),
    "qwen3": (
        "qwen3_4b_2507.jinja",
        QWEN,
        ["<think>", "</think>"],
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
        "<|im_end|>",
        # the last answer is generated after the prompt's "<think>\n" (an empty thought)
        ["Hi! How can I help?<|im_end|>", "\n</think>\n\n done<|im_end|>"],
    ),
    "llama3": (
        "llama3_2_instruct.jinja",
        [*LLAMA, "<|eot_id|>"],
        [],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        "<|eot_id|>",
        ["Hi! How can I help?<|eot_id|>", "done<|eot_id|>"],  # the template trims content
    ),
}


def chat_tokenizer(path: Path, family: str, vocab_size: int = 400) -> Path:
    """A tiny byte-level BPE with the family's special tokens, and a tokenizer_config.json
    holding its real chat template. `PreTrainedTokenizerFast`: transformers reads the
    tiny tokenizer.json as it is (a Qwen2Tokenizer class would rebuild Qwen's own)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    template, specials, added, config, _, _ = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(m["content"] for c in CHATS for m in c) * 20], trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        **config,
        "chat_template": (TEMPLATES / template).read_text(),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


def reference(path: Path, chat: list[dict], end_of_turn: str) -> tuple[str, list, list]:
    """transformers' text and ids, and the mask: tokens starting between where the text
    leaves the prompt for each answer and the end of the family's end-of-turn token."""
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(path)
    text = hf.apply_chat_template(chat, tokenize=False)
    ids = hf.apply_chat_template(chat, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    spans = []
    for i, m in enumerate(chat):
        if m["role"] == "assistant":
            prompt = hf.apply_chat_template(chat[:i], tokenize=False, add_generation_prompt=True)
            start = len(os.path.commonprefix([text, prompt]))
            spans.append((start, text.index(end_of_turn, start) + len(end_of_turn)))
    offsets = hf(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    mask = [any(a <= s < b for a, b in spans) for s, _ in offsets]
    return text, list(ids), mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chat_template_matches_transformers(tmp_path, family):
    path = chat_tokenizer(tmp_path / family, family)
    tok = load_tokenizer(path)
    template = load_chat_template(path, tok)
    *_, end_of_turn, answers = FAMILIES[family]
    for chat in CHATS:
        text, ids, mask = reference(path, chat, end_of_turn)
        assert template.render(chat) == text
        got_ids, got_mask = template.encode(tok, chat)
        assert got_ids.tolist() == ids
        assert got_mask.tolist() == mask
    # The answers of CHATS[1], each a run of target tokens, as written out above.
    ids, mask = template.encode(tok, CHATS[1])
    runs, run = [], []
    for i, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            run.append(i)
        elif run:
            runs, run = [*runs, run], []
    runs += [run] if run else []
    assert [tok.decode(r, skip_special_tokens=False) for r in runs] == answers
    if family == "qwen2.5":  # the Instruct template's default system prompt is kept
        assert "You are Qwen, created by Alibaba Cloud." in template.render(CHATS[1])


@pytest.fixture()
def qwen(tmp_path) -> Path:
    return chat_tokenizer(tmp_path / "qwen", "qwen2.5")


def test_chat_tokens_mask_and_labels(tmp_path, qwen):
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(json.dumps({"messages": c, "id": i}) + "\n" for i, c in enumerate(CHATS))
    )
    out = tmp_path / "ds"
    argv = ["--input", str(data), "--out", str(out), "--tokenizer", str(qwen), "--chat", "--eos"]
    assert main([*argv, "--quiet"]) == 0
    tok = load_tokenizer(qwen)
    eos = tok.token_to_id("<|im_end|>")  # the Instruct tokenizer_config's eos_token
    ds = IndexedDataset(out)
    for i, chat in enumerate(CHATS):
        _, want_ids, want_mask = reference(qwen, chat, "<|im_end|>")
        n = int(ds.lengths[i])
        assert ds.read(i, 0, n).tolist() == [*want_ids, eos]
        assert ds.loss_mask(i, 0, n).tolist() == [*want_mask, False]
        assert sum(want_mask) >= 6  # the answers and their <|im_end|>
    meta = json.loads((out / "meta.json").read_text())
    assert meta["loss_mask"] == "loss_mask.bin" and meta["chat_template"] == "tokenizer"
    assert meta["text_field"] == "messages"

    # The loader: a label is the next token where that token is a target, else ignored;
    # a piece cut from the middle of a conversation keeps its part of the mask.
    n0 = int(ds.lengths[0])
    mb = MicroBatchPlan(rows=[[Piece(0, 0, n0), Piece(1, 3, 20)]])
    tokens, labels, _ = pack_microbatch(ds, mb, seq_len=n0 + 24, pad_id=0)
    want = []
    for piece in mb.rows[0]:
        t = ds.read(piece.sample_id, piece.start, piece.length)
        m = ds.loss_mask(piece.sample_id, piece.start, piece.length)
        want += [int(t[j + 1]) if m[j + 1] else IGNORE_INDEX for j in range(piece.length - 1)]
        want.append(IGNORE_INDEX)
    assert labels[0, : len(want)].tolist() == want
    assert (labels[0, len(want) :] == IGNORE_INDEX).all()

    # TorchTitan's loss sums over the targets only (and the trainer divides by their count).
    from torchtitan.components.loss import cross_entropy_loss

    logits = torch.randn(1, tokens.shape[1], tok.get_vocab_size(), dtype=torch.float64)
    keep = labels[0] != IGNORE_INDEX
    manual = -torch.log_softmax(logits[0, keep], -1)[torch.arange(int(keep.sum())), labels[0, keep]]
    assert torch.allclose(cross_entropy_loss(logits, labels), manual.sum().float(), rtol=1e-6)


def test_chat_malformed_and_refused_inputs(tmp_path, qwen, capsys):
    rows = [
        {"messages": CHATS[0]},
        {"messages": "just text"},
        {"messages": [{"role": "user", "content": "no answer"}]},
        {"messages": [{"role": "assistant"}]},
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["--input", str(data), "--tokenizer", str(qwen), "--chat", "--quiet"]
    assert main([*base, "--out", str(tmp_path / "a"), "--max-malformed", "1"]) == 0
    err = capsys.readouterr().err
    assert f"{data}:2: 'messages' is str, not a list of messages" in err
    assert f"{data}:3: no assistant message (nothing to train on)" in err
    assert f'{data}:4: \'messages\'[0] is not a {{"role": str, "content": str}} message' in err
    assert len(IndexedDataset(tmp_path / "a")) == 1
    # A plain dataset has no mask: every label is a target.
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"text": "hello"}) + "\n")
    assert main(["--input", str(plain), "--out", str(tmp_path / "p"), "--quiet"]) == 0
    assert IndexedDataset(tmp_path / "p").loss_mask(0, 0, 1) is None
    assert not (tmp_path / "p" / "loss_mask.bin").exists()
    # The shipped tokenizer has no chat template; a .txt file holds no conversation.
    assert main([*base[:2], "--chat", "--out", str(tmp_path / "b"), "--quiet"]) == 1
    assert "tokenizer_config.json: no chat_template (nor chat_template.jinja): --chat " in (
        capsys.readouterr().err
    )
    (tmp_path / "a.txt").write_text("text")
    argv = ["--input", str(tmp_path / "a.txt"), "--chat", "--out", str(tmp_path / "c")]
    assert main([*argv, "--quiet"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"sb-prep: error: {tmp_path / 'a.txt'}: --chat reads conversations from JSONL, "
        "Parquet, Arrow or datasets records, not txt input"
    )
    assert not (tmp_path / "c" / "meta.json").exists()
