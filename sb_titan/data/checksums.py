"""Per-chunk checksums of a dataset's files (`checksums.json`, written by sb-prep).

Token ids flipped to other valid ids pass every range check and train silently, so
sb-prep records an XXH3-64 digest of every `chunk_bytes` slice of tokens.bin,
index.npy and loss_mask.bin. Chunks, not whole files: a long-context dataset can be
hundreds of GB, and a run reads only its own samples, so the loader verifies a chunk
the first time the run reads a byte of it (once per chunk and process) instead of
reading everything up front; `sb-prep --verify DIR` checks every chunk. XXH3-64, as in
the checkpoint manifest (runtime/checkpoint.py): fast, and it detects accidental
corruption, it is not a MAC.

    {"format": "sb_titan-checksums", "version": 1, "algorithm": "xxh3_64",
     "chunk_bytes": 67108864, "files": {"tokens.bin": {"bytes": N, "chunks": [hex, ...]}}}
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

CHECKSUMS = "checksums.json"
FORMAT = "sb_titan-checksums"
VERSION = 1
ALGORITHM = "xxh3_64"
CHUNK_BYTES = 64 << 20
"""64 MiB: one hash per 64 MiB at first read; 16 hex digits per chunk (1.6k for 100 GB)."""
_READ_BYTES = 8 << 20


class ChecksumError(ValueError):
    """Bytes of a dataset file that differ from what sb-prep recorded, or an unreadable
    checksum file; the message is one line naming the file (and chunk, byte range)."""


class ChunkHasher:
    """Digests of consecutive `chunk_bytes` slices of a stream written piece by piece."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"checksum chunk size must be >= 1 byte (got {chunk_bytes})")
        self.chunk_bytes = chunk_bytes
        self.nbytes = 0
        self._hash = xxhash.xxh3_64()
        self._filled = 0
        self._digests: list[str] = []

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self.nbytes += len(view)
        while len(view):
            part = view[: self.chunk_bytes - self._filled]
            self._hash.update(part)
            self._filled += len(part)
            view = view[len(part) :]
            if self._filled == self.chunk_bytes:
                self._digests.append(self._hash.hexdigest())
                self._hash.reset()
                self._filled = 0

    def finish(self) -> dict:
        """The file's record: its size and the digest of every chunk (the last may be short)."""
        if self._filled:
            self._digests.append(self._hash.hexdigest())
            self._hash.reset()
            self._filled = 0
        return {"bytes": self.nbytes, "chunks": list(self._digests)}


def hash_file(path: Path, chunk_bytes: int, on_bytes: Callable[[int], None] | None = None) -> dict:
    """A file's record, read in 8 MiB pieces (`on_bytes` reports progress)."""
    hasher = ChunkHasher(chunk_bytes)
    buf = bytearray(min(_READ_BYTES, chunk_bytes))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            hasher.update(memoryview(buf)[:n])
            if on_bytes is not None:
                on_bytes(n)
    return hasher.finish()


@dataclass(frozen=True, slots=True)
class Checksums:
    """What checksums.json records: the chunk size and each file's chunk digests."""

    chunk_bytes: int
    files: dict[str, dict]

    def to_json(self) -> str:
        body = {
            "format": FORMAT,
            "version": VERSION,
            "algorithm": ALGORITHM,
            "chunk_bytes": self.chunk_bytes,
            "files": self.files,
        }
        return json.dumps(body, indent=1) + "\n"

    @classmethod
    def load(cls, file: Path) -> Checksums:
        try:
            body = json.loads(file.read_text())
        except FileNotFoundError:
            raise ChecksumError(f"{file}: missing (meta.json says the dataset has one)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ChecksumError(f"{file}: unreadable ({e})") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ChecksumError(f"{file}: not an {FORMAT} file")
        if body.get("version") != VERSION or body.get("algorithm") != ALGORITHM:
            raise ChecksumError(
                f"{file}: version {body.get('version')} / algorithm {body.get('algorithm')!r}, "
                f"expected {VERSION} / {ALGORITHM!r}"
            )
        chunk, files = body.get("chunk_bytes"), body.get("files")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ChecksumError(f"{file}: 'chunk_bytes' must be a positive integer")
        if not isinstance(files, dict) or not all(_valid(r, chunk) for r in files.values()):
            raise ChecksumError(
                f"{file}: 'files' must map names to {{bytes, chunks}}, one digest per chunk"
            )
        return cls(chunk, files)


def _valid(record: object, chunk_bytes: int) -> bool:
    if not isinstance(record, dict) or not isinstance(record.get("bytes"), int):
        return False
    chunks = record.get("chunks")
    expected = -(-record["bytes"] // chunk_bytes)
    return isinstance(chunks, list) and len(chunks) == expected


def mismatch(file: Path, chunk: int, n_chunks: int, lo: int, hi: int, got: str, want: str) -> str:
    return (
        f"{file}: chunk {chunk} of {n_chunks} (bytes [{lo}, {hi})) has xxh3_64 {got}, "
        f"{CHECKSUMS} records {want}: the file changed after sb-prep wrote it (a bad disk "
        "or copy?); re-run sb-prep (`sb-prep --verify DIR` lists every bad chunk)"
    )


class ChunkVerifier:
    """Checks one file's chunks against their digests the first time a byte of each is
    read (a memory-mapped array: hashing a chunk pages it in, as the read would)."""

    def __init__(self, file: Path, data: np.ndarray, record: dict, chunk_bytes: int) -> None:
        self.file = file
        self._bytes = data.view(np.uint8)
        if record["bytes"] != len(self._bytes):
            raise ChecksumError(
                f"{file}: {len(self._bytes)} bytes, {CHECKSUMS} records {record['bytes']}"
            )
        self._digests = record["chunks"]
        self._chunk = chunk_bytes
        self._checked = np.zeros(len(self._digests), dtype=bool)

    def check(self, lo: int, hi: int) -> None:
        """Verify every not yet verified chunk overlapping bytes [lo, hi)."""
        if hi <= lo:
            return
        for c in range(lo // self._chunk, (hi - 1) // self._chunk + 1):
            if not self._checked[c]:
                a, b = c * self._chunk, min((c + 1) * self._chunk, len(self._bytes))
                got = xxhash.xxh3_64_hexdigest(self._bytes[a:b])
                if got != self._digests[c]:
                    n = len(self._digests)
                    raise ChecksumError(mismatch(self.file, c, n, a, b, got, self._digests[c]))
                self._checked[c] = True


def verify_file(
    file: Path, record: dict, chunk_bytes: int, on_bytes: Callable[[int], None] | None = None
) -> list[str]:
    """Every chunk of `file` against its record: one line per problem (none: intact)."""
    if not file.is_file():
        return [f"{file}: missing"]
    size = file.stat().st_size
    if size != record["bytes"]:
        return [f"{file}: {size} bytes, {CHECKSUMS} records {record['bytes']}"]
    got = hash_file(file, chunk_bytes, on_bytes)["chunks"]
    want = record["chunks"]
    return [
        mismatch(file, c, len(want), c * chunk_bytes, min((c + 1) * chunk_bytes, size), g, w)
        for c, (g, w) in enumerate(zip(got, want, strict=True))
        if g != w
    ]
