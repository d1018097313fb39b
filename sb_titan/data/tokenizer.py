"""The project's small byte-level BPE tokenizer (shipped; no downloads).

Byte-level so any text (sb-prep input, LongBench prompts) encodes without unknowns;
trained on the synthetic corpus's vocabulary so synthetic documents are compact.
Rebuild with `python -m sb_titan.tools.build_tokenizer` (deterministic).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"
VOCAB_SIZE = 1024
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


def load_tokenizer(path: str | Path = TOKENIZER_DIR) -> Tokenizer:
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer: {file} not found (expected a tokenizers JSON file)")
    return Tokenizer.from_file(str(file))


def special_tokens(path: str | Path = TOKENIZER_DIR) -> tuple[str | None, str | None, bool]:
    """(BOS, EOS, from_config) of the tokenizer in `path`: tokenizer_config.json's
    bos_token / eos_token where it has the key (null: none; Qwen2.5 has no BOS), else the
    shipped tokenizer's names (from_config False: they may be absent from the vocabulary)."""
    file = Path(path) / "tokenizer_config.json"
    config = json.loads(file.read_text()) if file.is_file() else {}

    def name(key: str, default: str) -> str | None:
        value = config.get(key, default)
        return value.get("content") if isinstance(value, dict) else value  # AddedToken form

    return name("bos_token", BOS), name("eos_token", EOS), file.is_file()
