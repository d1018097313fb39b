"""sb-prep's inputs: each reader yields the documents of one input as Records (the
field's value, or the tokens of pre-tokenized input, or why a record could not be
read); `validate` then checks the value is text (or, for --chat, a conversation).

An Input is what one --input (or --hf-dataset) names; `classify` decides its kind:
  .txt                  one document per file
  .jsonl .jsonl.gz .jsonl.zst   one JSON object per line (gzip / zstandard-compressed)
  .parquet .arrow       one row per document (Arrow: IPC stream, as `datasets` writes its
                        shards, or IPC file)
  a folder              a `datasets` save_to_disk folder (Dataset or DatasetDict)
  .bin / .idx / prefix  a Megatron indexed dataset (already tokenized)
  hub                   `datasets.load_dataset(name, config, split=..., streaming=True)`
"""

from __future__ import annotations

import gzip
import io
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sb_titan.data.megatron import MegatronError, MegatronIndexed, megatron_pair

if TYPE_CHECKING:  # an optional dependency, imported where a dataset is read
    from datasets import Dataset, DatasetDict

SUFFIXES = {  # longest first: ".jsonl.gz" before ".jsonl"
    ".jsonl.gz": "jsonl.gz",
    ".jsonl.zst": "jsonl.zst",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".jsonl": "jsonl",
    ".txt": "txt",
    ".bin": "megatron",
    ".idx": "megatron",
}
HF_DISK_MARKERS = ("dataset_dict.json", "state.json")  # what save_to_disk writes
ROW_BATCH = 1024  # rows read per batch from Arrow, Parquet and `datasets`


class InputError(ValueError):
    """An input that is not what its name or the flags say; the message names it."""


@dataclass(slots=True)
class Record:
    """One document of an input, or why it could not be read."""

    where: str  # file:line (file:row for tables, file:document for Megatron)
    value: object  # the field's value as read (`validate` checks it), None with a problem
    problem: str | None = None
    nbytes: int = 0  # input bytes consumed (for progress)
    ids: np.ndarray | None = None  # a pre-tokenized document (Megatron), instead of text


@dataclass(frozen=True, slots=True)
class HFOptions:
    """Which split and configuration of a `datasets` dataset to read."""

    split: str | None = None  # None: "train" when there, else the only split
    config: str | None = None


@dataclass(frozen=True, slots=True)
class Input:
    kind: str  # a value of SUFFIXES, "hf-disk" or "hf-hub"
    path: str  # a file, folder, Megatron prefix or hub name
    nbytes: int  # on disk (progress); 0 for the hub

    @property
    def many_records(self) -> bool:
        """Whether the malformed share applies (a .txt file is one record)."""
        return self.kind != "txt"


def kind_of(path: Path) -> str | None:
    name = path.name.lower()
    return next((kind for suffix, kind in SUFFIXES.items() if name.endswith(suffix)), None)


def classify(path: Path) -> Input:
    """The Input `path` names, or an InputError saying what was expected."""
    if path.is_dir():
        if not any((path / m).is_file() for m in HF_DISK_MARKERS):
            raise InputError(
                f"{path}: a folder, but not a datasets save_to_disk folder (no "
                f"{' or '.join(HF_DISK_MARKERS)})"
            )
        return Input("hf-disk", str(path), sum(f.stat().st_size for f in path.rglob("*.arrow")))
    kind = kind_of(path)
    if kind == "megatron" or (kind is None and not path.exists() and _is_prefix(path)):
        idx, bin_ = megatron_pair(path)
        prefix = str(idx)[: -len(".idx")]
        size = sum(p.stat().st_size for p in (idx, bin_) if p.is_file())
        return Input("megatron", prefix, size)
    if not path.is_file():
        raise InputError(f"{path}: not found")
    if kind is None:
        raise InputError(
            f"{path}: unknown input type (expected a folder saved by datasets, or a file "
            f"ending in one of {', '.join(SUFFIXES)})"
        )
    return Input(kind, str(path), path.stat().st_size)


def _is_prefix(path: Path) -> bool:
    idx, bin_ = megatron_pair(path)
    return idx.is_file() or bin_.is_file()


def records(inp: Input, text_field: str, hf: HFOptions) -> Iterator[Record]:
    path = Path(inp.path)
    if inp.kind == "txt":
        return read_txt(path)
    if inp.kind.startswith("jsonl"):
        return read_jsonl(path, text_field, inp.kind)
    if inp.kind == "parquet":
        return read_parquet(path, text_field)
    if inp.kind == "arrow":
        return read_arrow(path, text_field)
    if inp.kind == "hf-disk":
        return read_hf_disk(path, text_field, hf)
    if inp.kind == "hf-hub":
        return read_hf_hub(inp.path, text_field, hf)
    raise ValueError(f"records: {inp.kind} is not a text input")  # Megatron: read_megatron


# -- text files --------------------------------------------------------------------------
def read_txt(path: Path) -> Iterator[Record]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        yield Record(f"{path}:{line}", None, "not valid UTF-8", len(raw))
        return
    yield Record(f"{path}:1", text, None, len(raw))


def _open_lines(path: Path, kind: str) -> tuple[io.BufferedIOBase, Any]:
    """(stream of decompressed lines, the file underneath: its position is progress)."""
    raw = path.open("rb")
    if kind == "jsonl.gz":
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if kind == "jsonl.zst":
        try:
            import zstandard
        except ImportError:
            raise InputError(f"{path}: reading .zst needs the zstandard package") from None
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return io.BufferedReader(reader), raw
    return raw, raw


def _stream_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
    try:
        import zstandard
    except ImportError:
        return errors
    return (*errors, zstandard.ZstdError)


def read_jsonl(path: Path, text_field: str, kind: str = "jsonl") -> Iterator[Record]:
    stream, raw = _open_lines(path, kind)
    lineno, consumed = 0, 0
    with raw, stream:
        lines = iter(stream)
        while True:
            try:
                line = next(lines, None)
            except _stream_errors() as e:
                what = {"jsonl.gz": "gzip", "jsonl.zst": "zstandard"}.get(kind, "JSONL")
                raise InputError(
                    f"{path}: not a readable {what} file after line {lineno} ({e})"
                ) from None
            if line is None:
                return
            lineno += 1
            nbytes, consumed = raw.tell() - consumed, raw.tell()
            yield _json_record(f"{path}:{lineno}", line, text_field, nbytes)


def _json_record(where: str, line: bytes, text_field: str, nbytes: int) -> Record:
    try:
        obj = json.loads(line)
    except UnicodeDecodeError:
        return Record(where, None, "not valid UTF-8", nbytes)
    except json.JSONDecodeError as e:
        return Record(where, None, f"bad JSON ({e.msg})", nbytes)
    if not isinstance(obj, dict) or text_field not in obj:
        has = f" (fields: {', '.join(sorted(obj)[:8])})" if isinstance(obj, dict) else ""
        return Record(where, None, f"no field '{text_field}'{has}", nbytes)
    return Record(where, obj[text_field], None, nbytes)


def validate(rec: Record, name: str, chat: bool = False) -> Record:
    """`rec` with its problem set when its value is not a document: non-empty text, or
    with `chat` a conversation (a list of {"role", "content"} with an assistant turn)."""
    if rec.problem is not None or rec.ids is not None:
        return rec
    problem = chat_problem(rec.value, name) if chat else text_problem(rec.value, name)
    return rec if problem is None else Record(rec.where, None, problem, rec.nbytes)


def text_problem(value: object, name: str) -> str | None:
    if not isinstance(value, str):
        return f"'{name}' is {type(value).__name__}, not a string"
    return None if value.strip() else "empty text"


def chat_problem(value: object, name: str) -> str | None:
    if not isinstance(value, list) or not value:
        return f"'{name}' is {type(value).__name__}, not a list of messages"
    for i, m in enumerate(value):
        fields = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if not all(isinstance(f, str) for f in fields):
            return f'\'{name}\'[{i}] is not a {{"role": str, "content": str}} message'
    if not any(m["role"] == "assistant" for m in value):
        return "no assistant message (nothing to train on)"
    return None


# -- tables: Parquet, Arrow, datasets ------------------------------------------------------
def _require_column(where: Path | str, names: list[str], text_field: str) -> None:
    if text_field not in names:
        raise InputError(
            f"{where}: no column '{text_field}' (columns: {', '.join(names)}); "
            "pick one with --text-field"
        )


def _rows(where: str, batches: Iterator[list], share: int) -> Iterator[Record]:
    row = 0
    for column in batches:
        for value in column:
            row += 1
            yield Record(f"{where}:{row}", value, None, share)


def read_parquet(path: Path, text_field: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    _require_column(path, pf.schema_arrow.names, text_field)
    share = path.stat().st_size // max(pf.metadata.num_rows, 1)
    batches = (b.column(0).to_pylist() for b in pf.iter_batches(ROW_BATCH, columns=[text_field]))
    return _rows(str(path), batches, share)


def read_arrow(path: Path, text_field: str) -> Iterator[Record]:
    """An Arrow IPC stream (a `datasets` shard: data-00000-of-00001.arrow) or IPC file."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        try:
            source.seek(0)
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid as e:
            raise InputError(f"{path}: not an Arrow IPC stream or file ({e})") from None
    _require_column(path, reader.schema.names, text_field)
    column = reader.schema.get_field_index(text_field)
    table = reader.read_all()  # memory-mapped: the data is not copied
    batches, rows = iter(table.to_batches(ROW_BATCH)), table.num_rows
    share = path.stat().st_size // max(rows, 1)
    return _rows(str(path), (b.column(column).to_pylist() for b in batches), share)


def _split_of(ds: Dataset | DatasetDict, where: str, hf: HFOptions) -> Dataset:
    """One split of a DatasetDict (a Dataset is returned as it is)."""
    if not hasattr(ds, "keys"):
        return ds
    splits = list(ds.keys())
    split = hf.split or ("train" if "train" in splits else splits[0] if len(splits) == 1 else None)
    if split not in splits:
        raise InputError(
            f"{where}: {'no split ' + repr(hf.split) if hf.split else 'several splits'} "
            f"(splits: {', '.join(splits)}); pick one with --hf-split"
        )
    return ds[split]


def read_hf_disk(path: Path, text_field: str, hf: HFOptions) -> Iterator[Record]:
    """A folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise InputError(f"{path}: not loadable as a datasets folder ({e})") from None
    ds = _split_of(ds, str(path), hf)
    _require_column(path, ds.column_names, text_field)
    share = sum(f.stat().st_size for f in path.rglob("*.arrow")) // max(len(ds), 1)
    batches = (b[text_field] for b in ds.select_columns([text_field]).iter(ROW_BATCH))
    return _rows(str(path), batches, share)


def read_hf_hub(name: str, text_field: str, hf: HFOptions) -> Iterator[Record]:
    """`datasets.load_dataset` streaming: one pass, no Arrow copy of the whole corpus in
    the cache. A local folder of data files or a local dataset repository works too."""
    import datasets

    split = hf.split or "train"
    where = f"{name}[{split}]"
    try:
        ds = datasets.load_dataset(name, hf.config, split=split, streaming=True)
        rows = iter(ds)
        first = next(rows, None)
    except Exception as e:  # the hub's and the builders' errors vary: report them in one line
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, KeyError):  # datasets' JSON builder, on records of unequal fields
            message = f"a record lacks the field {message}; expected it in every record"
        raise InputError(f"--hf-dataset {name}: cannot load split '{split}' ({message})") from None
    if first is None:
        return
    _require_column(where, list(first), text_field)
    yield Record(f"{where}:1", first[text_field])
    row = 1
    try:
        for row, example in enumerate(rows, 2):
            if text_field not in example:
                yield Record(f"{where}:{row}", None, f"no field '{text_field}'")
                continue
            yield Record(f"{where}:{row}", example[text_field])
    except Exception as e:  # datasets reads a batch at a time: a record it cannot cast
        message = " ".join(str(e).split())[:300] or type(e).__name__  # to the first ones'
        raise InputError(
            f"{where}:{row + 1}: this record (or one after it in its file or batch) does not "
            f"match the records before it ({message}); expected the string field "
            f"'{text_field}' in every record"
        ) from None


# -- pre-tokenized: Megatron -------------------------------------------------------------------
def read_megatron(prefix: Path, vocab_size: int, tokenizer: str) -> Iterator[Record]:
    """The documents of a Megatron dataset as token ids, each checked against the
    tokenizer the user named (Megatron files record none)."""
    try:
        ds = MegatronIndexed(prefix)
    except MegatronError as e:
        raise InputError(str(e)) from None
    for i in range(len(ds)):
        ids = ds.document(i)
        where, nbytes = f"{ds.bin_path}:{i}", ds.document_bytes(i)
        if len(ids) == 0:
            yield Record(where, None, "empty document", nbytes)
            continue
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise InputError(
                f"{ds.bin_path}: document {i} holds token id {bad}, outside the vocabulary "
                f"of --tokenizer {tokenizer} ({vocab_size} ids); name the tokenizer the "
                "dataset was made with"
            )
        yield Record(where, None, None, nbytes, ids=ids)
