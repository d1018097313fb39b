"""AOT resource report of the Triton kernels: registers, shared memory, spills.

Compiles every shipped config (bf16/fp16 x head_dim 64/128 x block 64/128) of every
kernel for sm_80 and sm_90a on this machine, no GPU needed (kernels/aot.py), and reads
registers / STACK / LOCAL with `cuobjdump -res-usage`, spill bytes with `ptxas -v`, and
dynamic shared memory from Triton's metadata. Fails (exit 1) if any config spills or
exceeds the arch's shared-memory limit.

    python bench/kernels_report.py   ->  bench/results/kernels_report.json
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import triton
from sb_titan_kernels import aot

OUT = Path(__file__).resolve().parent / "results" / "kernels_report.json"


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
    return f"{r.regs} / {r.shared / 1024:.1f} / {spills}"


def markdown_table(rows: list[aot.ResUsage]) -> str:
    """One line per kernel x config; per arch: regs / shared KiB / spill store/load bytes."""
    archs = list(aot.ARCHS)
    by_key: dict[tuple, dict[str, aot.ResUsage]] = {}
    for r in rows:
        by_key.setdefault((r.kernel, r.dtype, r.head_dim, r.block_size), {})[r.arch] = r
    head = "| kernel | dtype | D | Bs | tile MxN, warps, stages | "
    head += " | ".join(f"{a}: regs / smem KiB / spill B" for a in archs) + " |"
    lines = [head, "|" + "---|" * (5 + len(archs))]
    for (kernel, dtype, d, bs), per_arch in by_key.items():
        r0 = next(iter(per_arch.values()))
        shape = f"{r0.block_m}x{r0.block_n}" if r0.block_n else f"{r0.block_m} rows"
        tile = f"{shape}, {r0.num_warps}, {r0.num_stages}"
        cells = " | ".join(_cell(per_arch[a]) for a in archs)
        lines.append(f"| {kernel} | {dtype} | {d} | {bs} | {tile} | {cells} |")
    return "\n".join(lines)


def main() -> int:
    # explicit, as Triton 3.10 asks; also part of Triton's cache key, and the test's AOT
    # child sets the same value, so the two share compiled kernels
    os.environ["TRITON_DEFAULT_FP_FUSION"] = "1"
    rows = aot.full_report(spills=True)
    print(markdown_table(rows))
    bad = [r for r in rows if not r.ok]
    limits = ", ".join(f"{a} {lim // 1024} KiB" for a, (_, lim) in aot.ARCHS.items())
    print(f"\n{len(rows) - len(bad)}/{len(rows)} ok (no spills; shared memory within {limits})")
    cuobjdump = aot.cuobjdump_path()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "setup": {
            "triton": triton.__version__,
            "cuobjdump": _tool_version(cuobjdump),
            "ptxas": _ptxas_versions(),
            "python": platform.python_version(),
            "fp_fusion": True,
            "signature": "16-byte aligned pointers; strides and seq_len divisible by 16",
            "shared_limit_bytes": {a: lim for a, (_, lim) in aot.ARCHS.items()},
        },
        "rows": [r.as_dict() for r in rows],
    }
    OUT.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(Path.cwd()) if OUT.is_relative_to(Path.cwd()) else OUT}")
    if bad:
        for r in bad:
            print("NOT OK:", r, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
