"""AOT resource report of the Triton kernels: registers, shared memory, spills, MMA work.

Compiles every shipped config (bf16/fp16 x head_dim 64/128 x block 64/128) of every
kernel, and the `int4_max` block-max kernel (int8 codes) at each head_dim x block, for
sm_80 and sm_90a on this machine, no GPU needed (kernels/aot.py), and reads
registers / STACK / LOCAL with `cuobjdump -res-usage`, spill bytes with `ptxas -v`,
dynamic shared memory from Triton's metadata, and the MMA volume per loop iteration from
the PTX (`mma_ratio` = executed / needed; > 1 means warps repeat each other's tensor-core
work). Fails (exit 1) if any config spills, exceeds the arch's shared-memory limit or
duplicates MMA work.

    python bench/kernels_report.py           ->  bench/results/kernels_report.json
    python bench/kernels_report.py --sweep   ->  bench/results/kernels_sweep.json

`--sweep` compiles candidate tiles of the three tiled attention kernels for bf16 on both
arches (BLOCK_M, BLOCK_N in {16, 32, 64, 128} dividing Bs, 4/8 warps, 2/3 stages; 2
worker processes) and prints the `_BY_SHAPE` table it picks (see `pick`) as Python.
`--sweep --kernels block_max` does the same for the block-max kernel's
`BLOCK_MAX_CONFIGS` (-> bench/results/kernels_sweep_block_max.json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from itertools import product
from pathlib import Path

import triton
from sb_titan_kernels import aot
from sb_titan_kernels.common import SHIPPED_BLOCK_SIZES, SHIPPED_HEAD_DIMS, Tile

RESULTS = Path(__file__).resolve().parent / "results"
OUT = RESULTS / "kernels_report.json"
SWEEP_OUT = RESULTS / "kernels_sweep.json"

SWEEP_SIZES = (16, 32, 64, 128)
SWEEP_WARPS = (4, 8)
SWEEP_STAGES = (2, 3)
#: the tile dimension a program keeps for its whole loop (its rows of the output)
RESIDENT = {"fwd": "block_m", "bwd_dq": "block_m", "bwd_dkdv": "block_n", "block_max": "block_n"}
SWEPT = (*aot.ATTN_TILED, "block_max")
PICK_RULE = (
    "among candidates with no spills (LOCAL = STACK = 0), shared memory within the limit "
    "and mma_ratio = 1 on both sm_80 and sm_90a: the largest tile area BLOCK_M x BLOCK_N, "
    "then the larger resident dimension (BLOCK_M for fwd/dQ, BLOCK_N for dK/dV and "
    "block_max: fewer reloads of the streamed operands), then fewer warps, then more stages"
)


def _tool_version(path: str | None) -> str | None:
    if not path:
        return None
    text = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    return text.strip().splitlines()[-1] if text.strip() else None


def _ptxas_versions() -> dict[str, str | None]:
    from triton.backends.nvidia.compiler import get_ptxas

    return {arch: _tool_version(get_ptxas(cap).path) for arch, (cap, _) in aot.ARCHS.items()}


def _cell(r: aot.ResUsage) -> str:
    spills = "?" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
    mma = "-" if r.mma_ratio is None else f"{r.mma_ratio:.3g}"
    return f"{r.regs} / {r.shared / 1024:.1f} / {spills} / {mma}"


def markdown_table(rows: list[aot.ResUsage]) -> str:
    """One line per kernel x config; per arch: regs / shared KiB / spill store/load bytes /
    mma_ratio ("-": no dots)."""
    archs = list(aot.ARCHS)
    by_key: dict[tuple, dict[str, aot.ResUsage]] = {}
    for r in rows:
        by_key.setdefault((r.kernel, r.dtype, r.head_dim, r.block_size), {})[r.arch] = r
    head = "| kernel | dtype | D | Bs | tile MxN, warps, stages | "
    head += " | ".join(f"{a}: regs / smem KiB / spill B / mma" for a in archs) + " |"
    lines = [head, "|" + "---|" * (5 + len(archs))]
    for (kernel, dtype, d, bs), per_arch in by_key.items():
        r0 = next(iter(per_arch.values()))
        shape = f"{r0.block_m}x{r0.block_n}" if r0.block_n else f"{r0.block_m} rows"
        tile = f"{shape}, {r0.num_warps}, {r0.num_stages}"
        cells = " | ".join(_cell(per_arch[a]) for a in archs)
        lines.append(f"| {kernel} | {dtype} | {d} | {bs} | {tile} | {cells} |")
    return "\n".join(lines)


def _setup() -> dict:
    return {
        "triton": triton.__version__,
        "cuobjdump": _tool_version(aot.cuobjdump_path()),
        "ptxas": _ptxas_versions(),
        "python": platform.python_version(),
        "fp_fusion": True,
        "signature": "16-byte aligned pointers; strides and seq_len divisible by 16",
        "shared_limit_bytes": {a: lim for a, (_, lim) in aot.ARCHS.items()},
    }


def _rel(path: Path) -> Path:
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def report_main() -> int:
    rows = aot.full_report(spills=True, specs=[*aot.shipped_specs(), *aot.block_max_specs()])
    print(markdown_table(rows))
    bad = [r for r in rows if not r.ok]
    limits = ", ".join(f"{a} {lim // 1024} KiB" for a, (_, lim) in aot.ARCHS.items())
    print(
        f"\n{len(rows) - len(bad)}/{len(rows)} ok (no spills; shared memory within {limits}; "
        "mma_ratio 1)"
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    report = {"setup": _setup(), "rows": [r.as_dict() for r in rows]}
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {_rel(OUT)}")
    if bad:
        for r in bad:
            print("NOT OK:", r, file=sys.stderr)
    return 1 if bad else 0


# ------------------------------------------------------------------ tile sweep


def sweep_candidates(
    dtype: str = "bf16", kernels: tuple[str, ...] = tuple(aot.ATTN_TILED)
) -> list[tuple[str, str, int, int, Tile]]:
    """(kernel, dtype, D, Bs, tile) for every swept kernel (SWEPT) and candidate tile;
    block_max reads int8 codes whatever `dtype` is."""
    out = []
    for kernel in kernels:
        dt = "i8" if kernel == "block_max" else dtype
        for d, bs in product(SHIPPED_HEAD_DIMS, SHIPPED_BLOCK_SIZES):
            sizes = [s for s in SWEEP_SIZES if bs % s == 0]
            for bm, bn, w, st in product(sizes, sizes, SWEEP_WARPS, SWEEP_STAGES):
                out.append((kernel, dt, d, bs, Tile(bm, bn, w, st)))
    return out


def _measure(cand: tuple[str, str, int, int, Tile]) -> list[dict]:
    """One candidate on every arch (in a worker); a failed compile is recorded, not raised."""
    kernel, dtype, d, bs, tile = cand
    if kernel == "block_max":
        spec = aot.block_max_spec(d, bs, tile)
    else:
        spec = aot.attn_spec(kernel, dtype, d, bs, tile)
    tool = aot.cuobjdump_path()
    rows = []
    for arch in aot.ARCHS:
        try:
            rows.append(aot.report(spec, arch, tool, spills=False).as_dict())
        except Exception as e:  # noqa: BLE001 - one bad candidate must not stop the sweep
            rows.append(
                {"kernel": kernel, "dtype": dtype, "head_dim": d, "block_size": bs, "arch": arch,
                 **tile._asdict(), "ok": False, "error": f"{type(e).__name__}: {e}"}
            )  # fmt: skip
    return rows


def _tile(r: dict) -> Tile:
    return Tile(r["block_m"], r["block_n"], r["num_warps"], r["num_stages"])


def passing(rows: list[dict]) -> dict[tuple[str, int, int], list[Tile]]:
    """(kernel, D, Bs) -> candidate tiles that are ok (no spills, shared memory within the
    limit, mma_ratio 1, registers read by cuobjdump) on every arch."""
    by_tile: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["kernel"], r["head_dim"], r["block_size"], _tile(r))
        by_tile.setdefault(key, {})[r["arch"]] = r
    out: dict[tuple[str, int, int], list[Tile]] = {}
    for (kernel, d, bs, t), by_arch in by_tile.items():
        ok = [by_arch.get(a, {}) for a in aot.ARCHS]
        good = all(r.get("ok") and r.get("source") == "cuobjdump" for r in ok)
        out.setdefault((kernel, d, bs), []).extend([t] if good else [])
    return out


def pick(kernel: str, tiles: list[Tile]) -> Tile | None:
    """PICK_RULE over the passing tiles of one (kernel, D, Bs); None when there are none."""

    def rank(t: Tile) -> tuple:
        resident = t.block_m if RESIDENT[kernel] == "block_m" else t.block_n
        return (t.block_m * t.block_n, resident, -t.num_warps, t.num_stages)

    return max(tiles, key=rank, default=None)


def table_python(best: dict[tuple[str, int, int], Tile | None]) -> str:
    """`_BY_SHAPE` of kernels/attn_tiles.py as Python source, ready to paste."""
    lines = ["_BY_SHAPE: dict[tuple[int, int], AttnTiles] = {"]
    for d, bs in product(SHIPPED_HEAD_DIMS, SHIPPED_BLOCK_SIZES):
        tiles = {}
        for kernel, field_ in aot.ATTN_TILED.items():
            t = best.get((kernel, d, bs))
            tiles[field_] = "None  # no candidate passes" if t is None else f"Tile{tuple(t)}"
        lines.append(f"    ({d}, {bs}): AttnTiles(")
        lines.append(
            f"        fwd={tiles['fwd']}, preprocess=_PRE, dq={tiles['dq']}, dkdv={tiles['dkdv']}"
        )
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines)


def block_max_python(best: dict[tuple[str, int, int], Tile | None]) -> str:
    """`BLOCK_MAX_CONFIGS` of kernels/block_max.py as Python source, ready to paste."""
    lines = ["BLOCK_MAX_CONFIGS: dict[tuple[int, int], Tile] = {"]
    for d, bs in product(SHIPPED_HEAD_DIMS, SHIPPED_BLOCK_SIZES):
        t = best.get(("block_max", d, bs))
        lines.append(
            f"    ({d}, {bs}): "
            + ("None,  # no candidate passes" if t is None else f"Tile{tuple(t)},")
        )
    lines.append("}")
    return "\n".join(lines)


def _chosen_table(rows: list[dict], ok: dict, best: dict) -> str:
    archs = list(aot.ARCHS)
    by = {(r["kernel"], r["head_dim"], r["block_size"], _tile(r), r["arch"]): r for r in rows}
    head = "| kernel | D | Bs | tile MxN, warps, stages | passing | "
    head += " | ".join(f"{a}: regs / smem KiB / mma" for a in archs) + " |"
    lines = [head, "|" + "---|" * (5 + len(archs))]
    for (kernel, d, bs), t in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        if t is None:
            lines.append(f"| {kernel} | {d} | {bs} | none | 0 |" + " |" * len(archs))
            continue
        cells = []
        for a in archs:
            r = by[(kernel, d, bs, t, a)]
            cells.append(f"{r['regs']} / {r['shared'] / 1024:.1f} / {r['mma_ratio']:.3g}")
        shape = f"{t.block_m}x{t.block_n}, {t.num_warps}, {t.num_stages}"
        n_ok = len(ok[(kernel, d, bs)])
        lines.append(f"| {kernel} | {d} | {bs} | {shape} | {n_ok} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


_SLIM = {"mma_dots", "spill_stores", "spill_loads", "shared_limit", "dtype"}


def sweep_main(jobs: int, kernels: tuple[str, ...] = tuple(aot.ATTN_TILED)) -> int:
    cands = sweep_candidates(kernels=kernels)
    t0 = time.perf_counter()
    rows: list[dict] = []
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        for i, got in enumerate(pool.map(_measure, cands, chunksize=4), 1):
            rows.extend(got)
            if i % 50 == 0:
                print(f"{i}/{len(cands)} candidates, {time.perf_counter() - t0:.0f} s", flush=True)
    wall = time.perf_counter() - t0
    ok = passing(rows)
    best = {key: pick(key[0], tiles) for key, tiles in ok.items()}
    errors = [r for r in rows if "error" in r]
    print(f"\n{len(cands)} candidates x {len(aot.ARCHS)} arches in {wall:.0f} s ({jobs} workers), "
          f"{len(errors)} failed to compile\nrule: {PICK_RULE}\n")  # fmt: skip
    print(_chosen_table(rows, ok, best) + "\n")
    if set(kernels) & set(aot.ATTN_TILED):
        print(table_python(best))
    if "block_max" in kernels:
        print(block_max_python(best))
    path = SWEEP_OUT
    if set(kernels) != set(aot.ATTN_TILED):  # a partial or block-max sweep has its own file
        path = SWEEP_OUT.with_name(f"kernels_sweep_{'_'.join(kernels)}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {
        "setup": {**_setup(), "dtype": ", ".join(sorted({c[1] for c in cands})),
                  "workers": jobs, "wall_s": round(wall, 1)},
        "space": {"sizes": SWEEP_SIZES, "warps": SWEEP_WARPS, "stages": SWEEP_STAGES},
        "rule": PICK_RULE,
        "chosen": [
            {"kernel": k, "head_dim": d, "block_size": bs, "tile": t and t._asdict()}
            for (k, d, bs), t in best.items()
        ],
        "rows": "ROWS",
    }  # fmt: skip
    # one line per candidate x arch, without the per-dot detail (the report has it)
    lines = ",\n".join(json.dumps({k: v for k, v in r.items() if k not in _SLIM}) for r in rows)
    text = json.dumps(out, indent=1).replace('"ROWS"', "[\n" + lines + "\n ]")
    path.write_text(text + "\n")
    print(f"\nwrote {_rel(path)}")
    return 0 if all(t is not None for t in best.values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="sweep candidate tiles")
    parser.add_argument("--jobs", type=int, default=2, help="sweep worker processes")
    parser.add_argument(
        "--kernels",
        default=",".join(aot.ATTN_TILED),
        help=f"kernels to sweep (comma list of {', '.join(SWEPT)})",
    )
    args = parser.parse_args()
    # explicit, as Triton 3.10 asks; also part of Triton's cache key, and the test's AOT
    # child sets the same value, so the two share compiled kernels
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    kernels = tuple(args.kernels.split(","))
    if unknown := set(kernels) - set(SWEPT):
        parser.error(f"unknown kernels {sorted(unknown)}; expected some of {SWEPT}")
    return sweep_main(args.jobs, kernels) if args.sweep else report_main()


if __name__ == "__main__":
    sys.exit(main())
