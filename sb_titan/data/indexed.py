"""Tokenized indexed dataset on disk (written by `sb-prep`, read by the loader).

A dataset is a directory of three files:
  tokens.bin   every sample's tokens back to back, raw little-endian uint32 or int32
  index.npy    int64 [n, 3]: offset (in tokens), length, sample id (0..n-1, in order)
  meta.json    format version, dtype, counts, the largest token id, tokenizer and sources
and, for supervised fine-tuning data (`sb-prep --chat`), a fourth:
  loss_mask.bin  one uint8 per token of tokens.bin: 1 where the token is a training
                 target (an answer), 0 where it is only context (meta.json "loss_mask")
and the digest of every chunk of the others (meta.json "checksums"; data/checksums.py):
  checksums.json verified chunk by chunk as a run first reads them; datasets written
                 before it existed load with a note

Planning needs only the lengths (read once into memory); tokens are memory-mapped, so
each rank pages in only the samples it packs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from sb_titan.data.checksums import (
    CHECKSUMS,
    CHUNK_BYTES,
    ChecksumError,
    Checksums,
    ChunkHasher,
    ChunkVerifier,
    hash_file,
    verify_file,
)

FORMAT = "sb_titan-indexed"
VERSION = 1
DTYPES = ("uint32", "int32")
TOKENS, INDEX, META = "tokens.bin", "index.npy", "meta.json"
LOSS_MASK = "loss_mask.bin"
SCAN_CHUNK_TOKENS = 1 << 26  # 256 MiB of uint32 per step of a max-id scan


class DatasetError(ValueError):
    """A missing, corrupt or inconsistent dataset file; the message names it."""


class IndexedDataset:
    """TokenSource over an sb-prep output directory."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.name = f"indexed({self.path})"
        if not self.path.is_dir():
            raise DatasetError(f"{self.path}: dataset directory not found")
        self.meta_file = self.path / META
        self.meta = _read_meta(self.meta_file)
        self.checksums = _read_checksums(self.path, self.meta)
        if self.checksums is not None:  # read whole below, so verified whole now
            _raise_first(verify_file(self.path / INDEX, *self._record(INDEX)))
        self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        index = _read_index(self.path / INDEX, self.meta["num_samples"])
        self._offsets = index[:, 0].copy()
        self._lengths = index[:, 1].copy()
        _check_layout(self.path / INDEX, index, self.meta["num_tokens"])
        self._tokens = _map_tokens(self.path / TOKENS, self.dtype, self.meta["num_tokens"])
        self._mask = None
        if self.meta.get("loss_mask"):
            self._mask = _map_tokens(self.path / LOSS_MASK, np.dtype("u1"), self.meta["num_tokens"])
        self._recorded_max = self.meta.get("max_token_id")  # checked on every read
        self._token_check = self._verifier(TOKENS, self._tokens)
        self._mask_check = self._verifier(LOSS_MASK, self._mask)

    def _record(self, name: str) -> tuple[dict, int]:
        """checksums.json's record of one file, and the chunk size."""
        record = self.checksums.files.get(name)
        if record is None:
            raise ChecksumError(f"{self.path / CHECKSUMS}: no record of {name}")
        return record, self.checksums.chunk_bytes

    def _verifier(self, name: str, data: np.ndarray | None) -> ChunkVerifier | None:
        if self.checksums is None or data is None:
            return None
        return ChunkVerifier(self.path / name, data, *self._record(name))

    def integrity_note(self) -> str | None:
        """A line for datasets written before sb-prep recorded checksums."""
        if self.checksums is not None:
            return None
        return (
            f"{self.meta_file}: no {CHECKSUMS} (prepared by an older sb-prep); its tokens "
            "are read unverified (re-run sb-prep to add checksums)"
        )

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    def __len__(self) -> int:
        return len(self._lengths)

    def read(self, sample_id: int, start: int, length: int) -> np.ndarray:
        if not 0 <= sample_id < len(self._lengths):
            raise IndexError(f"{self.name}: sample id {sample_id} out of range [0, {len(self)})")
        n = int(self._lengths[sample_id])
        if start < 0 or length < 0 or start + length > n:
            raise IndexError(
                f"{self.name}: range [{start}, {start + length}) outside sample "
                f"{sample_id} of {n} tokens"
            )
        at = int(self._offsets[sample_id]) + start
        if self._token_check is not None:  # before the tokens reach a batch
            size = self.dtype.itemsize
            self._token_check.check(at * size, (at + length) * size)
        tokens = self._tokens[at : at + length].astype(np.int64)
        top = self._recorded_max
        if top is not None and length and int(tokens.max()) > top:
            raise DatasetError(
                f"{self.path / META}: sample {sample_id} holds token id {int(tokens.max())}, "
                f"above its max_token_id {top} (edited, or tokens.bin from another dataset?)"
            )
        return tokens

    def loss_mask(self, sample_id: int, start: int, length: int) -> np.ndarray | None:
        """Which tokens of `read(...)` are training targets (bool), or None: all are."""
        if self._mask is None:
            return None
        at = int(self._offsets[sample_id]) + start
        if self._mask_check is not None:
            self._mask_check.check(at, at + length)
        return self._mask[at : at + length] != 0

    def tokenizer_sha256(self) -> str | None:
        """sha256 of the tokenizer.json sb-prep encoded with (None: not recorded)."""
        tokenizer = self.meta.get("tokenizer")
        return tokenizer.get("sha256") if isinstance(tokenizer, dict) else None

    def max_token_id(self) -> int:
        """From meta.json; datasets written before it was recorded are scanned once."""
        if "max_token_id" in self.meta:
            return self.meta["max_token_id"]
        top = -1
        for at in range(0, len(self._tokens), SCAN_CHUNK_TOKENS):
            top = max(top, int(self._tokens[at : at + SCAN_CHUNK_TOKENS].max()))
        return top


def _read_meta(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise DatasetError(f"{file}: missing (not an sb-prep dataset directory?)")
    try:
        meta = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{file}: unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DatasetError(f"{file}: not an {FORMAT} metadata file")
    if meta.get("version") != VERSION:
        raise DatasetError(f"{file}: format version {meta.get('version')}, expected {VERSION}")
    for key in ("dtype", "num_samples", "num_tokens"):
        if key not in meta:
            raise DatasetError(f"{file}: missing key '{key}'")
    if meta["dtype"] not in DTYPES:
        raise DatasetError(f"{file}: dtype {meta['dtype']!r}, expected one of {DTYPES}")
    for key in ("num_samples", "num_tokens"):
        if not isinstance(meta[key], int) or meta[key] < 0:
            raise DatasetError(f"{file}: '{key}' must be a non-negative integer")
    top = meta.get("max_token_id", -1)
    if not isinstance(top, int) or isinstance(top, bool) or top < -1:
        raise DatasetError(f"{file}: 'max_token_id' must be an integer >= -1 (-1: no tokens)")
    return meta


def _read_checksums(path: Path, meta: dict[str, Any]) -> Checksums | None:
    """The dataset's checksums; None for one written before sb-prep recorded them."""
    name = meta.get("checksums")
    if name is None:
        return None
    if name != CHECKSUMS:
        raise DatasetError(f"{path / META}: 'checksums' is {name!r}, expected {CHECKSUMS!r}")
    return Checksums.load(path / CHECKSUMS)


def _raise_first(problems: list[str]) -> None:
    if problems:
        raise ChecksumError(problems[0])


def dataset_checksums(path: str | os.PathLike) -> Checksums:
    """What `sb-prep --verify` checks against; DatasetError for a dataset without."""
    path = Path(path)
    if not path.is_dir():
        raise DatasetError(f"{path}: dataset directory not found")
    checksums = _read_checksums(path, _read_meta(path / META))
    if checksums is None:
        raise DatasetError(
            f"{path / META}: no {CHECKSUMS} (prepared by an older sb-prep): nothing to verify "
            "against; re-run sb-prep to add checksums"
        )
    return checksums


def verify_dataset(
    path: str | os.PathLike, checksums: Checksums, on_bytes: Callable[[int], None] | None = None
) -> list[str]:
    """`sb-prep --verify`: every chunk of every recorded file, then the layout checks a
    load does. One line per problem (none: intact)."""
    path = Path(path)
    problems = []
    for name, record in checksums.files.items():
        problems += verify_file(path / name, record, checksums.chunk_bytes, on_bytes)
    if not problems:
        try:
            IndexedDataset(path)
        except (DatasetError, ChecksumError) as e:
            problems.append(str(e))
    return problems


def _read_index(file: Path, num_samples: int) -> np.ndarray:
    if not file.is_file():
        raise DatasetError(f"{file}: missing")
    try:
        index = np.load(file, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DatasetError(f"{file}: corrupt ({e})") from None
    if index.dtype != np.int64 or index.ndim != 2 or index.shape[1] != 3:
        raise DatasetError(
            f"{file}: expected int64 [n, 3] (offset, length, id), got {index.dtype} "
            f"{list(index.shape)}"
        )
    if len(index) != num_samples:
        raise DatasetError(f"{file}: {len(index)} samples, but {META} says {num_samples}")
    return index


def _check_layout(file: Path, index: np.ndarray, num_tokens: int) -> None:
    """Samples are contiguous, in id order, and exactly cover tokens.bin."""
    offsets, lengths, ids = index[:, 0], index[:, 1], index[:, 2]
    if (lengths < 0).any():
        raise DatasetError(f"{file}: negative length at sample {int(np.argmax(lengths < 0))}")
    if not np.array_equal(ids, np.arange(len(index))):
        bad = int(np.argmax(ids != np.arange(len(index))))
        raise DatasetError(f"{file}: sample ids must be 0..n-1 in order (row {bad} has {ids[bad]})")
    expect = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(index) else offsets
    if not np.array_equal(offsets, expect):
        bad = int(np.argmax(offsets != expect))
        raise DatasetError(
            f"{file}: sample {bad} starts at token {offsets[bad]}, expected {expect[bad]}"
        )
    if int(lengths.sum()) != num_tokens:
        raise DatasetError(
            f"{file}: lengths add up to {int(lengths.sum())} tokens, {META} says {num_tokens}"
        )


def _map_tokens(file: Path, dtype: np.dtype, num_tokens: int) -> np.ndarray:
    if not file.is_file():
        raise DatasetError(f"{file}: missing")
    size = file.stat().st_size
    if size != num_tokens * dtype.itemsize:
        raise DatasetError(
            f"{file}: {size} bytes, expected {num_tokens} tokens x {dtype.itemsize} bytes "
            f"= {num_tokens * dtype.itemsize} (truncated or from another dataset?)"
        )
    if num_tokens == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(file, dtype=dtype, mode="r", shape=(num_tokens,))


class IndexedWriter:
    """Appends tokenized samples; `close(meta)` publishes the dataset.

    Files are written under temporary names and renamed at the end, meta.json last (it
    marks a complete dataset; an old one is removed first), so an interrupted run never
    leaves a directory that looks complete.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        dtype: str = "uint32",
        loss_mask: bool = False,
        checksum_chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"IndexedWriter: dtype {dtype!r}, expected one of {DTYPES}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / META).unlink(missing_ok=True)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self._limits = (np.iinfo(self.dtype).min, np.iinfo(self.dtype).max)
        self._tmp = self.out_dir / (TOKENS + ".tmp")
        self._file = self._tmp.open("wb")
        self._mask_tmp = self.out_dir / (LOSS_MASK + ".tmp")
        self._mask_file = self._mask_tmp.open("wb") if loss_mask else None
        self._hashers = {TOKENS: ChunkHasher(checksum_chunk_bytes)}
        if loss_mask:
            self._hashers[LOSS_MASK] = ChunkHasher(checksum_chunk_bytes)
        self._lengths: list[int] = []
        self.num_tokens = 0
        self.max_token_id = -1  # -1: no tokens

    def add(self, tokens: np.ndarray | list[int], mask: np.ndarray | None = None) -> int:
        """Write one sample (with its loss mask when the dataset has one); returns its id."""
        arr = np.asarray(tokens)
        if (mask is not None) != (self._mask_file is not None):
            raise ValueError("IndexedWriter: a loss mask with every sample, or with none")
        if mask is not None:
            if len(mask) != len(arr):
                raise ValueError(f"IndexedWriter: {len(mask)} mask values for {len(arr)} tokens")
            self._write(LOSS_MASK, self._mask_file, np.asarray(mask, dtype=np.uint8).tobytes())
        if len(arr) and (arr.min() < self._limits[0] or arr.max() > self._limits[1]):
            raise ValueError(f"IndexedWriter: token ids outside the {self.dtype.name} range")
        self._write(TOKENS, self._file, arr.astype(self.dtype).tobytes())
        if len(arr):
            self.max_token_id = max(self.max_token_id, int(arr.max()))
        self._lengths.append(len(arr))
        self.num_tokens += len(arr)
        return len(self._lengths) - 1

    def _write(self, name: str, file: BinaryIO, data: bytes) -> None:
        file.write(data)
        self._hashers[name].update(data)

    def close(self, meta: dict[str, Any]) -> Path:
        """Publish tokens.bin, then index.npy and checksums.json, then meta.json."""
        self._file.close()
        if self._mask_file is not None:
            self._mask_file.close()
            meta = {**meta, "loss_mask": LOSS_MASK}
        lengths = np.asarray(self._lengths, dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        index = np.stack([offsets[: len(lengths)], lengths, np.arange(len(lengths))], axis=1)
        index_tmp = self.out_dir / (INDEX + ".tmp.npy")
        np.save(index_tmp, index.astype(np.int64))
        chunk_bytes = self._hashers[TOKENS].chunk_bytes
        files = {name: hasher.finish() for name, hasher in self._hashers.items()}
        files[INDEX] = hash_file(index_tmp, chunk_bytes)
        (self.out_dir / (CHECKSUMS + ".tmp")).write_text(Checksums(chunk_bytes, files).to_json())
        full = {
            "format": FORMAT,
            "version": VERSION,
            "dtype": self.dtype.name,
            "num_samples": len(lengths),
            "num_tokens": self.num_tokens,
            "max_token_id": self.max_token_id,
            "checksums": CHECKSUMS,
            **meta,
        }
        (self.out_dir / (META + ".tmp")).write_text(json.dumps(full, indent=2) + "\n")
        os.replace(self._tmp, self.out_dir / TOKENS)
        if self._mask_file is not None:
            os.replace(self._mask_tmp, self.out_dir / LOSS_MASK)
        else:
            (self.out_dir / LOSS_MASK).unlink(missing_ok=True)  # from a replaced dataset
        os.replace(index_tmp, self.out_dir / INDEX)
        os.replace(self.out_dir / (CHECKSUMS + ".tmp"), self.out_dir / CHECKSUMS)
        os.replace(self.out_dir / (META + ".tmp"), self.out_dir / META)
        return self.out_dir

    def abort(self) -> None:
        """Drop what was written (the directory is left without a dataset)."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)
        if self._mask_file is not None:
            self._mask_file.close()
            self._mask_tmp.unlink(missing_ok=True)
