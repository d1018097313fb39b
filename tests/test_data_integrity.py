"""Dataset checksums: sb-prep records one per chunk, a run verifies each chunk at its first
read, `sb-prep --verify` checks them all, and datasets written before them still load."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xxhash
from conftest import DEBUG_TOML, indexed_args, tiny_qwen_tokenizer

from sb_titan.data.checksums import CHECKSUMS, ChecksumError, ChunkHasher
from sb_titan.data.indexed import META, TOKENS, IndexedDataset, IndexedWriter
from sb_titan.data.loader import SBDataLoader
from sb_titan.data.source import check_vocabulary
from sb_titan.tools import prep
from sb_titan.tools.train import main as train_main

SAMPLE_TOKENS = 256
CHUNK = SAMPLE_TOKENS * 4  # one uint32 sample per chunk: a chunk is a sample here
VOCAB = 1024  # the debug flavor's


def _samples(n: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, VOCAB - 1, SAMPLE_TOKENS) for _ in range(n)]


def _dataset(path, samples=None):
    writer = IndexedWriter(path, checksum_chunk_bytes=CHUNK)
    for s in samples if samples is not None else _samples():
        writer.add(s)
    writer.close({"source": "tests"})
    return path


def _flip(path, token: int) -> tuple[int, int]:
    """Change one token id to another id inside the vocabulary (every range check still
    passes); returns the old and new id."""
    tokens = np.memmap(path / TOKENS, dtype="<u4", mode="r+")
    old = int(tokens[token])
    tokens[token] = old + 1 if old + 1 < VOCAB - 1 else old - 1
    tokens.flush()
    new = int(tokens[token])
    del tokens
    return old, new


def test_chunk_digests_are_those_of_the_file_slices():
    """Fed in pieces that straddle chunk boundaries, as sb-prep writes samples."""
    data = np.random.default_rng(1).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    hasher = ChunkHasher(4096)
    for a, b in ((0, 1), (1, 4095), (4095, 4097), (4097, 9000), (9000, 10_000)):
        hasher.update(data[a:b])
    expected = [xxhash.xxh3_64(data[a : a + 4096]).hexdigest() for a in (0, 4096, 8192)]
    assert hasher.finish() == {"bytes": 10_000, "chunks": expected}


def test_a_clean_dataset_passes(tmp_path, capsys):
    samples = _samples()
    data = _dataset(tmp_path / "ds", samples)
    record = json.loads((data / CHECKSUMS).read_text())
    assert record["chunk_bytes"] == CHUNK and len(record["files"][TOKENS]["chunks"]) == 8
    ds = IndexedDataset(data)
    assert ds.integrity_note() is None
    for i, s in enumerate(samples):
        np.testing.assert_array_equal(ds.read(i, 0, SAMPLE_TOKENS), s)
    assert prep.main(["--verify", str(data), "--quiet"]) == 0
    assert f"{data}: ok: 9 chunks of {CHUNK} bytes in 2 files" in capsys.readouterr().out


def test_a_token_flipped_to_another_valid_id_is_caught_and_named(tmp_path, capsys):
    data = _dataset(tmp_path / "ds")
    old, new = _flip(data, 5 * SAMPLE_TOKENS + 17)  # sample 5 = chunk 5
    ds = IndexedDataset(data)
    check_vocabulary(ds, VOCAB, "debug")  # the id fits: only the checksum can tell
    for i in range(5):  # verified lazily: the chunks before it read fine
        ds.read(i, 0, SAMPLE_TOKENS)
    expected = f"{data / TOKENS}: chunk 5 of 8 (bytes [{5 * CHUNK}, {6 * CHUNK})) has xxh3_64 "
    with pytest.raises(ChecksumError) as caught:
        ds.read(5, 100, 10)  # tokens of the chunk that do not include the flipped one
    assert str(caught.value).startswith(expected) and "\n" not in str(caught.value)
    assert old != new and 0 <= new < VOCAB
    assert prep.main(["--verify", str(data), "--quiet"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"sb-prep: error: {expected}"), line


def _loader(data) -> SBDataLoader:
    """Micro-batches of one row of one sample each (planned in the policy's order)."""
    config = SBDataLoader.Config(dataset="indexed", dataset_path=str(data))
    return SBDataLoader(
        config, dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=SAMPLE_TOKENS,
        local_batch_size=1,
    )  # fmt: skip


def _first_sample(batch: dict) -> int:
    return batch["scheduled"].plan.microbatches[0][batch["microbatch"]].rows[0][0].sample_id


def test_the_loader_stops_before_the_batch_that_would_use_a_bad_chunk(tmp_path):
    """Every micro-batch the plan puts before the corrupt chunk's sample arrives intact;
    the one that needs it raises, naming the chunk."""
    samples = _samples()
    clean = _loader(_dataset(tmp_path / "clean", samples))
    order = [_first_sample(batch) for (batch, _), _ in zip(clean, range(8), strict=False)]
    clean.close()
    bad = order[3]  # trained fourth
    data = _dataset(tmp_path / "ds", samples)
    _flip(data, bad * SAMPLE_TOKENS + 40)
    loader = _loader(data)
    batches = iter(loader)
    try:
        for i in range(3):
            batch, _ = next(batches)
            assert _first_sample(batch) == order[i]
            np.testing.assert_array_equal(batch["input"][0].numpy(), samples[order[i]])
        lo, hi = bad * CHUNK, (bad + 1) * CHUNK
        with pytest.raises(
            Exception, match=rf"tokens\.bin: chunk {bad} of 8 \(bytes \[{lo}, {hi}\)\)"
        ):
            next(batches)
    finally:
        loader.close()


def test_a_dataset_written_before_checksums_loads_with_a_note(tmp_path, capsys):
    """No checksums.json and no meta.json key: it loads, unverified, and says so once
    before launch; `--verify` says there is nothing to verify against."""
    data = _dataset(tmp_path / "old")
    (data / CHECKSUMS).unlink()
    meta = json.loads((data / META).read_text())
    del meta["checksums"]
    (data / META).write_text(json.dumps(meta))
    _flip(data, 3)  # unverifiable: reads as it is
    ds = IndexedDataset(data)
    assert ds.read(0, 0, SAMPLE_TOKENS).shape == (SAMPLE_TOKENS,)
    note = f"{data / META}: no {CHECKSUMS} (prepared by an older sb-prep)"
    assert ds.integrity_note().startswith(note)
    train_main(["--check-config", "--config_file", str(DEBUG_TOML), *indexed_args(data)])
    notes = [line for line in capsys.readouterr().out.splitlines() if note in line]
    assert len(notes) == 1, notes
    assert prep.main(["--verify", str(data), "--quiet"]) == 1
    assert "nothing to verify against" in capsys.readouterr().err


def test_a_missing_or_corrupt_checksum_file_is_named(tmp_path):
    data = _dataset(tmp_path / "ds")
    (data / CHECKSUMS).write_text("{")
    with pytest.raises(ChecksumError, match=rf"{CHECKSUMS}: unreadable"):
        IndexedDataset(data)
    (data / CHECKSUMS).unlink()
    with pytest.raises(ChecksumError, match=rf"{CHECKSUMS}: missing \(meta\.json says"):
        IndexedDataset(data)


def test_sb_prep_records_checksums_of_every_file_it_writes(tmp_path):
    """Through the CLI, with --chat (the loss mask is checksummed too); the digests are
    those of the files' bytes."""
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text = tmp_path / "chat.jsonl"
    text.write_text("".join(json.dumps({"messages": conv}) + "\n" for _ in range(4)))
    out = tmp_path / "prepared"
    qwen = tiny_qwen_tokenizer(
        tmp_path / "qwen", text="hi hello user assistant", chat_template=True
    )
    argv = ["--input", str(text), "--out", str(out), "--tokenizer", str(qwen), "--chat"]
    assert prep.main([*argv, "--quiet"]) == 0
    record = json.loads((out / CHECKSUMS).read_text())
    assert record["chunk_bytes"] == 64 << 20
    assert json.loads((out / META).read_text())["checksums"] == CHECKSUMS
    for name in (TOKENS, "index.npy", "loss_mask.bin"):
        raw = (out / name).read_bytes()
        expected = {"bytes": len(raw), "chunks": [xxhash.xxh3_64(raw).hexdigest()]}
        assert record["files"][name] == expected, name
    assert prep.main([*argv, "--quiet", "--overwrite", "--checksum-chunk-mib", "1"]) == 0
    assert json.loads((out / CHECKSUMS).read_text())["chunk_bytes"] == 1 << 20
