"""Megatron-LM indexed datasets: a `.bin` + `.idx` pair (the MMIDIDX format of
megatron-core's `megatron/core/datasets/indexed_dataset.py`), read with numpy memory
maps; Megatron itself is not imported.

`.idx`, little-endian, as megatron-core's `_IndexWriter` writes it:
  9 bytes   magic b"MMIDIDX\\x00\\x00"
  uint64    version, 1
  uint8     dtype code of the tokens (DTYPE_CODES)
  uint64    S, the number of sequences
  uint64    D, the number of document indices (documents + 1)
  int32[S]  tokens per sequence
  int64[S]  byte offset of each sequence in `.bin`
  int64[D]  document indices: document i is sequences [doc[i], doc[i + 1])
  int8[S]   a mode per sequence (multimodal datasets only; not read here)
`.bin`: the tokens of every sequence back to back in that dtype. A document of
`preprocess_data.py` is one sequence (several with --split-sentences); its tokens are
the document's, plus the tokenizer's end-of-document id with --append-eod.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


class MegatronError(ValueError):
    """A missing, foreign or inconsistent `.bin/.idx` file; the message names it."""


def megatron_pair(path: Path) -> tuple[Path, Path]:
    """(.idx, .bin) of the dataset `path` names: either file of the pair, or the prefix
    Megatron's --data-path takes."""
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    return prefix.with_name(prefix.name + ".idx"), prefix.with_name(prefix.name + ".bin")


class MegatronIndexed:
    """The documents of one Megatron dataset, in order, as int64 token arrays."""

    def __init__(self, path: Path) -> None:
        self.idx_path, self.bin_path = megatron_pair(Path(path))
        for have, other in ((self.idx_path, self.bin_path), (self.bin_path, self.idx_path)):
            if not have.is_file():
                raise MegatronError(
                    f"{have}: missing (a Megatron dataset is a .bin/.idx pair; found {other} "
                    "without it)"
                    if other.is_file()
                    else f"{have}: not found (expected a Megatron .bin/.idx pair)"
                )
        dtype, sequences, doc_entries = _read_header(self.idx_path)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        index = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        at = HEADER_BYTES
        self.lengths = np.frombuffer(index, "<i4", sequences, at)
        at += self.lengths.nbytes
        self.pointers = np.frombuffer(index, "<i8", sequences, at)
        at += self.pointers.nbytes
        self.doc_index = np.frombuffer(index, "<i8", doc_entries, at)
        size = self.bin_path.stat().st_size
        self._tokens = np.memmap(self.bin_path, np.uint8, "r") if size else np.zeros(0, np.uint8)
        _check_layout(self, size)

    def __len__(self) -> int:
        return len(self.doc_index) - 1

    def document(self, i: int) -> np.ndarray:
        """The tokens of document `i` (its sequences joined), as int64."""
        first, end = int(self.doc_index[i]), int(self.doc_index[i + 1])
        parts = []
        for s in range(first, end):
            at, n = int(self.pointers[s]), int(self.lengths[s])
            parts.append(np.frombuffer(self._tokens, self.dtype, n, at))
        if not parts:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(parts).astype(np.int64)

    def document_bytes(self, i: int) -> int:
        first, end = int(self.doc_index[i]), int(self.doc_index[i + 1])
        return int(self.lengths[first:end].sum()) * self.dtype.itemsize


def _read_header(idx: Path) -> tuple[type, int, int]:
    """dtype, sequence count and document-index count, after checking the magic, the
    version and that the file is exactly as long as they say."""
    with idx.open("rb") as f:
        head = f.read(HEADER_BYTES)
    if head[: len(MAGIC)] != MAGIC:
        raise MegatronError(
            f"{idx}: not a Megatron index (starts with {head[: len(MAGIC)]!r}, expected {MAGIC!r})"
        )
    if len(head) < HEADER_BYTES:
        raise MegatronError(f"{idx}: truncated header ({len(head)} of {HEADER_BYTES} bytes)")
    version, code, sequences, doc_entries = struct.unpack("<QBQQ", head[len(MAGIC) :])
    if version != 1:
        raise MegatronError(f"{idx}: index version {version}, expected 1")
    if code not in DTYPE_CODES:
        raise MegatronError(f"{idx}: dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
    dtype = DTYPE_CODES[code]
    if not np.issubdtype(dtype, np.integer):
        raise MegatronError(f"{idx}: tokens stored as {np.dtype(dtype).name}, expected integers")
    size = idx.stat().st_size
    expect = HEADER_BYTES + 12 * sequences + 8 * doc_entries
    if size == expect + sequences and sequences:
        raise MegatronError(
            f"{idx}: holds sequence modes (a multimodal dataset); expected text tokens only"
        )
    if size != expect:
        raise MegatronError(
            f"{idx}: {size} bytes, expected {expect} for {sequences} sequences and "
            f"{doc_entries} document indices (truncated, or not an MMIDIDX index?)"
        )
    return dtype, sequences, doc_entries


def _check_layout(ds: MegatronIndexed, bin_size: int) -> None:
    """Document indices run 0..S without going back; every sequence lies inside .bin."""
    doc, sequences = ds.doc_index, len(ds.lengths)
    if len(doc) == 0 or doc[0] != 0 or doc[-1] != sequences:
        ends = f"{int(doc[0])}..{int(doc[-1])}" if len(doc) else "none"
        raise MegatronError(
            f"{ds.idx_path}: document indices run {ends}, expected 0..{sequences} "
            "(the sequence count)"
        )
    if (np.diff(doc) < 0).any():
        bad = int(np.argmax(np.diff(doc) < 0))
        raise MegatronError(f"{ds.idx_path}: document index {bad + 1} goes back ({doc[bad + 1]})")
    if (ds.lengths < 0).any():
        bad = int(np.argmax(ds.lengths < 0))
        raise MegatronError(f"{ds.idx_path}: sequence {bad} has negative length")
    ends = ds.pointers + ds.lengths.astype(np.int64) * ds.dtype.itemsize
    if len(ends) and ((ds.pointers < 0).any() or int(ends.max()) > bin_size):
        bad = int(np.argmax((ds.pointers < 0) | (ends > bin_size)))
        raise MegatronError(
            f"{ds.bin_path}: {bin_size} bytes, but sequence {bad} of {ds.idx_path.name} spans "
            f"bytes [{int(ds.pointers[bad])}, {int(ends[bad])}) (truncated, or another "
            "dataset's .bin?)"
        )
