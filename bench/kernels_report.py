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

Every attention row is compiled from each tile table that runs on its arch
(`aot.arch_tables`: the arch's own, "common" and the arch's alternatives such as
sm_90a_mma_sync), and reports the MMA instruction of its dots (`mma_instr`, `mma_count`:
`wgmma` vs `mma.sync` in the PTX) and the CTAs per SM that its registers, shared memory
and warps allow (`occupancy`).

`--sweep` compiles candidate tiles of the three tiled attention kernels for bf16 on both
arches (BLOCK_M, BLOCK_N in {16, 32, 64, 128} dividing Bs, 4/8 warps, 2/3 stages; 2
worker processes) and prints the table it picks (see `pick`) as Python. `--arch sm_90a`
(or sm_80) picks for that arch alone; on sm_90a alone it compiles only the tiles whose
resident dimension gives each warp group 64 rows (wgmma's M: every dot of these kernels
has the resident rows as M) and prefers tiles whose dots all issue wgmma
(-> bench/results/kernels_sweep_sm_90a.json). `--sweep --kernels block_max` does the
same for the block-max kernel's `BLOCK_MAX_CONFIGS`
(-> bench/results/kernels_sweep_block_max.json).

`--masks` compiles every table's tiled attention kernels (bf16) with both partial-tile
masks, document bounds and document ids, on the arches each table runs on, and prints
`DOC_ID_MASK` of kernels/attn_tiles.py (see `MASK_RULE`; with `--and-sweep` another
Triton's --masks JSON counts too) (-> bench/results/kernels_masks.json).

`--triton VERSION` builds with another Triton: with the running one if it is VERSION,
else with `--python PY` (an interpreter that has it, e.g. a scratch venv of the GPU
machine's stack), else from a side install `pip install --no-deps --target
/tmp/triton-VERSION triton==VERSION` made on first use and put first on PYTHONPATH.
Its results go to `<name>_triton-VERSION.json` beside the default files.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from itertools import product
from pathlib import Path
from typing import NamedTuple

import triton

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # a source checkout without install (another Python)
    sys.path.insert(0, str(REPO))

from sb_titan.util.source_tree import use_source_kernels  # noqa: E402

use_source_kernels()

from sb_titan_kernels import aot  # noqa: E402
from sb_titan_kernels.attn_tiles import MASKS  # noqa: E402
from sb_titan_kernels.common import SHIPPED_BLOCK_SIZES, SHIPPED_HEAD_DIMS, Tile  # noqa: E402

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
    "and mma_ratio = 1 on every swept arch (and in every --and-sweep): on sm_90a alone, "
    "tiles whose dots all issue wgmma first; then the largest tile area BLOCK_M x BLOCK_N, "
    "then the larger resident dimension (BLOCK_M for fwd/dQ, BLOCK_N for dK/dV and "
    "block_max: fewer reloads of the streamed operands), then (sm_90a alone) more CTAs "
    "per SM, then fewer warps, then more stages"
)


def _tool_version(path: str | None) -> str | None:
    if not path:
        return None
    text = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    return text.strip().splitlines()[-1] if text.strip() else None


def _ptxas_versions() -> dict[str, str | None]:
    from triton.backends.nvidia.compiler import get_ptxas

    return {arch: _tool_version(get_ptxas(a.cap).path) for arch, a in aot.ARCHS.items()}


def _cell(r: aot.ResUsage) -> str:
    spills = "?" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}"
    mma = "-" if r.mma_ratio is None else f"{r.mma_instr} x{r.mma_ratio:.3g}"
    ctas = "?" if r.occupancy is None else r.occupancy["ctas"]
    return f"{r.regs} / {r.shared / 1024:.1f} / {spills} / {mma} / {ctas}"


def markdown_table(rows: list[aot.ResUsage]) -> str:
    """One line per kernel x config x tile table; per arch: regs / shared KiB / spill
    store/load bytes / MMA instruction and mma_ratio ("-": no dots) / CTAs per SM."""
    archs = list(aot.ARCHS)
    by_key: dict[tuple, dict[str, aot.ResUsage]] = {}
    for r in rows:
        key = (r.kernel, r.dtype, r.head_dim, r.block_size, r.table, _tile(vars(r)))
        by_key.setdefault(key, {})[r.arch] = r
    head = "| kernel | dtype | D | Bs | table | tile MxN, warps, stages | "
    head += " | ".join(f"{a}: regs / smem KiB / spill B / mma / CTAs/SM" for a in archs) + " |"
    lines = [head, "|" + "---|" * (6 + len(archs))]
    for (kernel, dtype, d, bs, table, t), per_arch in by_key.items():
        shape = f"{t.block_m}x{t.block_n}" if t.block_n else f"{t.block_m} rows"
        tile = f"{shape}, {t.num_warps}, {t.num_stages}"
        cells = " | ".join(_cell(per_arch[a]) if a in per_arch else "" for a in archs)
        lines.append(f"| {kernel} | {dtype} | {d} | {bs} | {table} | {tile} | {cells} |")
    return "\n".join(lines)


def _setup() -> dict:
    return {
        "triton": triton.__version__,
        "cuobjdump": _tool_version(aot.cuobjdump_path()),
        "ptxas": _ptxas_versions(),
        "python": platform.python_version(),
        "fp_fusion": True,
        "signature": "16-byte aligned pointers; strides and seq_len divisible by 16",
        "arch_limits": {a: lim._asdict() for a, lim in aot.ARCHS.items()},
        "tables": {a: aot.arch_tables(a) for a in aot.ARCHS},
    }


def _rel(path: Path) -> Path:
    return path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path


def _versioned(path: Path, triton_version: str | None) -> Path:
    """`path`, or `<stem>_triton-VERSION.json` for a build with another Triton."""
    return path.with_stem(f"{path.stem}_triton-{triton_version}") if triton_version else path


def report_main(triton_version: str | None = None) -> int:
    rows = aot.full_report(spills=True)
    rows += aot.full_report(spills=True, specs=aot.block_max_specs())
    print(markdown_table(rows))
    bad = [r for r in rows if not r.ok]
    limits = ", ".join(f"{a} {lim.smem_per_block // 1024} KiB" for a, lim in aot.ARCHS.items())
    print(
        f"\n{len(rows) - len(bad)}/{len(rows)} ok (no spills; shared memory within {limits}; "
        "mma_ratio 1)"
    )
    out = _versioned(OUT, triton_version)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"setup": _setup(), "rows": [r.as_dict() for r in rows]}
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {_rel(out)}")
    if bad:
        for r in bad:
            print("NOT OK:", r, file=sys.stderr)
    return 1 if bad else 0


def compare_markdown(paths: list[str], arch: str = "sm_90a", dtype: str = "bf16") -> str:
    """The attention kernels of committed reports side by side (one column group per
    report, e.g. per Triton version): per (kernel, D, Bs, table) the tile, the mask
    (reports from before it have no field: doc_id), MMA instruction, spill bytes (ptxas
    store/load), shared memory and CTAs per SM."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    keys: dict[tuple, dict[int, dict]] = {}
    for i, rep in enumerate(reports):
        for r in rep["rows"]:
            if r["arch"] == arch and r["dtype"] == dtype and r["kernel"] in aot.ATTN_TILED:
                keys.setdefault((r["head_dim"], r["block_size"], r["kernel"], r["table"]), {})[
                    i
                ] = r
    head = "| D | Bs | kernel | table | tile MxN, warps, stages | mask | "
    head += " | ".join(
        f"Triton {rep['setup']['triton']}: mma / spill B / smem KiB / CTAs/SM" for rep in reports
    )
    lines = [head + " |", "|" + "---|" * (6 + len(reports))]
    for (d, bs, kernel, table), by in sorted(keys.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        t = _tile(next(iter(by.values())))
        cells = []
        for i in range(len(reports)):
            r = by.get(i)
            if r is None:
                cells.append("")
                continue
            spill = "?" if r["spill_stores"] is None else r["spill_stores"] + r["spill_loads"]
            ctas = r["occupancy"]["ctas"] if r.get("occupancy") else "?"
            cells.append(f"{r['mma_instr']} / {spill} / {r['shared'] / 1024:.1f} / {ctas}")
        shape = f"{t.block_m}x{t.block_n}, {t.num_warps}, {t.num_stages}"
        masks = "/".join(sorted({r.get("mask") or "doc_id" for r in by.values()}))
        lines.append(
            f"| {d} | {bs} | {kernel} | {table} | {shape} | {masks} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------ tile sweep


def wgmma_shaped(kernel: str, tile: Tile) -> bool:
    """Whether every warp group gets 64 resident rows: wgmma's M is 64 per warp group,
    and every dot of these kernels has the resident rows as M (fewer rows per group
    means mma.sync, or warp groups that repeat each other's wgmmas)."""
    resident = tile.block_m if RESIDENT[kernel] == "block_m" else tile.block_n
    return resident >= 64 * (tile.num_warps // 4)


def sweep_candidates(
    dtype: str = "bf16",
    kernels: tuple[str, ...] = tuple(aot.ATTN_TILED),
    archs: tuple[str, ...] = tuple(aot.ARCHS),
) -> list[tuple[str, str, int, int, Tile]]:
    """(kernel, dtype, D, Bs, tile) for every swept kernel (SWEPT) and candidate tile;
    block_max reads int8 codes whatever `dtype` is. On sm_90a alone only the
    `wgmma_shaped` tiles."""
    out = []
    for kernel in kernels:
        dt = "i8" if kernel == "block_max" else dtype
        for d, bs in product(SHIPPED_HEAD_DIMS, SHIPPED_BLOCK_SIZES):
            sizes = [s for s in SWEEP_SIZES if bs % s == 0]
            for bm, bn, w, st in product(sizes, sizes, SWEEP_WARPS, SWEEP_STAGES):
                tile = Tile(bm, bn, w, st)
                if archs != ("sm_90a",) or wgmma_shaped(kernel, tile):
                    out.append((kernel, dt, d, bs, tile))
    return out


def _measure(job: tuple[tuple[str, str, int, int, Tile], tuple[str, ...]]) -> list[dict]:
    """One candidate on the given arches (in a worker); a failed compile is recorded, not
    raised."""
    (kernel, dtype, d, bs, tile, *mask), archs = job  # mask: --masks only
    if kernel == "block_max":
        spec = aot.block_max_spec(d, bs, tile)
    else:
        spec = aot.attn_spec(kernel, dtype, d, bs, tile, mask=mask[0] if mask else "doc_id")
    tool = aot.cuobjdump_path()
    rows = []
    for arch in archs:
        try:
            rows.append(aot.report(spec, arch, tool, spills=False).as_dict())
        except Exception as e:  # noqa: BLE001 - one bad candidate must not stop the sweep
            rows.append(
                {"kernel": kernel, "dtype": dtype, "head_dim": d, "block_size": bs, "arch": arch,
                 **tile._asdict(), "mask": spec.mask, "ok": False,
                 "error": f"{type(e).__name__}: {e}"}
            )  # fmt: skip
    return rows


def _tile(r: dict) -> Tile:
    return Tile(r["block_m"], r["block_n"], r["num_warps"], r["num_stages"])


def passing(rows: list[dict]) -> dict[tuple[str, int, int], list[Tile]]:
    """(kernel, D, Bs) -> candidate tiles that are ok (no spills, shared memory within the
    limit, mma_ratio 1, registers read by cuobjdump) on every arch of `rows`."""
    archs = {r["arch"] for r in rows}
    by_tile: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["kernel"], r["head_dim"], r["block_size"], _tile(r))
        by_tile.setdefault(key, {})[r["arch"]] = r
    out: dict[tuple[str, int, int], list[Tile]] = {}
    for (kernel, d, bs, t), by_arch in by_tile.items():
        ok = [by_arch.get(a, {}) for a in archs]
        good = all(r.get("ok") and r.get("source") == "cuobjdump" for r in ok)
        out.setdefault((kernel, d, bs), []).extend([t] if good else [])
    return out


class Sm90a(NamedTuple):
    """What an sm_90a-alone sweep ranks on besides the shape (empty for a joint sweep,
    which picks one tile for both arches): tiles whose dots all issue wgmma, and the
    CTAs per SM of each tile (the fewest over the sweeps combined)."""

    wgmma: frozenset[tuple[str, int, int, Tile]] = frozenset()
    ctas: dict[tuple[str, int, int, Tile], int] = {}


def sm90a_ranks(*sweeps: list[dict]) -> Sm90a:
    """Sm90a of sweeps of sm_90a alone; all of them must agree on wgmma."""
    rows = [r for rows in sweeps for r in rows]
    if {r["arch"] for r in rows} != {"sm_90a"}:
        return Sm90a()
    key = lambda r: (r["kernel"], r["head_dim"], r["block_size"], _tile(r))  # noqa: E731
    not_wgmma = {key(r) for r in rows if r.get("mma_instr") != "wgmma"}
    ctas: dict[tuple, int] = {}
    for r in rows:
        if r.get("occupancy"):
            ctas[key(r)] = min(ctas.get(key(r), 99), r["occupancy"]["ctas"])
    return Sm90a(frozenset(key(r) for r in rows if key(r) not in not_wgmma), ctas)


def pick(
    kernel: str, d: int, bs: int, tiles: list[Tile], sm90a: Sm90a | None = None
) -> Tile | None:
    """PICK_RULE over the passing tiles of one (kernel, D, Bs). None when there are none."""
    sm90a = Sm90a() if sm90a is None else sm90a

    def rank(t: Tile) -> tuple:
        resident = t.block_m if RESIDENT[kernel] == "block_m" else t.block_n
        key = (kernel, d, bs, t)
        return (key in sm90a.wgmma, t.block_m * t.block_n, resident, sm90a.ctas.get(key, 0),
                -t.num_warps, t.num_stages)  # fmt: skip

    return max(tiles, key=rank, default=None)


def table_python(best: dict[tuple[str, int, int], Tile | None]) -> str:
    """A tile table of kernels/attn_tiles.py as Python source, ready to paste."""
    lines = ["{"]
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


def _chosen_table(rows: list[dict], ok: dict, best: dict, archs: tuple[str, ...]) -> str:
    by = {(r["kernel"], r["head_dim"], r["block_size"], _tile(r), r["arch"]): r for r in rows}
    head = "| kernel | D | Bs | tile MxN, warps, stages | passing | "
    head += " | ".join(f"{a}: regs / smem KiB / mma / CTAs/SM" for a in archs) + " |"
    lines = [head, "|" + "---|" * (5 + len(archs))]
    for (kernel, d, bs), t in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        if t is None:
            lines.append(f"| {kernel} | {d} | {bs} | none | 0 |" + " |" * len(archs))
            continue
        cells = []
        for a in archs:
            r = by[(kernel, d, bs, t, a)]
            mma = f"{r['mma_instr']} x{r['mma_ratio']:.3g}"
            cells.append(
                f"{r['regs']} / {r['shared'] / 1024:.1f} / {mma} / {r['occupancy']['ctas']}"
            )
        shape = f"{t.block_m}x{t.block_n}, {t.num_warps}, {t.num_stages}"
        n_ok = len(ok[(kernel, d, bs)])
        lines.append(f"| {kernel} | {d} | {bs} | {shape} | {n_ok} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


_SLIM = {"mma_dots", "spill_stores", "spill_loads", "shared_limit", "dtype"}


def sweep_main(
    jobs: int,
    kernels: tuple[str, ...] = tuple(aot.ATTN_TILED),
    archs: tuple[str, ...] = tuple(aot.ARCHS),
    triton_version: str | None = None,
    and_sweeps: tuple[str, ...] = (),
) -> int:
    cands = sweep_candidates(kernels=kernels, archs=archs)
    t0 = time.perf_counter()
    rows: list[dict] = []
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        work = [(c, archs) for c in cands]
        for i, got in enumerate(pool.map(_measure, work, chunksize=4), 1):
            rows.extend(got)
            if i % 50 == 0:
                print(f"{i}/{len(cands)} candidates, {time.perf_counter() - t0:.0f} s", flush=True)
    wall = time.perf_counter() - t0
    ok = passing(rows)
    others = [json.loads(Path(p).read_text())["rows"] for p in and_sweeps]
    for other in map(passing, others):  # a tile must pass in every sweep
        ok = {key: [t for t in tiles if t in other.get(key, [])] for key, tiles in ok.items()}
    ranks = sm90a_ranks(rows, *others)
    best = {key: pick(*key, tiles, ranks) for key, tiles in ok.items()}
    errors = [r for r in rows if "error" in r]
    print(f"\n{len(cands)} candidates x {len(archs)} arches in {wall:.0f} s ({jobs} workers), "
          f"{len(errors)} failed to compile\nrule: {PICK_RULE}\n")  # fmt: skip
    print(_chosen_table(rows, ok, best, archs) + "\n")
    if set(kernels) & set(aot.ATTN_TILED):
        print(table_python(best))
    if "block_max" in kernels:
        print(block_max_python(best))
    path = SWEEP_OUT
    if set(kernels) != set(aot.ATTN_TILED):  # a partial or block-max sweep has its own file
        path = SWEEP_OUT.with_name(f"kernels_sweep_{'_'.join(kernels)}.json")
    if archs != tuple(aot.ARCHS):
        path = path.with_stem(f"{path.stem}_{'_'.join(archs)}")
    path = _versioned(path, triton_version)
    path.parent.mkdir(parents=True, exist_ok=True)
    out = {
        "setup": {**_setup(), "dtype": ", ".join(sorted({c[1] for c in cands})),
                  "archs": archs, "workers": jobs, "wall_s": round(wall, 1),
                  "and_sweeps": [str(_rel(Path(p).resolve())) for p in and_sweeps]},
        "space": {"sizes": SWEEP_SIZES, "warps": SWEEP_WARPS, "stages": SWEEP_STAGES,
                  "wgmma_shaped_only": archs == ("sm_90a",)},
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


# ------------------------------------------------------------------ mask choice

MASKS_OUT = RESULTS / "kernels_masks.json"
MASK_RULE = (
    "a tiled attention kernel of a table masks by document bounds unless, on an arch the "
    "table runs on (aot.arch_tables) and with any Triton measured, bounds gives fewer CTAs "
    "per SM, more spill bytes (LOCAL + STACK), another MMA instruction, "
    "or fails where the doc-id mask passes"
)


def mask_candidates(dtype: str = "bf16") -> list[tuple[tuple, tuple[str, ...]]]:
    """(kernel, dtype, D, Bs, tile, mask), (arch,) of every tiled attention kernel of
    every table on each arch it runs on (`aot.arch_tables`), with both masks, each
    distinct compile once."""
    out = []
    for arch in aot.ARCHS:
        for table in aot.arch_tables(arch):
            for (d, bs), tiles in aot.TILE_TABLES[table].items():
                for kernel, field_ in aot.ATTN_TILED.items():
                    for mask in MASKS:
                        job = ((kernel, dtype, d, bs, getattr(tiles, field_), mask), (arch,))
                        if job not in out:
                            out.append(job)
    return out


def _spill_bytes(r: dict) -> float:
    return math.inf if r.get("stack") is None else r["stack"] + r["local"]


def bounds_costs(bounds: dict, doc_id: dict) -> bool:
    """Whether one compile of the bounds mask is worse than the doc-id one (MASK_RULE)."""
    if not bounds.get("ok") and doc_id.get("ok"):
        return True
    if _spill_bytes(bounds) > _spill_bytes(doc_id) or bounds.get("mma_instr") != doc_id.get(
        "mma_instr"
    ):
        return True
    return (bounds.get("occupancy") or {}).get("ctas", 0) < (doc_id.get("occupancy") or {}).get(
        "ctas", 0
    )


def doc_id_configs(*reports: list[dict]) -> set[tuple[str, str, int, int]]:
    """(table, kernel field, D, Bs) that keep the doc-id mask: MASK_RULE over the rows of
    one or more --masks runs (e.g. one per Triton)."""
    out = set()
    for rows in reports:
        by = {(r["arch"], r["kernel"], r["head_dim"], r["block_size"], _tile(r), r["mask"]): r
              for r in rows}  # fmt: skip
        for arch in aot.ARCHS:
            for table in aot.arch_tables(arch):
                for (d, bs), tiles in aot.TILE_TABLES[table].items():
                    for kernel, field_ in aot.ATTN_TILED.items():
                        key = (arch, kernel, d, bs, getattr(tiles, field_))
                        if bounds_costs(by[(*key, "bounds")], by[(*key, "doc_id")]):
                            out.add((table, field_, d, bs))
    return out


def _mask_cell(r: dict) -> str:
    ctas = (r.get("occupancy") or {}).get("ctas", "?")
    return f"{r.get('regs')} / {r.get('stack')} / {ctas}"


def masks_markdown(
    reports: list[list[dict]], labels: list[str], doc_id: set[tuple[str, str, int, int]]
) -> str:
    """Per arch and distinct (kernel, D, Bs, tile): the tables that run it, then per
    report (e.g. per Triton) regs / STACK B / CTAs per SM with the doc-id mask -> with
    bounds, and the mask each table ships ("doc_id" in bold)."""
    bys = [
        {(r["arch"], r["kernel"], r["head_dim"], r["block_size"], _tile(r), r["mask"]): r
         for r in rows}
        for rows in reports
    ]  # fmt: skip
    users: dict[tuple, list[str]] = {}
    for arch in aot.ARCHS:
        for table in aot.arch_tables(arch):
            for (d, bs), tiles in aot.TILE_TABLES[table].items():
                for kernel, field_ in aot.ATTN_TILED.items():
                    key = (arch, d, bs, kernel, getattr(tiles, field_))
                    ships = "**doc_id**" if (table, field_, d, bs) in doc_id else "bounds"
                    users.setdefault(key, []).append(f"{table}: {ships}")
    cols = " | ".join(f"{x}: doc_id -> bounds, regs / STACK B / CTAs/SM" for x in labels)
    lines = [f"| arch | D | Bs | kernel | tile MxN, warps, stages | {cols} | ships |"]
    lines.append("|" + "---|" * (6 + len(labels)))
    for (arch, d, bs, kernel, t), tables in users.items():
        cells = [
            f"{_mask_cell(by[(arch, kernel, d, bs, t, 'doc_id')])} -> "
            f"{_mask_cell(by[(arch, kernel, d, bs, t, 'bounds')])}"
            for by in bys
        ]
        shape = f"{t.block_m}x{t.block_n}, {t.num_warps}, {t.num_stages}"
        lines.append(
            f"| {arch} | {d} | {bs} | {kernel} | {shape} | {' | '.join(cells)} | "
            f"{', '.join(tables)} |"
        )
    return "\n".join(lines)


def masks_main(
    jobs: int, triton_version: str | None = None, and_masks: tuple[str, ...] = ()
) -> int:
    work = mask_candidates()
    t0 = time.perf_counter()
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        rows = [r for got in pool.map(_measure, work) for r in got]
    wall = time.perf_counter() - t0
    others = [json.loads(Path(p).read_text())["rows"] for p in and_masks]
    doc_id = doc_id_configs(rows, *others)
    print(f"{len(work)} compiles in {wall:.0f} s ({jobs} workers)\nrule: {MASK_RULE}\n")
    labels = [f"Triton {triton.__version__}"]
    labels += [f"Triton {json.loads(Path(p).read_text())['setup']['triton']}" for p in and_masks]
    print(masks_markdown([rows, *others], labels, doc_id) + "\n")
    print("DOC_ID_MASK: frozenset[tuple[str, str, int, int]] = frozenset(")
    print("    {" + "".join(f"\n        {k}," for k in sorted(doc_id)) + "\n    }\n)")
    path = _versioned(MASKS_OUT, triton_version)
    out = {
        "setup": {**_setup(), "dtype": "bf16", "workers": jobs, "wall_s": round(wall, 1),
                  "and_masks": [str(_rel(Path(p).resolve())) for p in and_masks]},
        "rule": MASK_RULE,
        "doc_id": sorted(doc_id),
        "rows": "ROWS",
    }  # fmt: skip
    lines = ",\n".join(json.dumps({k: v for k, v in r.items() if k not in _SLIM}) for r in rows)
    path.write_text(json.dumps(out, indent=1).replace('"ROWS"', "[\n" + lines + "\n ]") + "\n")
    print(f"\nwrote {_rel(path)}")
    return 0


# ------------------------------------------------------------------ another Triton


def _side_install(version: str) -> Path:
    """A scratch folder holding Triton `version` alone (pip --target, no dependencies),
    made on first use; nothing else is touched."""
    site = Path(f"/tmp/triton-{version}")
    if not (site / "triton" / "__init__.py").is_file():
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site),
               f"triton=={version}"]  # fmt: skip
        print("installing:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return site


def rerun_with_triton(version: str, python: str | None, argv: list[str]) -> int:
    """This script again under Triton `version`: with `python` when given, else with
    this interpreter and the side install first on PYTHONPATH."""
    env = dict(os.environ)
    if python is None:
        python = sys.executable
        site = str(_side_install(version))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    cmd = [python, str(Path(__file__).resolve()), *argv]
    print("running:", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="sweep candidate tiles")
    parser.add_argument("--jobs", type=int, default=2, help="sweep worker processes")
    parser.add_argument(
        "--kernels",
        default=",".join(aot.ATTN_TILED),
        help=f"kernels to sweep (comma list of {', '.join(SWEPT)})",
    )
    parser.add_argument(
        "--arch",
        default=",".join(aot.ARCHS),
        help="arches a swept tile must pass on (comma list; one arch: its own table)",
    )
    parser.add_argument(
        "--and-sweep",
        action="append",
        default=[],
        help="with --sweep: another sweep's JSON (e.g. another Triton's) a tile must pass in "
        "too; with --masks: another --masks JSON the bounds mask must cost nothing in too",
    )
    parser.add_argument(
        "--masks",
        action="store_true",
        help="compile every table's tiled attention kernels with both masks (bf16) and pick "
        "each one's (-> kernels_masks.json)",
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        metavar="REPORT",
        help="print the sm_90a attention rows of these report JSONs side by side (no compiling)",
    )
    parser.add_argument("--triton", help="build with this Triton version (see the docstring)")
    parser.add_argument("--python", help="with --triton: an interpreter that has that Triton")
    args = parser.parse_args()
    if args.compare:
        print(compare_markdown(args.compare))
        return 0
    if args.triton and args.triton != triton.__version__:
        argv = [a for a in sys.argv[1:] if a not in ("--python", args.python)]
        return rerun_with_triton(args.triton, args.python, argv)
    # explicit, as Triton 3.10 asks; also part of Triton's cache key, and the test's AOT
    # child sets the same value, so the two share compiled kernels
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    kernels = tuple(args.kernels.split(","))
    if unknown := set(kernels) - set(SWEPT):
        parser.error(f"unknown kernels {sorted(unknown)}; expected some of {SWEPT}")
    archs = tuple(args.arch.split(","))
    if unknown := set(archs) - set(aot.ARCHS):
        parser.error(f"unknown arches {sorted(unknown)}; expected some of {tuple(aot.ARCHS)}")
    if args.masks:
        return masks_main(args.jobs, args.triton, tuple(args.and_sweep))
    if args.sweep:
        return sweep_main(args.jobs, kernels, archs, args.triton, tuple(args.and_sweep))
    return report_main(args.triton)


if __name__ == "__main__":
    sys.exit(main())
