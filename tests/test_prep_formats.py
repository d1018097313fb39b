"""sb-prep's other inputs give the token stream of the same documents as plain JSONL
(and as the tokenizer itself): `datasets` save_to_disk folders, Arrow shards, a dataset
loaded by `datasets.load_dataset`, gzip / zstandard JSONL, Megatron .bin/.idx pairs
written by megatron-core's builder (tests/fixtures/megatron, make_fixture.py). Bad
input stops with one line naming the file and what was expected."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import datasets
import pyarrow as pa
import pytest
import zstandard
from conftest import tiny_qwen_tokenizer

from sb_titan.data.indexed import IndexedDataset
from sb_titan.data.tokenizer import BOS, EOS, TOKENIZER_DIR, load_tokenizer
from sb_titan.tools.prep import main

MEGATRON = Path(__file__).parent / "fixtures" / "megatron"
DOCS = [
    "key 12 maps to 34 . recall key 12 : 34 .",
    "A second document, with punctuation — and non-ASCII: naïve café 東京.",
    "Line one\nline two\n\nA paragraph after a blank line.",
    "x",
    " ".join(f"word{i % 31}" for i in range(400)),
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def expected(tok, text: str, eos: bool = False) -> list[int]:
    """BOS + the tokenizer's ids (+ EOS): the independent reference."""
    end = [tok.token_to_id(EOS)] if eos else []
    return [tok.token_to_id(BOS), *tok.encode(text, add_special_tokens=False).ids, *end]


def stream(out: Path) -> list[list[int]]:
    ds = IndexedDataset(out)
    return [ds.read(i, 0, int(n)).tolist() for i, n in enumerate(ds.lengths)]


def run(args: list, out: Path, capsys=None) -> list[list[int]]:
    argv = ["--out", str(out), "--quiet", *map(str, args)]
    code = main(argv)
    err = capsys.readouterr().err if capsys else ""
    assert code == 0, err
    return stream(out)


def write_jsonl(path: Path, docs: list[str], **extra) -> Path:
    path.write_text("".join(json.dumps({"text": d, **extra}) + "\n" for d in docs))
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tok) -> list[list[int]]:
    tmp = tmp_path_factory.mktemp("ref")
    got = run(["--input", write_jsonl(tmp / "docs.jsonl", DOCS)], tmp / "ds")
    assert got == [expected(tok, d) for d in DOCS]
    return got


def test_save_to_disk_folder_and_its_arrow_shards(tmp_path, reference):
    ds = datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "text": DOCS})
    ds.save_to_disk(tmp_path / "saved", num_shards=2)
    assert run(["--input", tmp_path / "saved"], tmp_path / "a") == reference
    shards = sorted((tmp_path / "saved").glob("data-*.arrow"))
    assert len(shards) == 2
    assert run(["--input", *shards], tmp_path / "b") == reference
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert [s["format"] for s in meta["sources"]] == ["arrow", "arrow"]
    # A DatasetDict: "train" by default, another split by --hf-split.
    splits = datasets.DatasetDict({"train": ds, "test": ds.select([1, 3])})
    splits.save_to_disk(tmp_path / "dict")
    assert run(["--input", tmp_path / "dict"], tmp_path / "c") == reference
    test_split = run(["--input", tmp_path / "dict", "--hf-split", "test"], tmp_path / "d")
    assert test_split == [reference[1], reference[3]]


def test_arrow_ipc_file_and_other_column(tmp_path, tok):
    table = pa.table({"body": DOCS[:2], "n": [1, 2]})
    with pa.ipc.new_file(tmp_path / "t.arrow", table.schema) as writer:
        writer.write_table(table)
    got = run(["--input", tmp_path / "t.arrow", "--text-field", "body"], tmp_path / "ds")
    assert got == [expected(tok, d) for d in DOCS[:2]]


def test_load_dataset_on_a_local_dataset(tmp_path, reference):
    """--hf-dataset goes through datasets.load_dataset (streaming), here on a local
    folder of data files as the hub would serve them (the hub is not reachable)."""
    repo = tmp_path / "my_dataset"
    (repo / "data").mkdir(parents=True)
    write_jsonl(repo / "data" / "train.jsonl", DOCS)
    write_jsonl(repo / "data" / "validation.jsonl", DOCS[:1])
    assert run(["--hf-dataset", repo], tmp_path / "a") == reference
    got = run(["--hf-dataset", repo, "--hf-split", "validation"], tmp_path / "b")
    assert got == reference[:1]
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert meta["sources"][0] | {"first_id": 0} == {
        "path": str(repo),
        "format": "hf-hub",
        "split": "validation",
        "config": None,
        "first_id": 0,
        "samples": 1,
        "malformed": 0,
    }


def test_compressed_jsonl(tmp_path, reference):
    lines = write_jsonl(tmp_path / "d.jsonl", DOCS).read_bytes()
    half = lines.index(b"\n", len(lines) // 2) + 1
    # Two gzip members and two zstandard frames, as concatenating shards makes.
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(lines[:half]) + gzip.compress(lines[half:]))
    c = zstandard.ZstdCompressor()
    (tmp_path / "d.jsonl.zst").write_bytes(c.compress(lines[:half]) + c.compress(lines[half:]))
    assert run(["--input", tmp_path / "d.jsonl.gz"], tmp_path / "gz") == reference
    assert run(["--input", tmp_path / "d.jsonl.zst"], tmp_path / "zst") == reference


@pytest.mark.parametrize(
    "name, eos, form",
    [
        ("text_document", True, ".bin"),  # uint16, --append-eod, a document of 3 sentences
        ("text_document", True, ""),  # the prefix Megatron's --data-path takes
        ("text_int32_document", False, ".idx"),
    ],
)
def test_megatron_pair_gives_the_jsonl_tokens(tmp_path, tok, name, eos, form):
    """Documents written by megatron-core's builder == the same JSONL tokenized by sb-prep
    with the same tokenizer (documents ending in the end-of-document id already keep
    one EOS with --eos)."""
    flags = ["--tokenizer", TOKENIZER_DIR] + (["--eos"] if eos else [])
    jsonl = run(["--input", MEGATRON / "docs.jsonl", *flags], tmp_path / "jsonl")
    texts = [json.loads(line)["text"] for line in (MEGATRON / "docs.jsonl").open()]
    assert jsonl == [expected(tok, t, eos) for t in texts]
    pair = run(["--input", f"{MEGATRON / name}{form}", *flags], tmp_path / "megatron")
    assert pair == jsonl
    meta = json.loads((tmp_path / "megatron" / "meta.json").read_text())
    assert meta["sources"][0]["format"] == "megatron"
    assert (
        meta["tokenizer"]["sha256"]
        == hashlib.sha256((TOKENIZER_DIR / "tokenizer.json").read_bytes()).hexdigest()
    )
    # Both files of the pair named (a shell glob): read once.
    both = [MEGATRON / f"{name}.bin", MEGATRON / f"{name}.idx"]
    assert run(["--input", *both, *flags], tmp_path / "both") == jsonl


def test_megatron_needs_the_tokenizer_it_was_made_with(tmp_path, capsys, tok):
    bin_ = MEGATRON / "text_document.bin"
    assert main(["--input", str(bin_), "--out", str(tmp_path / "a"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"sb-prep: error: {MEGATRON / 'text_document'}: a Megatron dataset holds token ids but "
        "not its tokenizer; pass --tokenizer DIR, the one it was made with"
    )
    small = tiny_qwen_tokenizer(tmp_path / "small", vocab_size=300)
    argv = ["--input", str(bin_), "--tokenizer", str(small), "--out", str(tmp_path / "b")]
    assert main([*argv, "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    first = json.loads((MEGATRON / "docs.jsonl").open().readline())["text"]
    top = max(expected(tok, first, eos=True)[1:])  # document 0 as Megatron holds it
    n = load_tokenizer(small).get_vocab_size()
    assert top >= n
    assert err.splitlines() == [
        f"sb-prep: error: {bin_}: document 0 holds token id {top}, outside the vocabulary of "
        f"--tokenizer {small} ({n} ids); name the tokenizer the dataset was made with"
    ]
    assert not (tmp_path / "b" / "meta.json").exists()


def test_tokenizer_without_bos_and_its_hash(tmp_path):
    """A Qwen2.5-style tokenizer (bos_token null): no BOS, --eos appends <|endoftext|>;
    meta.json records the sha256 of tokenizer.json (what --check-config compares)."""
    qwen = tiny_qwen_tokenizer(tmp_path / "qwen", text=" ".join(DOCS))
    tok = load_tokenizer(qwen)
    end = tok.token_to_id("<|endoftext|>")
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    got = run(["--input", src, "--tokenizer", qwen, "--eos"], tmp_path / "ds")
    assert got == [[*tok.encode(d, add_special_tokens=False).ids, end] for d in DOCS]
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())["tokenizer"]
    sha = hashlib.sha256((qwen / "tokenizer.json").read_bytes()).hexdigest()
    assert meta == {
        "path": str(qwen.resolve()),
        "sha256": sha,
        "vocab_size": tok.get_vocab_size(),
        "bos": None,
        "eos": "<|endoftext|>",
    }


def _corrupt_inputs(tmp: Path) -> list[tuple[list[str], str]]:
    """(argv, the one error line expected) for each kind of bad input."""
    lone = tmp / "lone"
    lone.mkdir()
    shutil.copy(MEGATRON / "text_document.idx", lone / "x.idx")
    magic = tmp / "magic"
    magic.mkdir()
    shutil.copy(MEGATRON / "text_document.bin", magic / "x.bin")
    idx = bytearray((MEGATRON / "text_document.idx").read_bytes())
    idx[:4] = b"TNT\x00"
    (magic / "x.idx").write_bytes(bytes(idx))
    short = tmp / "short"
    short.mkdir()
    shutil.copy(MEGATRON / "text_document.bin", short / "x.bin")
    (short / "x.idx").write_bytes((MEGATRON / "text_document.idx").read_bytes()[:-8])
    datasets.Dataset.from_dict({"content": ["a"], "id": [0]}).save_to_disk(tmp / "nocol")
    datasets.DatasetDict(
        {s: datasets.Dataset.from_dict({"text": ["a"]}) for s in ("a", "b")}
    ).save_to_disk(tmp / "splits")
    (tmp / "plain").mkdir()
    (tmp / "bad.jsonl.gz").write_bytes(b"this is not gzip\n")
    (tmp / "notes.md").write_text("hi")
    tk = ["--tokenizer", str(TOKENIZER_DIR)]
    return [
        (
            ["--input", str(lone / "x.idx"), *tk],
            f"{lone / 'x.bin'}: missing (a Megatron dataset is a .bin/.idx pair; found "
            f"{lone / 'x.idx'} without it)",
        ),
        (
            ["--input", str(magic / "x.bin"), *tk],
            f"{magic / 'x.idx'}: not a Megatron index (starts with b'TNT\\x00IDX\\x00\\x00', "
            "expected b'MMIDIDX\\x00\\x00')",
        ),
        (
            ["--input", str(short / "x.bin"), *tk],
            f"{short / 'x.idx'}: 138 bytes, expected 146 for 6 sequences and 5 document "
            "indices (truncated, or not an MMIDIDX index?)",
        ),
        (
            ["--input", str(tmp / "nocol")],
            f"{tmp / 'nocol'}: no column 'text' (columns: content, id); pick one with --text-field",
        ),
        (
            ["--input", str(tmp / "splits")],
            f"{tmp / 'splits'}: several splits (splits: a, b); pick one with --hf-split",
        ),
        (
            ["--input", str(tmp / "plain")],
            f"{tmp / 'plain'}: a folder, but not a datasets save_to_disk folder (no "
            "dataset_dict.json or state.json)",
        ),
        (["--input", str(tmp / "bad.jsonl.gz")], f"{tmp / 'bad.jsonl.gz'}: not a readable gzip"),
        (["--input", str(tmp / "notes.md")], f"{tmp / 'notes.md'}: unknown input type"),
        (
            ["--hf-dataset", str(tmp / "absent")],
            f"--hf-dataset {tmp / 'absent'}: cannot load split 'train' (",
        ),
    ]


def test_bad_inputs_stop_with_one_line(tmp_path, capsys):
    cases = _corrupt_inputs(tmp_path)
    capsys.readouterr()  # datasets' progress bars while saving
    for argv, line in cases:
        out = tmp_path / "out"
        assert main([*argv, "--out", str(out), "--quiet"]) == 1, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"sb-prep: error: {line}"), (argv, err)
        assert not (out / "meta.json").exists()
