"""Rebuild the shipped tokenizer (sb_titan/assets/tokenizer) from the synthetic
corpus's vocabulary: `python -m sb_titan.tools.build_tokenizer` (deterministic)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sb_titan.data.synthetic import training_text
from sb_titan.data.tokenizer import BOS, EOS, PAD, TOKENIZER_DIR, VOCAB_SIZE


def build_tokenizer(out_dir: Path = TOKENIZER_DIR) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "add_bos_token": False}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="(Re)build the bundled tokenizer.")
    ap.add_argument("--out", type=Path, default=TOKENIZER_DIR, help="default: %(default)s")
    out = ap.parse_args().out
    t = build_tokenizer(out)
    print(f"wrote {out} (vocab {t.get_vocab_size()})")
