"""Ahead-of-time compilation of every shipped kernel config, no GPU needed.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", cap, 32))` runs the whole
pipeline down to a cubin on a CPU-only machine; `cuobjdump -res-usage` on that cubin
gives registers, STACK and LOCAL bytes. Register spills of these call-free kernels land
in the stack frame, not in LOCAL, so zero spills means LOCAL:0 and STACK:0; the PTX is
also re-assembled with Triton's own ptxas `-v` for its explicit spill-store/load counts.
Triton allocates shared memory dynamically, so the cubin's static SHARED is 0; the real
figure is the compiled kernel's `metadata.shared`, which is what the launcher requests.

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
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import block_sparse_attn as bsa
from . import estimator as est
from .common import (
    FP_FUSION,
    SHIPPED_BLOCK_SIZES,
    SHIPPED_DTYPES,
    SHIPPED_HEAD_DIMS,
    TRITON_DTYPE_NAMES,
    Tile,
    launch_opts,
)

#: arch name -> (compute capability, max dynamic shared memory per block in bytes)
ARCHS: dict[str, tuple[int, int]] = {"sm_80": (80, 163 * 1024), "sm_90a": (90, 227 * 1024)}

_INT_PTRS = {"DOC", "DOC_START", "DOC_END", "KV_INDEX", "Q_INDEX", "ORDER"}
_I64_PTRS = {"KV_PTR", "Q_PTR", "ITEMS", "SPLITS"}
_F32_PTRS = {"LSE", "DELTA", "QP", "KP", "PROB", "DK_PART", "DV_PART"}
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


@dataclass
class ResUsage:
    """Resource use of one compiled kernel on one arch."""

    kernel: str
    dtype: str
    head_dim: int
    block_size: int
    arch: str
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

    @property
    def ok(self) -> bool:
        no_spill = (self.local, self.stack, self.spill_stores, self.spill_loads)
        return self.shared <= self.shared_limit and all(x in (0, None) for x in no_spill)

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


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


def shipped_specs() -> Iterator[KernelSpec]:
    """Every kernel at every shipped (dtype, head_dim, block size), from the tile tables."""
    for torch_dtype in SHIPPED_DTYPES:
        dt = TRITON_DTYPE_NAMES[torch_dtype]
        for d in SHIPPED_HEAD_DIMS:
            for bs in SHIPPED_BLOCK_SIZES:
                tiles = bsa.attn_tiles(torch_dtype, d, bs)
                attn = dict(HEAD_DIM=d, BLOCK_SIZE=bs, DOT_F32=False, SCAN=bsa.SCAN)
                for name, fn, t in (
                    ("fwd", bsa._fwd_kernel, tiles.fwd),
                    ("bwd_dq", bsa._bwd_dq_kernel, tiles.dq),
                    ("bwd_dkdv", bsa._bwd_dkdv_kernel, tiles.dkdv),
                ):
                    ce = dict(attn, BLOCK_M=t.block_m, BLOCK_N=t.block_n)
                    yield KernelSpec(name, fn, dt, d, bs, t, ce)
                ce = dict(HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_N=tiles.dkdv.block_n)
                t = bsa.REDUCE_TILE._replace(block_n=tiles.dkdv.block_n)
                yield KernelSpec("bwd_dkdv_reduce", bsa._dkdv_reduce_kernel, dt, d, bs, t, ce)
                t = tiles.preprocess
                ce = dict(HEAD_DIM=d, BLOCK_M=t.block_m)
                yield KernelSpec("bwd_preprocess", bsa._bwd_preprocess_kernel, dt, d, bs, t, ce)
                et = est.est_tiles(torch_dtype, d, bs)
                ce = dict(HEAD_DIM=d, BLOCK_SIZE=bs, CHUNK=et.pool.block_m)
                yield KernelSpec("est_pool", est._pool_kernel, dt, d, bs, et.pool, ce)
                ce = dict(HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_I=et.probs.block_m)
                ce["BLOCK_J"] = et.probs.block_n
                yield KernelSpec("est_probs", est._probs_kernel, dt, d, bs, et.probs, ce)


def compile_spec(spec: KernelSpec, arch: str):
    """triton.compile for one arch; returns Triton's CompiledKernel (cached on disk)."""
    cap, _ = ARCHS[arch]
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

        ptxas = get_ptxas(ARCHS[arch][0]).path
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
    return ResUsage(
        kernel=spec.kernel,
        dtype=spec.dtype,
        head_dim=spec.head_dim,
        block_size=spec.block_size,
        arch=arch,
        block_m=t.block_m,
        block_n=t.block_n,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
        regs=regs,
        shared=shared,
        shared_limit=ARCHS[arch][1],
        local=local,
        stack=stack,
        spill_stores=counts[0],
        spill_loads=counts[1],
        source="cuobjdump" if tool else "metadata",
    )


def full_report(archs: tuple[str, ...] = tuple(ARCHS), spills: bool = True) -> list[ResUsage]:
    """Every shipped kernel config on every arch."""
    tool = cuobjdump_path()
    return [report(spec, arch, tool, spills) for spec in shipped_specs() for arch in archs]
