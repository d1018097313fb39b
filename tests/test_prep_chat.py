"""`sb-prep --chat`: conversations rendered in ChatML (Qwen2.5's chat format) with a loss
mask on the assistant turns; the loader turns the mask into IGNORE_INDEX labels, which
TorchTitan's loss skips. References: the whole rendered string tokenized at once, and
the targets found from the tokenizer's character offsets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_qwen_tokenizer

from sb_titan.balance.sab import MicroBatchPlan, Piece
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


def render(messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """ChatML text and the character spans that are targets (assistant content + its
    <|im_end|>), written out independently of sb_titan/data/chat.py."""
    text, spans = "", []
    for m in messages:
        text += f"<|im_start|>{m['role']}\n"
        start = len(text)
        text += m["content"] + "<|im_end|>"
        if m["role"] == "assistant":
            spans.append((start, len(text)))
        text += "\n"
    return text, spans


@pytest.fixture()
def qwen(tmp_path) -> Path:
    corpus = " ".join(m["content"] for chat in CHATS for m in chat) * 20
    return tiny_qwen_tokenizer(tmp_path / "qwen", text=corpus)


def test_chat_tokens_mask_and_labels(tmp_path, qwen):
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(json.dumps({"messages": c, "id": i}) + "\n" for i, c in enumerate(CHATS))
    )
    out = tmp_path / "ds"
    argv = ["--input", str(data), "--out", str(out), "--tokenizer", str(qwen), "--chat", "--eos"]
    assert main([*argv, "--quiet"]) == 0
    tok = load_tokenizer(qwen)
    eos = tok.token_to_id("<|endoftext|>")
    ds = IndexedDataset(out)
    for i, chat in enumerate(CHATS):
        text, spans = render(chat)
        enc = tok.encode(text, add_special_tokens=False)
        want_mask = [any(a <= s and e <= b for a, b in spans) for s, e in enc.offsets]
        n = int(ds.lengths[i])
        assert ds.read(i, 0, n).tolist() == [*enc.ids, eos]
        assert ds.loss_mask(i, 0, n).tolist() == [*want_mask, False]
        assert sum(want_mask) >= 6  # the answers and their <|im_end|>
    meta = json.loads((out / "meta.json").read_text())
    assert meta["loss_mask"] == "loss_mask.bin" and meta["chat_template"] == "chatml"
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
    # The shipped tokenizer has no ChatML tokens; a .txt file holds no conversation.
    assert main([*base[:2], "--chat", "--out", str(tmp_path / "b"), "--quiet"]) == 1
    assert "--chat renders ChatML (Qwen2.5's chat format) and needs <|im_start|> and " in (
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
