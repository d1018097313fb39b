"""`sb-prep`: raw text → a tokenized indexed dataset (sb_titan.data.indexed).

Inputs, by extension:
  .txt      one document per file (long-context data is whole books, papers, code
            files: splitting at blank lines would cut them into paragraphs)
  .jsonl    one JSON object per line, the document in the string field --text-field
  .parquet  one document per row, column --text-field (needs pyarrow; skipped with a
            message when it is not installed)
Each document is stored as BOS + its tokens, as in the synthetic corpus (+ EOS with
--eos). Malformed records (bad JSON or UTF-8, a missing or non-string field, empty
text) are skipped, counted and reported as file:line (the row for Parquet); --strict
stops at the first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from sb_titan.data.indexed import META, IndexedWriter
from sb_titan.data.tokenizer import BOS, EOS, TOKENIZER_DIR, load_tokenizer

FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
BATCH_DOCS = 256  # documents tokenized per encode_batch call
SHOW_MALFORMED = 20  # locations printed; the full list goes to DIR/malformed.txt
MAX_MALFORMED = 0.01  # default share of a file's records that may be skipped
EARLY_CHECK_RECORDS = 1000  # a file this far in is judged without reading the rest


class PrepError(Exception):
    """Stops sb-prep; the message says where and why."""


@dataclass(slots=True)
class Record:
    """One document of an input file, or why it could not be read."""

    where: str  # file:line (file:row for Parquet)
    text: str | None
    problem: str | None = None
    nbytes: int = 0  # input bytes consumed (for progress)


@dataclass(slots=True)
class PrepReport:
    samples: int = 0
    tokens: int = 0
    malformed: list[str] = field(default_factory=list)  # "file:line: reason"
    skipped_files: list[str] = field(default_factory=list)
    sources: list[dict] = field(default_factory=list)


# -- readers ---------------------------------------------------------------------------
def read_txt(path: Path) -> Iterator[Record]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        yield Record(f"{path}:{line}", None, "not valid UTF-8", len(raw))
        return
    yield _checked(f"{path}:1", text, len(raw))


def read_jsonl(path: Path, text_field: str) -> Iterator[Record]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(raw)
            except UnicodeDecodeError:
                yield Record(where, None, "not valid UTF-8", len(raw))
                continue
            except json.JSONDecodeError as e:
                yield Record(where, None, f"bad JSON ({e.msg})", len(raw))
                continue
            if not isinstance(obj, dict) or text_field not in obj:
                has = f" (fields: {', '.join(sorted(obj)[:8])})" if isinstance(obj, dict) else ""
                yield Record(where, None, f"no field '{text_field}'{has}", len(raw))
                continue
            yield _checked(where, obj[text_field], len(raw), text_field)


def read_parquet(path: Path, text_field: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if text_field not in pf.schema_arrow.names:
        raise PrepError(f"{path}: no column '{text_field}' (has {pf.schema_arrow.names})")
    row = 0
    for g in range(pf.num_row_groups):
        column = pf.read_row_group(g, columns=[text_field]).column(0).to_pylist()
        share = pf.metadata.row_group(g).total_byte_size // max(len(column), 1)
        for value in column:
            row += 1
            yield _checked(f"{path}:{row}", value, share, text_field)


def _checked(where: str, value: object, nbytes: int, name: str = "text") -> Record:
    if not isinstance(value, str):
        return Record(where, None, f"'{name}' is {type(value).__name__}, not a string", nbytes)
    if not value.strip():
        return Record(where, None, "empty text", nbytes)
    return Record(where, value, None, nbytes)


def records(path: Path, text_field: str) -> Iterator[Record]:
    kind = FORMATS[path.suffix.lower()]
    if kind == "txt":
        return read_txt(path)
    if kind == "jsonl":
        return read_jsonl(path, text_field)
    return read_parquet(path, text_field)


def have_pyarrow() -> bool:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return False
    return True


# -- progress --------------------------------------------------------------------------
class Progress:
    """tqdm over input bytes when available, else a plain stderr line now and then."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self._shown = total, 0, -1
        self.enabled = enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="B", unit_scale=True, desc="sb-prep")
            except ImportError:
                pass

    def update(self, n: int) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.enabled:
            pct = int(100 * self.done / max(self.total, 1))
            if pct // 5 != self._shown:
                self._shown = pct // 5
                print(f"sb-prep: {pct}% of {self.total} bytes", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


# -- the pipeline ----------------------------------------------------------------------
def prep(
    inputs: list[Path],
    out: Path,
    tokenizer_path: Path = TOKENIZER_DIR,
    *,
    text_field: str = "text",
    strict: bool = False,
    eos: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    max_malformed: float = MAX_MALFORMED,
) -> PrepReport:
    """Tokenize `inputs` into the dataset directory `out`.

    More than `max_malformed` of a JSONL/Parquet file's records (or of all records)
    malformed means the input is not what the flags say (a wrong --text-field, another
    format): that stops the run instead of writing a dataset of the few that parsed."""
    files = _check_inputs(inputs)
    if (out / META).exists() and not overwrite:
        raise PrepError(f"{out}: already holds a dataset (pass --overwrite to replace it)")
    tok = load_tokenizer(tokenizer_path)
    specials = [tok.token_to_id(BOS)] + ([tok.token_to_id(EOS)] if eos else [])
    if None in specials:
        raise PrepError(f"{tokenizer_path}: tokenizer lacks {BOS}" + (f" or {EOS}" if eos else ""))
    bos, end = specials[0], specials[1:]
    report = PrepReport()
    parquet_ok = have_pyarrow()
    bar = Progress(sum(p.stat().st_size for p in files), progress)
    writer = IndexedWriter(out)
    (out / "malformed.txt").unlink(missing_ok=True)  # from a replaced dataset
    try:
        for path in files:
            if FORMATS[path.suffix.lower()] == "parquet" and not parquet_ok:
                report.skipped_files.append(f"{path}: skipped, pyarrow is not installed")
                bar.update(path.stat().st_size)
                continue
            first, bad = report.samples, len(report.malformed)
            batch: list[str] = []
            seen = 0
            for rec in records(path, text_field):
                bar.update(rec.nbytes)
                seen += 1
                if rec.problem is not None:
                    if strict:
                        raise PrepError(f"{rec.where}: {rec.problem}")
                    report.malformed.append(f"{rec.where}: {rec.problem}")
                    n_bad = len(report.malformed) - bad
                    if seen >= EARLY_CHECK_RECORDS and n_bad > max_malformed * seen:
                        _check_share(path, report.malformed[bad:], seen, max_malformed)
                    continue
                batch.append(rec.text)
                if len(batch) == BATCH_DOCS:
                    _write(writer, tok, batch, bos, end, report)
            _write(writer, tok, batch, bos, end, report)
            if FORMATS[path.suffix.lower()] != "txt":  # a .txt file is one record
                _check_share(path, report.malformed[bad:], seen, max_malformed)
            report.sources.append(
                {
                    "path": str(path),
                    "format": FORMATS[path.suffix.lower()],
                    "first_id": first,
                    "samples": report.samples - first,
                    "malformed": len(report.malformed) - bad,
                }
            )
        if report.samples == 0:
            raise PrepError("no documents: every input record was malformed or skipped")
        total = report.samples + len(report.malformed)
        _check_share(Path("all inputs"), report.malformed, total, max_malformed)
        writer.close(_meta(tokenizer_path, text_field, eos, report))
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    if report.malformed:
        (out / "malformed.txt").write_text("\n".join(report.malformed) + "\n")
    return report


def _check_share(where: Path, malformed: list[str], records: int, max_share: float) -> None:
    """Stop when more than `max_share` of `records` were malformed, naming the most
    common reason (e.g. a --text-field the records do not have)."""
    if not malformed or len(malformed) <= max_share * records:
        return
    reasons = Counter(line.split(": ", 1)[1] for line in malformed)
    reason, count = reasons.most_common(1)[0]
    raise PrepError(
        f"{where}: {len(malformed)} of {records} records malformed "
        f"({len(malformed) / records:.0%} > --max-malformed {max_share:g}); most common: "
        f"{reason} ({count}x). Check --text-field and the input format, or raise "
        "--max-malformed to keep the rest"
    )


def _check_inputs(inputs: list[Path]) -> list[Path]:
    if not inputs:
        raise PrepError("no input files")
    for p in inputs:
        if not p.is_file():
            raise PrepError(f"{p}: not a file")
        if p.suffix.lower() not in FORMATS:
            raise PrepError(f"{p}: unknown input type (expected one of {sorted(FORMATS)})")
    return inputs


def _write(
    writer: IndexedWriter,
    tok: Tokenizer,
    batch: list[str],
    bos: int,
    end: list[int],
    report: PrepReport,
) -> None:
    """Tokenize a batch of documents (in parallel) and append them in order."""
    for enc in tok.encode_batch(batch, add_special_tokens=False):
        ids = np.asarray([bos, *enc.ids, *end], dtype=np.int64)
        writer.add(ids)
        report.samples += 1
        report.tokens += len(ids)
    batch.clear()


def _meta(tokenizer_path: Path, text_field: str, eos: bool, report: PrepReport) -> dict:
    tok_file = Path(tokenizer_path) / "tokenizer.json"
    return {
        "created_by": "sb-prep",
        "tokenizer": {
            "path": str(Path(tokenizer_path).resolve()),
            "sha256": hashlib.sha256(tok_file.read_bytes()).hexdigest(),
            "bos": BOS,
            "eos": EOS if eos else None,
        },
        "text_field": text_field,
        "malformed": len(report.malformed),
        "sources": report.sources,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="sb-prep", description="Tokenize .txt/.jsonl/.parquet files into an indexed dataset."
    )
    ap.add_argument("--input", nargs="+", required=True, type=Path, metavar="FILE")
    ap.add_argument("--out", required=True, type=Path, metavar="DIR")
    ap.add_argument(
        "--tokenizer",
        type=Path,
        default=TOKENIZER_DIR,
        metavar="PATH",
        help="directory holding tokenizer.json (default: the shipped one)",
    )
    ap.add_argument("--text-field", default="text", help="JSONL field / Parquet column")
    ap.add_argument("--strict", action="store_true", help="fail on the first malformed record")
    ap.add_argument("--eos", action="store_true", help="also append EOS to every document")
    ap.add_argument("--overwrite", action="store_true", help="replace a dataset in --out")
    ap.add_argument(
        "--max-malformed",
        type=float,
        default=MAX_MALFORMED,
        metavar="SHARE",
        help=f"largest share of a file's records that may be skipped (default {MAX_MALFORMED})",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress output")
    args = ap.parse_args(argv)
    try:
        report = prep(
            args.input,
            args.out,
            args.tokenizer,
            text_field=args.text_field,
            strict=args.strict,
            eos=args.eos,
            overwrite=args.overwrite,
            progress=not args.quiet,
            max_malformed=args.max_malformed,
        )
    except (PrepError, FileNotFoundError) as e:
        print(f"sb-prep: error: {e}", file=sys.stderr)
        return 1
    for line in report.skipped_files:
        print(f"sb-prep: {line}", file=sys.stderr)
    for line in report.malformed[:SHOW_MALFORMED]:
        print(f"sb-prep: malformed: {line}", file=sys.stderr)
    if len(report.malformed) > SHOW_MALFORMED:
        more = len(report.malformed) - SHOW_MALFORMED
        print(
            f"sb-prep: ... and {more} more (all in {args.out / 'malformed.txt'})", file=sys.stderr
        )
    print(
        f"sb-prep: wrote {report.samples} documents, {report.tokens} tokens to {args.out} "
        f"({len(report.malformed)} malformed records skipped)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
