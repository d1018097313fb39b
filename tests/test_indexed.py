"""sb-prep → IndexedDataset: round trip against the tokenizer, malformed-record
reporting with file:line, --strict, and clear errors for damaged datasets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import sb_titan.tools.prep as prep_module
from sb_titan.balance.sab import AnalyticCost, Planner, SABConfig
from sb_titan.data.checksums import ChecksumError
from sb_titan.data.indexed import DatasetError, IndexedDataset
from sb_titan.data.loader import pack_microbatch
from sb_titan.data.tokenizer import BOS, load_tokenizer
from sb_titan.tools.prep import main, prep

DOCS = [
    "key 12 maps to 34 . recall key 12 : 34 .",
    "A second document, with punctuation — and non-ASCII: naïve café 東京.",
    "x",
]
BOOK = "Chapter 1\n\nIt was a long text.\n\nChapter 2\n\nStill the same document.\n"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def expected(tok, text: str) -> list[int]:
    return [tok.token_to_id(BOS), *tok.encode(text, add_special_tokens=False).ids]


def write_inputs(tmp: Path) -> list[Path]:
    jsonl = tmp / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS)))
    txt = tmp / "b.txt"
    txt.write_text(BOOK)
    return [jsonl, txt]


def test_round_trip_jsonl_txt_parquet(tmp_path, tok):
    inputs = write_inputs(tmp_path)
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["from parquet", "row two"]}), tmp_path / "c.parquet")
    pq.write_table(pa.table({"text": ["parquet text"]}), tmp_path / "d.parquet")
    inputs.append(tmp_path / "d.parquet")
    report = prep(inputs, tmp_path / "ds", progress=False)
    texts = [*DOCS, BOOK, "parquet text"]
    assert report.samples == len(texts) and not report.malformed
    ds = IndexedDataset(tmp_path / "ds")
    assert ds.lengths.tolist() == [len(expected(tok, t)) for t in texts]
    for i, text in enumerate(texts):
        assert ds.read(i, 0, int(ds.lengths[i])).tolist() == expected(tok, text)
    assert ds.read(1, 2, 3).tolist() == expected(tok, DOCS[1])[2:5]
    assert ds.read(0, 0, 1).dtype == np.int64
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert meta["num_tokens"] == int(ds.lengths.sum())
    assert [(s["first_id"], s["samples"]) for s in meta["sources"]] == [(0, 3), (3, 1), (4, 1)]
    with pytest.raises(IndexError, match="outside sample"):
        ds.read(2, 0, int(ds.lengths[2]) + 1)
    # A different column name for Parquet comes from --text-field.
    other = prep([tmp_path / "c.parquet"], tmp_path / "ds2", text_field="body", progress=False)
    assert other.samples == 2


def test_planner_and_packing_over_indexed(tmp_path, tok):
    prep(write_inputs(tmp_path), tmp_path / "ds", progress=False)
    ds = IndexedDataset(tmp_path / "ds")
    planner = Planner(
        ds.lengths,
        seq_len=16,
        dp=1,
        microbatches=2,
        rows_per_microbatch=1,
        config=SABConfig(),
        cost_fn=AnalyticCost(16),
    )
    plan = planner.next_step()
    for mb in plan.microbatches[0]:
        tokens, _, positions = pack_microbatch(ds, mb, 16, pad_id=0)
        at = 0
        for p in mb.rows[0]:
            whole = expected(tok, ([*DOCS, BOOK])[p.sample_id])
            assert tokens[0, at : at + p.length].tolist() == whole[p.start : p.start + p.length]
            assert positions[0, at] == 0
            at += p.length


def test_malformed_records_counted_with_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        "\n".join(
            [
                json.dumps({"text": "good one"}),
                '{"text": "unterminated',
                json.dumps({"body": "no text field"}),
                json.dumps({"text": 42}),
                json.dumps({"text": "   "}),
                json.dumps({"text": "good two"}),
            ]
        )
        + "\n"
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "ds"
    argv = ["--input", str(bad), str(empty), "--out", str(out), "--quiet"]
    assert main([*argv, "--max-malformed", "1"]) == 0
    err = capsys.readouterr().err
    for line, reason in [
        (2, "bad JSON"),
        (3, "no field 'text'"),
        (4, "'text' is int, not a string"),
    ]:
        assert f"{bad}:{line}: {reason}" in err
    assert f"{bad}:5: empty text" in err and f"{empty}:1: empty text" in err
    assert IndexedDataset(out).lengths.shape == (2,)
    assert len((out / "malformed.txt").read_text().splitlines()) == 5
    assert json.loads((out / "meta.json").read_text())["malformed"] == 5


def test_strict_fails_at_first_malformed_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\nnot json\n" + json.dumps({"x": 1}) + "\n")
    out = tmp_path / "ds"
    assert main(["--input", str(bad), "--out", str(out), "--strict", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"error: {bad}:2: bad JSON" in err and ":3:" not in err
    assert not (out / "meta.json").exists() and not (out / "tokens.bin").exists()


def test_refuses_to_overwrite_and_skips_parquet_without_pyarrow(tmp_path, monkeypatch, capsys):
    inputs = write_inputs(tmp_path)
    out = tmp_path / "ds"
    assert main(["--input", *map(str, inputs), "--out", str(out), "--quiet"]) == 0
    assert main(["--input", *map(str, inputs), "--out", str(out), "--quiet"]) == 1
    assert "--overwrite" in capsys.readouterr().err
    (tmp_path / "p.parquet").write_bytes(b"PAR1")
    monkeypatch.setattr(prep_module, "have_pyarrow", lambda: False)
    argv = ["--input", str(inputs[0]), str(tmp_path / "p.parquet"), "--out", str(out)]
    assert main([*argv, "--overwrite", "--quiet"]) == 0
    assert "p.parquet: skipped, pyarrow is not installed" in capsys.readouterr().err
    assert len(IndexedDataset(out)) == len(DOCS)


@pytest.fixture()
def dataset(tmp_path) -> Path:
    prep(write_inputs(tmp_path), tmp_path / "ds", progress=False)
    return tmp_path / "ds"


def without_checksums(dataset: Path) -> Path:
    """As sb-prep wrote datasets before it recorded checksums (or after an edit of
    meta.json that dropped them): the structural checks below are all they get."""
    meta = json.loads((dataset / "meta.json").read_text())
    del meta["checksums"]
    (dataset / "meta.json").write_text(json.dumps(meta))
    (dataset / "checksums.json").unlink()
    return dataset


def test_corrupt_index_is_a_clear_error(dataset):
    (dataset / "index.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(ChecksumError, match=r"index\.npy: 14 bytes, checksums\.json records"):
        IndexedDataset(dataset)
    with pytest.raises(DatasetError, match=r"index\.npy: corrupt"):
        IndexedDataset(without_checksums(dataset))


def test_inconsistent_files_are_clear_errors(dataset):
    without_checksums(dataset)
    index = np.load(dataset / "index.npy")
    bad = index.copy()
    bad[1, 0] += 1  # sample 1 no longer starts where sample 0 ends
    np.save(dataset / "index.npy", bad)
    with pytest.raises(DatasetError, match=r"index\.npy: sample 1 starts at token"):
        IndexedDataset(dataset)
    np.save(dataset / "index.npy", index)
    tokens = (dataset / "tokens.bin").read_bytes()
    (dataset / "tokens.bin").write_bytes(tokens[:-4])
    with pytest.raises(DatasetError, match=r"tokens\.bin: .* bytes, expected"):
        IndexedDataset(dataset)
    (dataset / "tokens.bin").write_bytes(tokens)
    meta = json.loads((dataset / "meta.json").read_text())
    (dataset / "meta.json").write_text(json.dumps({**meta, "num_samples": 99}))
    with pytest.raises(DatasetError, match=r"index\.npy: 4 samples, but meta\.json says 99"):
        IndexedDataset(dataset)
    (dataset / "meta.json").write_text("{not json")
    with pytest.raises(DatasetError, match=r"meta\.json: unreadable"):
        IndexedDataset(dataset)
    (dataset / "meta.json").unlink()
    with pytest.raises(DatasetError, match=r"meta\.json: missing"):
        IndexedDataset(dataset)


def test_a_wrong_text_field_stops_instead_of_writing_what_parsed(tmp_path, capsys):
    """302 of 303 records lacking --text-field wrote '1 documents' and exited 0."""
    data = tmp_path / "data.jsonl"
    rows = [{"text": f"document {i}", "id": i} for i in range(302)] + [{"content": "one"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ds"
    argv = ["--input", str(data), "--out", str(out), "--quiet", "--text-field", "content"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"{data}: 302 of 303 records malformed" in err
    assert "no field 'content' (fields: id, text) (302x)" in err
    assert not (out / "meta.json").exists()
    # A few bad records in a large file stay a report, not an error.
    assert main(["--input", str(data), "--out", str(out), "--quiet"]) == 0
    assert "1 malformed records skipped" in capsys.readouterr().out


def test_malformed_share_is_judged_early_in_a_long_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(prep_module, "EARLY_CHECK_RECORDS", 50)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"body": "x"}) + "\n" for _ in range(5000)))
    seen = []
    real = prep_module.records

    def counting(inp, field, hf):
        for rec in real(inp, field, hf):
            seen.append(rec)
            yield rec

    monkeypatch.setattr(prep_module, "records", counting)
    assert main(["--input", str(data), "--out", str(tmp_path / "ds"), "--quiet"]) == 1
    assert len(seen) == 50 and "50 of 50 records malformed" in capsys.readouterr().err
