"""Conversations → tokens + loss mask, for supervised fine-tuning (`sb-prep --chat`).

The template is ChatML, Qwen2.5's own chat format (its tokenizer_config.json
chat_template, without the default system prompt the Instruct template adds):

    <|im_start|>{role}\\n{content}<|im_end|>\\n        for every message

Only assistant turns are targets: their content and the <|im_end|> that closes them
(so the model learns to stop). Everything else, the prompt included, is context. The
loss mask rides with the tokens to the loader, which sets the other labels to
IGNORE_INDEX: TorchTitan's cross-entropy skips them and divides by the targets only.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


def chatml_ids(tok: Tokenizer) -> tuple[int, int] | None:
    """The ids of <|im_start|> and <|im_end|>, or None when the tokenizer lacks them."""
    start, end = tok.token_to_id(IM_START), tok.token_to_id(IM_END)
    return None if start is None or end is None else (start, end)


def render_chatml(tok: Tokenizer, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, loss mask) of one conversation. Each piece is tokenized on its own:
    the special tokens split the text there anyway, so the ids are those of the whole
    rendered string."""
    pieces: list[tuple[str, bool]] = []
    for m in messages:
        target = m["role"] == "assistant"
        pieces += [(f"{IM_START}{m['role']}\n", False), (m["content"], target)]
        pieces += [(IM_END, target), ("\n", False)]
    encoded = tok.encode_batch([text for text, _ in pieces], add_special_tokens=False)
    ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encoded])
    targets = [t for _, t in pieces]
    mask = np.concatenate([np.full(len(e.ids), t) for e, t in zip(encoded, targets, strict=True)])
    return ids, mask
