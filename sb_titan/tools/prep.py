"""`sb-prep`: raw text (or pre-tokenized Megatron data) → a tokenized indexed dataset
(sb_titan.data.indexed).

Inputs (sb_titan/data/readers.py): .txt (one document per file: long-context data is
whole books, papers, code files), .jsonl / .jsonl.gz / .jsonl.zst (the string field
--text-field of each line), .parquet / .arrow (the column --text-field of each row), a
`datasets` save_to_disk folder, a hub dataset (--hf-dataset), and Megatron .bin/.idx
pairs (already tokenized: they need --tokenizer, the one they were made with).
Each document is stored as BOS + its tokens (no BOS when the tokenizer has none, as
Qwen2.5's), + EOS with --eos. Malformed records (bad JSON or UTF-8, a missing or
non-string field, empty text) are skipped, counted and reported as file:line (the row
for tables); --strict stops at the first. The dataset records a checksum per chunk of
its files (`--checksum-chunk-mib`, default 64); `sb-prep --verify DIR` checks them all.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from sb_titan.data.chat import ChatTemplate, ChatTemplateError, load_chat_template
from sb_titan.data.checksums import CHUNK_BYTES, ChecksumError
from sb_titan.data.indexed import (
    META,
    DatasetError,
    IndexedWriter,
    dataset_checksums,
    verify_dataset,
)
from sb_titan.data.readers import (
    HFOptions,
    Input,
    InputError,
    Record,
    classify,
    read_megatron,
    records,
    validate,
)
from sb_titan.data.tokenizer import TOKENIZER_DIR, load_tokenizer, special_tokens
from sb_titan.util.progress import Progress

BATCH_DOCS = 256  # documents tokenized per encode_batch call
SHOW_MALFORMED = 20  # locations printed; the full list goes to DIR/malformed.txt
MAX_MALFORMED = 0.01  # default share of a file's records that may be skipped
EARLY_CHECK_RECORDS = 1000  # a file this far in is judged without reading the rest


class PrepError(Exception):
    """Stops sb-prep; the message says where and why."""


@dataclass(slots=True)
class PrepReport:
    samples: int = 0
    tokens: int = 0
    malformed: list[str] = field(default_factory=list)  # "file:line: reason"
    skipped_files: list[str] = field(default_factory=list)
    sources: list[dict] = field(default_factory=list)


def have_pyarrow() -> bool:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return False
    return True


# -- progress --------------------------------------------------------------------------
# -- the pipeline ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Specials:
    """What sb-prep puts around every document."""

    bos: int | None
    eos: int | None  # only with --eos
    bos_name: str | None
    eos_name: str | None


def resolve_specials(tok: Tokenizer, tokenizer_path: Path, eos: bool) -> Specials:
    """BOS (and EOS with --eos) from the tokenizer's tokenizer_config.json."""
    bos_name, eos_name, from_config = special_tokens(tokenizer_path)
    where = Path(tokenizer_path) / "tokenizer_config.json"
    ids = {}
    for key, name in (("bos_token", bos_name), ("eos_token", eos_name)):
        ids[key] = None if name is None else tok.token_to_id(name)
        if name is not None and ids[key] is None and from_config:
            raise PrepError(f"{where}: {key} {name!r} is not in the tokenizer's vocabulary")
    if eos and ids["eos_token"] is None:
        raise PrepError(f"{where}: --eos, but the tokenizer names no EOS token (eos_token)")
    bos_name = bos_name if ids["bos_token"] is not None else None
    return Specials(ids["bos_token"], ids["eos_token"] if eos else None, bos_name, eos_name)


class _Encoder:
    """Turns records into samples in input order: text in parallel batches, token ids
    (Megatron) as they are, each with the BOS / EOS the dataset uses."""

    def __init__(
        self,
        writer: IndexedWriter,
        tok: Tokenizer,
        sp: Specials,
        report: PrepReport,
        chat: ChatTemplate | None = None,
    ):
        self.writer, self.tok, self.sp, self.report = writer, tok, sp, report
        self.chat = chat
        self.batch: list[str] = []

    def add(self, rec: Record, chat: bool = False) -> None:
        if rec.ids is None and not chat:
            self.batch.append(rec.value)
            if len(self.batch) == BATCH_DOCS:
                self.flush()
            return
        self.flush()
        sp = self.sp
        if chat:  # the conversation's own mask; BOS and EOS are context
            try:
                ids, mask = self.chat.encode(self.tok, rec.value)
            except ChatTemplateError as e:
                raise PrepError(f"{rec.where}: {e}") from None
            head = [sp.bos] if sp.bos is not None and ids[:1].tolist() != [sp.bos] else []
            tail = [] if sp.eos is None else [sp.eos]
        else:  # Megatron: keep a BOS / end-of-document id the document already has
            ids, mask = rec.ids, None
            head = [sp.bos] if sp.bos is not None and ids[0] != sp.bos else []
            tail = [sp.eos] if sp.eos is not None and ids[-1] != sp.eos else []
        if mask is not None:
            mask = np.concatenate([np.zeros(len(head), bool), mask, np.zeros(len(tail), bool)])
        ids = np.concatenate([np.asarray(head, np.int64), ids, np.asarray(tail, np.int64)])
        self._put(ids, mask)

    def flush(self) -> None:
        """Tokenize the pending texts (in parallel) and append them in order."""
        head = [] if self.sp.bos is None else [self.sp.bos]
        tail = [] if self.sp.eos is None else [self.sp.eos]
        for enc in self.tok.encode_batch(self.batch, add_special_tokens=False):
            self._put(np.asarray([*head, *enc.ids, *tail], dtype=np.int64))
        self.batch.clear()

    def _put(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        self.writer.add(ids, mask)
        self.report.samples += 1
        self.report.tokens += len(ids)


@dataclass(frozen=True, slots=True)
class PrepOptions:
    text_field: str = "text"
    chat: bool = False
    strict: bool = False
    max_malformed: float = MAX_MALFORMED
    hf: HFOptions = field(default_factory=HFOptions)


def prep(
    inputs: list[Path],
    out: Path,
    tokenizer_path: Path | None = None,
    *,
    text_field: str | None = None,
    chat: bool = False,
    strict: bool = False,
    eos: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    max_malformed: float = MAX_MALFORMED,
    hf_dataset: str | None = None,
    hf: HFOptions | None = None,
    checksum_chunk_bytes: int = CHUNK_BYTES,
) -> PrepReport:
    """Tokenize `inputs` (and the hub dataset `hf_dataset`) into the directory `out`.

    `tokenizer_path` None is the shipped tokenizer, except for Megatron inputs: their ids
    mean nothing without the tokenizer that made them, so it must be named. `chat`:
    records are conversations (field `text_field`, default "messages"), rendered with
    the tokenizer's chat template, a loss mask on the answers (sb_titan/data/chat.py).
    More than `max_malformed` of a file's records (or of all records) malformed means
    the input is not what the flags say (a wrong --text-field, another format): that
    stops the run instead of writing a dataset of the few that parsed."""
    items = _check_inputs(inputs, hf_dataset, tokenizer_path, chat)
    tokenizer_path = Path(tokenizer_path or TOKENIZER_DIR)
    if (out / META).exists() and not overwrite:
        raise PrepError(f"{out}: already holds a dataset (pass --overwrite to replace it)")
    tok = load_tokenizer(tokenizer_path)
    sp = resolve_specials(tok, tokenizer_path, eos)
    try:
        template = load_chat_template(tokenizer_path, tok) if chat else None
    except ChatTemplateError as e:
        raise PrepError(str(e)) from None
    field_name = text_field or ("messages" if chat else "text")
    opts = PrepOptions(field_name, chat, strict, max_malformed, hf or HFOptions())
    report = PrepReport()
    bar = Progress(sum(i.nbytes for i in items), progress)
    writer = IndexedWriter(out, loss_mask=chat, checksum_chunk_bytes=checksum_chunk_bytes)
    (out / "malformed.txt").unlink(missing_ok=True)  # from a replaced dataset
    encoder = _Encoder(writer, tok, sp, report, template)
    try:
        for inp in items:
            if inp.kind == "parquet" and not have_pyarrow():
                report.skipped_files.append(f"{inp.path}: skipped, pyarrow is not installed")
                bar.update(inp.nbytes)
                continue
            if inp.kind == "megatron":
                docs = read_megatron(Path(inp.path), tok.get_vocab_size(), str(tokenizer_path))
            else:
                docs = records(inp, opts.text_field, opts.hf)
            _prep_input(inp, docs, encoder, opts, bar)
        if report.samples == 0:
            first = (report.skipped_files + report.malformed)[:1]  # names the input
            why = f" (first: {first[0]})" if first else ""
            raise PrepError(f"no documents: every input record was malformed or skipped{why}")
        total = report.samples + len(report.malformed)
        _check_share(Path("all inputs"), report.malformed, total, max_malformed)
        writer.close(_meta(tokenizer_path, tok, sp, opts, report))
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    if report.malformed:
        (out / "malformed.txt").write_text("\n".join(report.malformed) + "\n")
    return report


def _prep_input(
    inp: Input, docs: Iterator[Record], encoder: _Encoder, opts: PrepOptions, bar: Progress
) -> None:
    report = encoder.report
    first, bad, seen = report.samples, len(report.malformed), 0
    for rec in docs:
        bar.update(rec.nbytes)
        seen += 1
        rec = validate(rec, opts.text_field, opts.chat)
        if rec.problem is None:
            encoder.add(rec, opts.chat)
            continue
        if opts.strict:
            raise PrepError(f"{rec.where}: {rec.problem}")
        report.malformed.append(f"{rec.where}: {rec.problem}")
        n_bad = len(report.malformed) - bad
        if seen >= EARLY_CHECK_RECORDS and n_bad > opts.max_malformed * seen:
            _check_share(Path(inp.path), report.malformed[bad:], seen, opts.max_malformed)
    encoder.flush()
    if seen == 0:  # named, not silently a source of no documents
        report.skipped_files.append(f"{inp.path}: empty (no records), skipped")
        return
    if inp.many_records:
        _check_share(Path(inp.path), report.malformed[bad:], seen, opts.max_malformed)
    source = {"path": inp.path, "format": inp.kind}
    if inp.kind in ("hf-disk", "hf-hub"):
        source.update(split=opts.hf.split, config=opts.hf.config)
    source.update(
        first_id=first, samples=report.samples - first, malformed=len(report.malformed) - bad
    )
    report.sources.append(source)


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


def _check_inputs(
    inputs: list[Path], hf_dataset: str | None, tokenizer_path: Path | None, chat: bool
) -> list[Input]:
    """Inputs in command-line order; a Megatron pair named twice (x.bin x.idx) once."""
    if not inputs and not hf_dataset:
        raise PrepError("no inputs (pass --input FILE... and/or --hf-dataset NAME)")
    items: list[Input] = []
    for p in inputs:
        inp = classify(Path(p))
        if inp.kind != "megatron" or inp not in items:
            items.append(inp)
    if hf_dataset:
        items.append(Input("hf-hub", hf_dataset, 0))
    for inp in items:
        if inp.kind == "megatron" and tokenizer_path is None:
            raise PrepError(
                f"{inp.path}: a Megatron dataset holds token ids but not its tokenizer; pass "
                "--tokenizer DIR, the one it was made with"
            )
        if chat and inp.kind in ("txt", "megatron"):
            raise PrepError(
                f"{inp.path}: --chat reads conversations from JSONL, Parquet, Arrow or "
                f"datasets records, not {inp.kind} input"
            )
    return items


def _meta(
    tokenizer_path: Path, tok: Tokenizer, sp: Specials, opts: PrepOptions, report: PrepReport
) -> dict:
    tok_file = Path(tokenizer_path) / "tokenizer.json"
    return {
        "created_by": "sb-prep",
        "tokenizer": {
            "path": str(Path(tokenizer_path).resolve()),
            "sha256": hashlib.sha256(tok_file.read_bytes()).hexdigest(),
            "vocab_size": tok.get_vocab_size(),
            "bos": sp.bos_name,
            "eos": sp.eos_name if sp.eos is not None else None,
        },
        "text_field": opts.text_field,
        **({"chat_template": "tokenizer"} if opts.chat else {}),
        "malformed": len(report.malformed),
        "sources": report.sources,
    }


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="sb-prep",
        description="Tokenize text (.txt, .jsonl[.gz|.zst], .parquet, .arrow, a datasets "
        "save_to_disk folder, a hub dataset) or copy Megatron .bin/.idx token data into an "
        "indexed dataset.",
    )
    ap.add_argument(
        "--input",
        nargs="+",
        default=[],
        type=Path,
        metavar="PATH",
        help="files, save_to_disk folders, Megatron .bin/.idx (either file, or the prefix)",
    )
    ap.add_argument("--out", type=Path, metavar="DIR", help="the dataset directory to write")
    ap.add_argument(
        "--verify",
        type=Path,
        metavar="DIR",
        help="check every chunk of an sb-prep dataset against its checksums.json, and exit",
    )
    ap.add_argument(
        "--checksum-chunk-mib",
        type=int,
        default=CHUNK_BYTES >> 20,
        metavar="MIB",
        help=f"bytes per checksummed chunk, in MiB (default {CHUNK_BYTES >> 20}): the unit a "
        "run verifies at its first read",
    )
    ap.add_argument(
        "--tokenizer",
        type=Path,
        metavar="DIR",
        help="directory holding tokenizer.json (+ tokenizer_config.json for BOS/EOS), e.g. a "
        "downloaded Qwen2.5 checkpoint (default: the shipped one; Megatron inputs need it named)",
    )
    ap.add_argument(
        "--text-field",
        metavar="NAME",
        help="JSONL field / table column of each document (default text; with --chat messages)",
    )
    ap.add_argument(
        "--chat",
        action="store_true",
        help="records are conversations (lists of {role, content}): rendered with the "
        "tokenizer's own chat template, the loss only on the answers (supervised fine-tuning)",
    )
    ap.add_argument(
        "--hf-dataset",
        metavar="NAME",
        help="also read a datasets.load_dataset name (hub or local path), streamed",
    )
    ap.add_argument(
        "--hf-split",
        metavar="SPLIT",
        help="split of --hf-dataset or of a DatasetDict folder (default: train, or the only one)",
    )
    ap.add_argument("--hf-config", metavar="NAME", help="configuration of --hf-dataset")
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
    return ap


def verify(path: Path, progress: bool = True) -> int:
    """`--verify DIR`: 0 when every chunk matches, else one line per bad chunk and 1."""
    try:
        checksums = dataset_checksums(path)
    except (DatasetError, ChecksumError) as e:
        print(f"sb-prep: error: {e}", file=sys.stderr)
        return 1
    total = sum(r["bytes"] for r in checksums.files.values())
    bar = Progress(total, progress, desc="sb-prep --verify")
    try:
        problems = verify_dataset(path, checksums, bar.update)
    finally:
        bar.close()
    for line in problems:
        print(f"sb-prep: error: {line}", file=sys.stderr)
    if problems:
        return 1
    chunks = sum(len(r["chunks"]) for r in checksums.files.values())
    print(
        f"sb-prep: {path}: ok: {chunks} chunks of {checksums.chunk_bytes} bytes in "
        f"{len(checksums.files)} files ({total} bytes) match their checksums"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.verify is not None:
        return verify(args.verify, progress=not args.quiet)
    if args.out is None:
        ap.error("the following arguments are required: --out (or --verify DIR)")
    if args.checksum_chunk_mib < 1:
        ap.error(f"--checksum-chunk-mib: must be >= 1 (got {args.checksum_chunk_mib})")
    try:
        report = prep(
            args.input,
            args.out,
            args.tokenizer,
            text_field=args.text_field,
            chat=args.chat,
            strict=args.strict,
            eos=args.eos,
            overwrite=args.overwrite,
            progress=not args.quiet,
            max_malformed=args.max_malformed,
            hf_dataset=args.hf_dataset,
            hf=HFOptions(args.hf_split, args.hf_config),
            checksum_chunk_bytes=args.checksum_chunk_mib << 20,
        )
    except (PrepError, InputError, FileNotFoundError) as e:
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
