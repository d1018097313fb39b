"""Ahead-of-time compilation of every shipped kernel config, no GPU needed.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", cap, 32))` runs the whole
pipeline down to a cubin on a CPU-only machine; `cuobjdump -res-usage` on that cubin
gives registers, STACK and LOCAL bytes. Register spills of these call-free kernels land
in the stack frame, not in LOCAL, so zero spills means LOCAL:0 and STACK:0; the PTX is
also re-assembled with Triton's own ptxas `-v` for its explicit spill-store/load counts.
Triton allocates shared memory dynamically, so the cubin's static SHARED is 0; the real
figure is the compiled kernel's `metadata.shared`, which is what the launcher requests.

The MMA check counts the tensor-core instructions of each loop in the PTX (per thread,
so a wgmma runs once per warp group and an mma.sync once per warp) and compares the
multiply-adds a program executes per iteration with what the tile needs (MMA_LOOPS).
Warps that share a tile without splitting it (8 warps laid along M on a 64-row tile of
chained dots) issue the same MMAs twice, which shows up as mma_ratio > 1.

The signatures mirror what a training launch specialises on: 16-byte aligned pointers,
strides and sequence length divisible by 16 (L a multiple of the block size), other
scalars unspecialised, `DOT_F32=False`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import attn_bwd_dkdv, attn_bwd_dq, attn_fwd
from . import block_max as bmx
from . import estimator as est
from .attn_common import SCAN
from .attn_tiles import REDUCE_TILE, TILE_TABLES, attn_tiles, table_mask
from .common import (
    FP_FUSION,
    SHIPPED_BLOCK_SIZES,
    SHIPPED_DTYPES,
    SHIPPED_HEAD_DIMS,
    TRITON_DTYPE_NAMES,
    Tile,
    launch_opts,
)


class Arch(NamedTuple):
    """A compile target and the per-SM limits that set how many CTAs fit on one SM
    (CUDA's occupancy rules for compute capability 8.0 / 9.0)."""

    cap: int  # compute capability as Triton's GPUTarget takes it (90 -> sm_90a)
    smem_per_block: int  # max dynamic shared memory of one CTA, bytes
    smem_per_sm: int  # shared memory of one SM at the largest carve-out, bytes
    regs_per_sm: int = 65536
    max_ctas: int = 32
    max_warps: int = 64


#: the two targets: A100 (sm_80) and H100 (sm_90a)
ARCHS: dict[str, Arch] = {
    "sm_80": Arch(80, 163 * 1024, 164 * 1024),
    "sm_90a": Arch(90, 227 * 1024, 228 * 1024),
}
#: CUDA reserves 1 KiB of shared memory per CTA (compute capability >= 8.0)
SMEM_RESERVED = 1024
#: registers go to warps in units of 256 (8 per thread), from the register file of one
#: of the SM's 4 sub-partitions
REG_UNIT, SUB_PARTITIONS = 256, 4


def ctas_per_sm(arch: str, regs: int, shared: int, num_warps: int) -> dict[str, int]:
    """CTAs of one kernel resident on an SM, as CUDA's occupancy calculator counts them:
    per limit (registers, shared memory, warps, CTA slots) and the minimum (`ctas`)."""
    a = ARCHS[arch]
    per_warp = -(-regs * 32 // REG_UNIT) * REG_UNIT
    warps_by_regs = a.regs_per_sm // SUB_PARTITIONS // per_warp * SUB_PARTITIONS
    smem = -(-(shared + SMEM_RESERVED) // 128) * 128
    limits = {
        "regs": warps_by_regs // num_warps,
        "smem": a.smem_per_sm // smem,
        "warps": a.max_warps // num_warps,
        "slots": a.max_ctas,
    }
    return {"ctas": min(limits.values()), **limits}


_INT_PTRS = {"DOC", "DOC_START", "DOC_END", "KV_INDEX", "Q_INDEX", "ORDER"}
_I64_PTRS = {"KV_PTR", "Q_PTR", "ITEMS", "SPLITS"}
_F32_PTRS = {"LSE", "DELTA", "QP", "KP", "PROB", "DK_PART", "DV_PART", "QS", "KS", "SCORE"}
_F32_SCALARS = {"qk_scale", "sm_scale"}
_ALIGNED_SCALARS = {"seq_len"}


@dataclass(frozen=True)
class KernelSpec:
    """One kernel at one shipped config: what triton.compile needs, plus labels."""

    kernel: str
    fn: object  # triton JITFunction
    dtype: str
    head_dim: int
    block_size: int
    tile: Tile
    constexprs: dict[str, object]
    table: str = ""  # the attention tile table it comes from ("" for the others)
    mask: str = ""  # a tiled attention kernel's partial-tile mask: "bounds" | "doc_id"


@dataclass
class ResUsage:
    """Resource use of one compiled kernel on one arch."""

    kernel: str
    dtype: str
    head_dim: int
    block_size: int
    arch: str
    table: str
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    regs: int | None
    shared: int
    shared_limit: int
    local: int | None
    stack: int | None
    spill_stores: int | None
    spill_loads: int | None
    source: str  # "cuobjdump" or "metadata" (no cuobjdump found: regs/LOCAL unknown)
    # tensor-core work executed / needed per loop iteration (None: the kernel has no
    # dots); 1.0 = every multiply-add once, 2.0 = all of it done twice
    mma_ratio: float | None = None
    mma_loops: list[list[int]] = field(default_factory=list)  # [executed, needed] per loop
    mma_dots: list[dict] = field(default_factory=list)  # per dot: instructions and ratio
    mask: str = ""  # the tiled attention kernels' partial-tile mask: "bounds" | "doc_id"

    @property
    def spill_free(self) -> bool:
        no_spill = (self.local, self.stack, self.spill_stores, self.spill_loads)
        return all(x in (0, None) for x in no_spill)

    @property
    def mma_exact(self) -> bool:
        """No tensor-core work is duplicated (or wasted on padding) per loop iteration."""
        return self.mma_ratio in (None, 1.0)

    @property
    def ok(self) -> bool:
        return self.shared <= self.shared_limit and self.spill_free and self.mma_exact

    @property
    def mma_count(self) -> dict[str, int]:
        """Tensor-core instructions in the PTX by kind ("wgmma" / "mma.sync")."""
        out: dict[str, int] = {}
        for d in self.mma_dots:
            kind = d["instr"].split()[0]
            out[kind] = out.get(kind, 0) + d["count"]
        return out

    @property
    def mma_instr(self) -> str | None:
        """The MMA instruction every dot uses ("wgmma", "mma.sync", or "mixed"); None
        for a kernel without dots."""
        kinds = set(self.mma_count)
        return None if not kinds else kinds.pop() if len(kinds) == 1 else "mixed"

    @property
    def occupancy(self) -> dict[str, int] | None:
        """CTAs per SM (`ctas_per_sm`); None without a register count."""
        if self.regs is None:
            return None
        return ctas_per_sm(self.arch, self.regs, self.shared, self.num_warps)

    def as_dict(self) -> dict:
        extra = {"spill_free": self.spill_free, "mma_exact": self.mma_exact, "ok": self.ok}
        extra |= {"mma_count": self.mma_count, "mma_instr": self.mma_instr}
        return {**asdict(self), **extra, "occupancy": self.occupancy}


def _signature(fn, dtype: str, constexprs: dict[str, object]) -> tuple[dict, dict]:
    sig: dict[str, str] = {}
    attrs: dict[tuple[int], list] = {}
    aligned = [["tt.divisibility", 16]]
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.isupper():
            kinds = (("i32", _INT_PTRS), ("i64", _I64_PTRS), ("fp32", _F32_PTRS))
            kind = next((k for k, names in kinds if name in names), dtype)
            sig[name] = "*" + kind
            attrs[(i,)] = aligned
        elif name in _F32_SCALARS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("stride_") or name in _ALIGNED_SCALARS:
                attrs[(i,)] = aligned
    return sig, attrs


#: attention kernels with a BLOCK_M x BLOCK_N tile: report name -> AttnTiles field
ATTN_TILED: dict[str, str] = {"fwd": "fwd", "bwd_dq": "dq", "bwd_dkdv": "dkdv"}


def attn_spec(
    kernel: str,
    dtype: str,
    head_dim: int,
    block_size: int,
    tile: Tile,
    table: str = "",
    mask: str = "doc_id",
) -> KernelSpec:
    """A tiled attention kernel (a key of ATTN_TILED) at any tile and mask, for a table or
    a sweep (the committed sweeps compiled the doc-id mask, the default)."""
    fn = {
        "fwd": attn_fwd._fwd_kernel,
        "bwd_dq": attn_bwd_dq._bwd_dq_kernel,
        "bwd_dkdv": attn_bwd_dkdv._bwd_dkdv_kernel,
    }
    ce = dict(HEAD_DIM=head_dim, BLOCK_SIZE=block_size, DOT_F32=False, SCAN=SCAN)
    ce.update(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BOUNDS_MASK=mask == "bounds")
    return KernelSpec(kernel, fn[kernel], dtype, head_dim, block_size, tile, ce, table, mask)


def arch_tables(arch: str) -> list[str]:
    """The attention tile tables that run on `arch`: its own (a launch's default there),
    "common" (SB_TRITON_TILES=common) where that one differs, and its alternatives
    (`<arch>_<variant>`, e.g. sm_90a_mma_sync)."""
    common = ["common"] if TILE_TABLES["common"] != TILE_TABLES[arch] else []
    return [arch, *common, *(t for t in TILE_TABLES if t.startswith(f"{arch}_"))]


def shipped_specs(table: str, estimator: bool = True) -> Iterator[KernelSpec]:
    """Every kernel at every shipped (dtype, head_dim, block size), attention kernels
    from tile table `table`; the estimator's (one table of its own) if `estimator`."""
    for torch_dtype in SHIPPED_DTYPES:
        dt = TRITON_DTYPE_NAMES[torch_dtype]
        for d in SHIPPED_HEAD_DIMS:
            for bs in SHIPPED_BLOCK_SIZES:
                tiles = attn_tiles(torch_dtype, d, bs, table)
                for name, which in ATTN_TILED.items():
                    mask = table_mask(table, which, d, bs)
                    yield attn_spec(name, dt, d, bs, getattr(tiles, which), table, mask)
                ce = dict(HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_N=tiles.dkdv.block_n)
                t = REDUCE_TILE._replace(block_n=tiles.dkdv.block_n)
                yield KernelSpec(
                    "bwd_dkdv_reduce", attn_bwd_dkdv._dkdv_reduce_kernel, dt, d, bs, t, ce, table
                )
                t = tiles.preprocess
                ce = dict(HEAD_DIM=d, BLOCK_M=t.block_m)
                yield KernelSpec(
                    "bwd_preprocess", attn_bwd_dq._bwd_preprocess_kernel, dt, d, bs, t, ce, table
                )
                if not estimator:
                    continue
                et = est.est_tiles(torch_dtype, d, bs)
                ce = dict(HEAD_DIM=d, BLOCK_SIZE=bs, CHUNK=et.pool.block_m)
                yield KernelSpec("est_pool", est._pool_kernel, dt, d, bs, et.pool, ce)
                ce = dict(HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_I=et.probs.block_m)
                ce["BLOCK_J"] = et.probs.block_n
                yield KernelSpec("est_probs", est._probs_kernel, dt, d, bs, et.probs, ce)


def block_max_spec(head_dim: int, block_size: int, tile: Tile) -> KernelSpec:
    """The `int4_max` block-max kernel at any tile. Its codes are int8 whatever the
    model's dtype, so it has one config per shape (dtype "i8")."""
    ce = dict(HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=tile.block_m)
    ce["BLOCK_N"] = tile.block_n
    return KernelSpec("block_max", bmx._block_max_kernel, "i8", head_dim, block_size, tile, ce)


def block_max_specs() -> Iterator[KernelSpec]:
    """The block-max kernel at every shipped (head_dim, block size), from its tile table.
    Kept apart from shipped_specs (one row per dtype there, none here): the report
    compiles both, tests/test_block_max_kernel.py checks these."""
    for d in SHIPPED_HEAD_DIMS:
        for bs in SHIPPED_BLOCK_SIZES:
            yield block_max_spec(d, bs, bmx.block_max_tile(d, bs))


def compile_spec(spec: KernelSpec, arch: str):
    """triton.compile for one arch; returns Triton's CompiledKernel (cached on disk)."""
    cap = ARCHS[arch].cap
    sig, attrs = _signature(spec.fn, spec.dtype, spec.constexprs)
    src = ASTSource(spec.fn, sig, spec.constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", cap, 32), options=launch_opts(spec.tile))


def cuobjdump_path() -> str | None:
    """Triton's bundled cuobjdump (or TRITON_CUOBJDUMP_PATH), else one on PATH."""
    try:
        path = triton.knobs.nvidia.cuobjdump.path
        if path and os.path.exists(path):
            return path
    except (AttributeError, RuntimeError, FileNotFoundError):
        pass
    return shutil.which("cuobjdump")


_RES_RE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def res_usage(cubin: bytes, tool: str) -> tuple[int, int, int, int]:
    """(regs, stack, static shared, local) of the single kernel in a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "-res-usage", f.name], check=True, capture_output=True, text=True
        ).stdout
    m = _RES_RE.search(text)
    if m is None:
        raise RuntimeError(f"unexpected cuobjdump output:\n{text}")
    regs, stack, shared, local = (int(x) for x in m.groups())
    return regs, stack, shared, local


_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_spills(ptx: str, arch: str) -> tuple[int, int] | None:
    """(spill store, spill load) bytes from `ptxas -v`, with the ptxas Triton uses."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(ARCHS[arch].cap).path
    except (ImportError, AttributeError, RuntimeError, FileNotFoundError):
        return None
    fmad = [] if FP_FUSION else ["--fmad=false"]
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-v", "-lineinfo", *fmad, "--regAllocOptLevel=2", f"--gpu-name={arch}"]
        log = subprocess.run(
            [*cmd, src, "-o", os.path.join(tmp, "k.o")], check=True, capture_output=True, text=True
        )
    m = _SPILL_RE.search(log.stdout + log.stderr)
    return (int(m.group(1)), int(m.group(2))) if m else None


#: Tensor-core work each loop of a kernel must do per iteration, for the MMA-volume
#: check: one entry per loop that runs `tl.dot`s (in program order), as (dots per
#: iteration, MMA passes per dot). Every dot of these kernels is a BLOCK_M x BLOCK_N x
#: HEAD_DIM product in some order, so a loop needs dots * passes * BM * BN * D
#: multiply-adds per iteration. Keep this in step with the kernel bodies.
MMA_LOOPS: dict[str, tuple[tuple[int, int], ...]] = {
    "fwd": ((2, 1),),  # Q K^T, P V
    "bwd_dq": ((3, 1),),  # Q K^T, dO V^T, dS K
    "bwd_dkdv": ((4, 1),),  # K Q^T, P^T dO, V dO^T, dS^T Q
    # pass 1 (max/sum) and pass 2 (write) each score BLOCK_I x BLOCK_J pooled blocks;
    # tf32x3 runs every dot as 3 tf32 MMAs (hi*hi, hi*lo, lo*hi)
    "est_probs": ((1, 3), (1, 3)),
    # the loop over the G q heads: one int8 BLOCK_M x BLOCK_N x D dot (int32) per head
    "block_max": ((1, 1),),
}


def mma_needed(kernel: str, block_m: int, block_n: int, head_dim: int) -> tuple[int, ...]:
    """Multiply-adds per iteration of each dot-running loop, from the tile shape alone."""
    loops = MMA_LOOPS.get(kernel, ())
    return tuple(dots * passes * block_m * block_n * head_dim for dots, passes in loops)


_MMA_RE = re.compile(
    r"\b(wgmma\.mma_async|mma)\.sync\.aligned\.m(\d+)n(\d+)k(\d+)\S*\s+\{[^}]*\},\s*(\{)?"
)
_LABEL_RE = re.compile(r"^(\$L__BB\d+_\d+):")
_BRA_RE = re.compile(r"^(@!?%p\d+\s+)?bra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
_LOC_RE = re.compile(r"^\.loc\s+(.*?)\s*//\s*(\S+)")
_INLINED_RE = re.compile(r"inlined_at \d+ (\d+)")


@dataclass
class _Block:
    label: str
    succ: list[str]
    mmas: list[tuple[str, int, int, int, str, str]]  # kind, m, n, k, A operand, source


def _ptx_blocks(ptx: str) -> list[_Block]:
    """Basic blocks of the (single) kernel in a PTX module, with their MMA instructions.

    A block starts at a label and after every branch or return (LLVM leaves blocks that
    are only reached by fall-through unlabelled, e.g. code after a loop's back edge).
    """
    lines = ptx.split("\n")
    start = next(i for i, s in enumerate(lines) if ".entry" in s)
    blocks = [_Block("entry", [], [])]
    falls = True  # the current block falls through to the next one

    def new_block(label: str) -> None:
        if falls:
            blocks[-1].succ.append(label)
        blocks.append(_Block(label, [], []))

    loc = "?"
    for raw in lines[start:]:
        s = raw.strip()
        if m := _LABEL_RE.match(s):
            new_block(m.group(1))
            falls = True
        elif m := _BRA_RE.match(s):
            blocks[-1].succ.append(m.group(2))
            falls = m.group(1) is not None  # a predicated branch may fall through
            new_block(f"fall{len(blocks)}")
            falls = True
        elif s.startswith(("ret;", "exit;")):
            falls = False
            new_block(f"fall{len(blocks)}")
            falls = True
        elif m := _LOC_RE.match(s):
            file_line = m.group(2).rsplit(":", 1)[0]
            inl = _INLINED_RE.search(m.group(1))
            loc = file_line + (f"@{inl.group(1)}" if inl else "")
        elif m := _MMA_RE.search(s):
            kind = "wgmma" if m.group(1).startswith("wgmma") else "mma.sync"
            a_op = ("RS" if m.group(5) else "SS") if kind == "wgmma" else "R"
            mnk = (int(m.group(2)), int(m.group(3)), int(m.group(4)))
            blocks[-1].mmas.append((kind, *mnk, a_op, loc))
    return blocks


def _innermost_loops(blocks: list[_Block]) -> dict[str, str | None]:
    """Block label -> header of the innermost natural loop containing it (None: no loop)."""
    labels = {b.label for b in blocks}
    edges = {b.label: [s for s in b.succ if s in labels] for b in blocks}
    # only blocks reachable from the entry: an empty block after an unconditional
    # branch (no predecessors) would otherwise empty its successor's dominator set
    reach, stack = {blocks[0].label}, [blocks[0].label]
    while stack:
        for s in edges[stack.pop()]:
            if s not in reach:
                reach.add(s)
                stack.append(s)
    names = [b.label for b in blocks if b.label in reach]
    succ = {n: edges[n] for n in names}
    pred: dict[str, set[str]] = {n: set() for n in names}
    for n, ss in succ.items():
        for s in ss:
            pred[s].add(n)
    dom = {n: set(names) for n in names}
    dom[names[0]] = {names[0]}
    changed = True
    while changed:
        changed = False
        for n in names[1:]:
            ps = [dom[p] for p in pred[n]]
            new = {n} | (set.intersection(*ps) if ps else set())
            if new != dom[n]:
                dom[n], changed = new, True
    bodies: dict[str, set[str]] = {}
    for tail in names:
        for head in succ[tail]:
            if head in dom[tail]:  # back edge tail -> head
                body, stack = {head, tail}, [tail] if tail != head else []
                while stack:
                    for p in pred[stack.pop()]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                bodies.setdefault(head, set()).update(body)
    inner: dict[str, str | None] = {}
    for n in names:
        holding = [h for h, body in bodies.items() if n in body]
        inner[n] = min(holding, key=lambda h: len(bodies[h])) if holding else None
    return inner


@dataclass
class MmaCount:
    """MMA volume one program executes, per dot-running loop, read from the PTX."""

    loops: list[int]  # multiply-adds per iteration of each loop with MMAs, program order
    outside: int  # multiply-adds of MMAs outside any loop (e.g. pipeliner-peeled copies)
    dots: list[dict]  # per (loop index, source line): instruction, operand, count, volume


def count_mma(ptx: str, num_warps: int) -> MmaCount:
    """Per-program MMA volume from PTX: a wgmma runs once per warpgroup (num_warps / 4 per
    program), an mma.sync once per warp; each loop's body is counted once, so the figure
    is per iteration."""
    blocks = _ptx_blocks(ptx)
    inner = _innermost_loops(blocks)
    order = [b.label for b in blocks]
    per_loop: dict[str, int] = {}
    outside = 0
    dots: dict[tuple, dict] = {}
    for b in blocks:
        for kind, m, n, k, a_op, src in b.mmas:
            vol = m * n * k * (num_warps // 4 if kind == "wgmma" else num_warps)
            head = inner.get(b.label)  # None: no loop, or unreachable
            if head is None:
                outside += vol
            else:
                per_loop[head] = per_loop.get(head, 0) + vol
            shape = f"{kind} m{m}n{n}k{k} {a_op}"
            d = dots.setdefault((head, src, shape), {"loop": head, "src": src, "instr": shape})
            d["count"] = d.get("count", 0) + 1
            d["volume"] = d.get("volume", 0) + vol
    heads = sorted(per_loop, key=order.index)
    for d in dots.values():  # loop header label -> position in `loops`
        d["loop"] = None if d["loop"] is None else heads.index(d["loop"])
    return MmaCount([per_loop[h] for h in heads], outside, list(dots.values()))


def mma_check(spec: KernelSpec, ptx: str) -> dict:
    """ResUsage's mma_* fields: the PTX's MMA volume per loop iteration against the tile's.

    Raises when the loops that run MMAs do not match MMA_LOOPS (a kernel body changed:
    update the table), rather than compare the wrong figures.
    """
    t = spec.tile
    needed = mma_needed(spec.kernel, t.block_m, t.block_n, spec.head_dim)
    got = count_mma(ptx, t.num_warps)
    if len(got.loops) != len(needed) or got.outside:
        raise ValueError(
            f"{spec.kernel} {t}: the PTX runs MMAs in {len(got.loops)} loop(s) (+{got.outside} "
            f"multiply-adds outside loops), aot.MMA_LOOPS expects {len(needed)} loop(s)"
        )
    if not needed:
        return {}
    passes = [p for _, p in MMA_LOOPS[spec.kernel]]
    unit = t.block_m * t.block_n * spec.head_dim
    dots = [
        {"src": d["src"], "instr": d["instr"], "count": d["count"],
         "ratio": d["volume"] / (unit * passes[d["loop"]])}
        for d in got.dots
    ]  # fmt: skip
    return dict(
        mma_ratio=sum(got.loops) / sum(needed),
        mma_loops=[[e, n] for e, n in zip(got.loops, needed, strict=True)],
        mma_dots=dots,
    )


def report(spec: KernelSpec, arch: str, tool: str | None, spills: bool = True) -> ResUsage:
    """Compile one spec for one arch and measure it (`spills`: also run `ptxas -v`)."""
    compiled = compile_spec(spec, arch)
    shared = int(compiled.metadata.shared)
    regs = stack = local = None
    if tool is not None:
        regs, stack, static_shared, local = res_usage(compiled.asm["cubin"], tool)
        shared += static_shared
    counts = (ptxas_spills(compiled.asm["ptx"], arch) if spills else None) or (None, None)
    t = spec.tile
    mma = mma_check(spec, compiled.asm["ptx"])
    return ResUsage(
        kernel=spec.kernel,
        dtype=spec.dtype,
        head_dim=spec.head_dim,
        block_size=spec.block_size,
        arch=arch,
        table=spec.table,
        block_m=t.block_m,
        block_n=t.block_n,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
        regs=regs,
        shared=shared,
        shared_limit=ARCHS[arch].smem_per_block,
        local=local,
        stack=stack,
        spill_stores=counts[0],
        spill_loads=counts[1],
        source="cuobjdump" if tool else "metadata",
        **mma,
        mask=spec.mask,
    )


def full_report(
    archs: tuple[str, ...] = tuple(ARCHS),
    spills: bool = True,
    specs: Iterable[KernelSpec] | None = None,
) -> list[ResUsage]:
    """`specs` on every arch; by default the attention kernels of every tile table that
    runs on an arch (`arch_tables`) and the estimator's, on that arch."""
    tool = cuobjdump_path()
    if specs is None:
        jobs = [
            (s, a)
            for a in archs
            for i, t in enumerate(arch_tables(a))
            for s in shipped_specs(t, estimator=i == 0)
        ]
    else:
        jobs = [(s, a) for s in specs for a in archs]
    return [report(spec, arch, tool, spills) for spec, arch in jobs]
