"""`sb-eval`: accuracy of a trained checkpoint (or an HF directory).

    sb-eval longbench --checkpoint outputs/run/checkpoint \\
        --data longbench/data --tasks hotpotqa,trec [--attention sparse --budget 0.9] \\
        [--max-length 31500] [--out eval/longbench]
    sb-eval longbench --hf exported/qwen --data longbench/data
    sb-eval retrieval --checkpoint outputs/run/checkpoint \\
        --lengths 1k,2k,4k --depths 0,0.25,0.5,0.75,1 [--trials 8] [--out eval/retrieval]
    sb-eval ruler --checkpoint outputs/run/checkpoint \\
        [--tasks all|niah_single_1,...] [--lengths 1k,2k,4k] [--samples 20] [--seed 42] \\
        [--haystack essays.txt] [--template corpus|ruler] [--out eval/ruler]
    sb-eval ruler --hf exported/qwen --lengths 4k,8k,16k,32k

`--attention sparse` runs the prompt (prefill) through the recipe's dynamic sparse
attention at `--budget` (default: the config's dst.beta0); generated tokens attend
densely to the KV cache. Default attention: the config's [sparse_attention].enabled
(`--hf`: dense).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _add_model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="DCP step-N dir, or a checkpoint/dump folder")
    src.add_argument("--hf", help="a Hugging Face Qwen2 directory (e.g. from sb-export)")
    p.add_argument(
        "--config", help="TOML the checkpoint was trained with (default: its own run record)"
    )
    p.add_argument("--attention", choices=("dense", "sparse"), default=None)
    p.add_argument("--budget", type=float, default=None, help="sparse prefill budget in (0, 1]")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="e.g. cuda (sparse prefill: Triton kernels)")
    p.add_argument("--out", default=None, help="output directory")


def _load(args: argparse.Namespace):
    import torch  # here, once the command's own checks passed: they answer at once

    from sb_titan.config.toml import ConfigError
    from sb_titan.eval.checkpoint import load_from_config, load_from_hf

    threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads:
        torch.set_num_threads(threads)

    if args.checkpoint is not None:
        try:
            loaded = load_from_config(args.checkpoint, args.config, args.attention)
        except ConfigError as e:
            sys.exit(f"sb-eval: error: {e}")
    else:
        loaded = load_from_hf(args.hf, args.attention)
    loaded.model.to(args.device)
    return loaded


def _budget(args: argparse.Namespace, loaded) -> float:
    budget = loaded.default_budget if args.budget is None else args.budget
    if not 0.0 < budget <= 1.0:
        sys.exit(f"sb-eval: --budget {budget} must be in (0, 1]")
    return budget if loaded.attention.enabled else 1.0


def _describe(loaded, budget: float) -> str:
    mode = f"sparse prefill, budget {budget:g}" if loaded.attention.enabled else "dense"
    return f"model {loaded.source} | attention: {mode}"


def cmd_longbench(args: argparse.Namespace) -> dict:
    from sb_titan.eval.longbench import (
        EN_TASKS,
        TASKS,
        ZH_TASKS,
        LongBenchConfig,
        check_tasks,
        format_table,
        run_longbench,
    )

    groups = {"all": TASKS, "en": EN_TASKS, "zh": ZH_TASKS}
    names = [t.strip() for t in (args.tasks or "all").split(",") if t.strip()]
    tasks = tuple(dict.fromkeys(t for name in names for t in groups.get(name, (name,))))
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        sys.exit(f"sb-eval: --tasks: unknown task(s) {unknown}; expected all, en, zh or {TASKS}")
    try:
        check_tasks(Path(args.data), tasks, args.e)  # before minutes of loading a model
    except ValueError as e:
        sys.exit(f"sb-eval: {e}")
    from sb_titan.data.tokenizer import load_tokenizer
    from sb_titan.eval.checkpoint import eos_ids
    from sb_titan.eval.generate import Generator

    loaded = _load(args)
    budget = _budget(args, loaded)
    tok = load_tokenizer(loaded.tokenizer_dir)
    gen = Generator(loaded.model, tok, eos_ids(tok, loaded.tokenizer_dir), budget)
    cfg = LongBenchConfig(Path(args.data), tasks, args.max_length, args.e, args.limit)
    print(_describe(loaded, budget))
    out = Path(args.out) if args.out else None
    report = run_longbench(gen, cfg, out)
    report.update(model=loaded.source, attention=_mode(loaded), budget=budget)
    if out is not None:
        (out / "result.json").write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    return report


def cmd_retrieval(args: argparse.Namespace) -> dict:
    from sb_titan.data.tokenizer import load_tokenizer
    from sb_titan.eval.retrieval import (
        RetrievalConfig,
        format_grid,
        parse_lengths,
        run_retrieval,
        save_heatmap,
        save_report,
    )

    loaded = _load(args)
    budget = _budget(args, loaded)
    tok = load_tokenizer(loaded.tokenizer_dir)
    cfg = RetrievalConfig(
        lengths=parse_lengths(args.lengths),
        depths=[float(d) for d in args.depths.split(",")],
        trials=args.trials,
        seed=args.seed,
        batch_size=args.batch_size,
    )
    print(_describe(loaded, budget))
    report = run_retrieval(loaded.model, tok, cfg, budget)
    report.update(model=loaded.source, attention=_mode(loaded))
    print(format_grid(report))
    out = Path(args.out or "eval_retrieval")
    save_report(report, out / "retrieval.json")
    png = save_heatmap(report, out / "retrieval.png", title=f"retrieval ({_mode(loaded)})")
    print(f"wrote {out / 'retrieval.json'} and {png}")
    return report


def cmd_ruler(args: argparse.Namespace) -> dict:
    from sb_titan.data.tokenizer import TOKENIZER_DIR, load_tokenizer, special_tokens
    from sb_titan.eval.checkpoint import eos_ids
    from sb_titan.eval.niah import RulerInputError, parse_tasks, read_haystack
    from sb_titan.eval.retrieval import parse_lengths
    from sb_titan.eval.ruler import RulerConfig, format_table, run_ruler, save_heatmap

    try:
        tasks = parse_tasks(args.tasks)
        lengths = parse_lengths(args.lengths)
    except ValueError as e:  # RulerInputError, or a length that is not a number
        sys.exit(f"sb-eval: {e}" if isinstance(e, RulerInputError) else _lengths_error(args))
    if not lengths or min(lengths) <= 0:
        sys.exit(_lengths_error(args))
    if args.samples < 1:
        sys.exit(f"sb-eval: --samples {args.samples}: expected a positive integer")
    try:
        if args.haystack is not None:
            read_haystack(args.haystack)
    except RulerInputError as e:
        sys.exit(f"sb-eval: {e}")
    loaded = _load(args)
    if max(lengths) > loaded.dims.max_seq_len:
        sys.exit(
            f"sb-eval: --lengths: {max(lengths)} exceeds the model's "
            f"{loaded.dims.max_seq_len} positions (max_position_embeddings)"
        )
    budget = _budget(args, loaded)
    tok = load_tokenizer(loaded.tokenizer_dir)
    bundled = tok.to_str() == load_tokenizer(TOKENIZER_DIR).to_str()
    template = args.template or ("corpus" if bundled else "ruler")
    bos_name = special_tokens(loaded.tokenizer_dir)[0]
    bos = tok.token_to_id(bos_name) if bos_name else None
    haystack = Path(args.haystack) if args.haystack else None
    cfg = RulerConfig(tasks, lengths, args.samples, args.seed, template, haystack)
    out = Path(args.out or "eval_ruler")
    print(f"{_describe(loaded, budget)} | template: {template}")
    try:
        report = run_ruler(
            loaded.model,
            tok,
            cfg,
            eos_ids=eos_ids(tok, loaded.tokenizer_dir),
            bos_id=bos,
            budget=budget,
            out_dir=out,
        )
    except RulerInputError as e:
        sys.exit(f"sb-eval: {e}")
    report.update(model=loaded.source, attention=_mode(loaded))
    (out / "result.json").write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    png = save_heatmap(report, out / "ruler.png", title=f"RULER NIAH ({_mode(loaded)})")
    print(f"wrote {out / 'result.json'} and {png}")
    return report


def _lengths_error(args: argparse.Namespace) -> str:
    return f"sb-eval: --lengths {args.lengths!r}: expected token counts like 1k,2k,4096"


def _mode(loaded) -> str:
    return "sparse" if loaded.attention.enabled else "dense"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="sb-eval", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    lb = sub.add_parser("longbench", help="LongBench tasks from local JSONL files")
    _add_model_args(lb)
    lb.add_argument("--data", required=True, help="directory of <task>.jsonl files")
    lb.add_argument(
        "--tasks", default=None, help="comma-separated tasks, or all / en / zh (default: all 21)"
    )
    lb.add_argument("--max-length", type=int, default=31500, help="prompt tokens kept (middle cut)")
    lb.add_argument("--e", action="store_true", help="LongBench-E files and length buckets")
    lb.add_argument("--limit", type=int, default=None, help="first N samples per task")

    rt = sub.add_parser("retrieval", help="key-value retrieval by length and depth")
    _add_model_args(rt)
    rt.add_argument("--lengths", default="1k,2k,4k")
    rt.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    rt.add_argument("--trials", type=int, default=8)
    rt.add_argument("--seed", type=int, default=1234)
    rt.add_argument("--batch-size", type=int, default=1)

    from sb_titan.eval.niah import TASKS as RULER_TASKS

    ru = sub.add_parser(
        "ruler",
        help="RULER needle-in-a-haystack tasks (niah_*), scored as RULER",
        description="RULER's eight NIAH tasks at each length, scored with string_match_all.",
    )
    _add_model_args(ru)
    ru.add_argument(
        "--tasks",
        default="all",
        help=f"comma-separated, or all (default): {', '.join(RULER_TASKS)}",
    )
    ru.add_argument(
        "--lengths", default="1k,2k,4k", help="tokens per sample, prompt + answer (1k,2k,4k)"
    )
    ru.add_argument("--samples", type=int, default=20, help="samples per task and length")
    ru.add_argument("--seed", type=int, default=42, help="RULER's default: 42")
    ru.add_argument(
        "--haystack",
        default=None,
        help="text file for the essay haystack, cycled (default: the synthetic corpus's words)",
    )
    ru.add_argument(
        "--template",
        choices=("corpus", "ruler"),
        default=None,
        help="needle/question phrasing: corpus (' key K : V .', for models trained on "
        "the bundled corpus) or ruler (RULER's English); default: corpus with the bundled "
        "tokenizer, else ruler",
    )

    args = parser.parse_args(argv)
    commands = {"longbench": cmd_longbench, "retrieval": cmd_retrieval, "ruler": cmd_ruler}
    commands[args.command](args)


if __name__ == "__main__":
    main()
