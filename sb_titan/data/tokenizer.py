"""The project's small byte-level BPE tokenizer (shipped; no downloads).

Byte-level so any text (sb-prep input, LongBench prompts) encodes without unknowns;
trained on the synthetic corpus's vocabulary so synthetic documents are compact.
Rebuild with `python -m sb_titan.tools.build_tokenizer` (deterministic).
"""

from __future__ import annotations

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
