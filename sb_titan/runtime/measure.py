"""Per-micro-batch compute time of the transformer blocks, without communication.

Timing a whole forward/backward call is wrong under FSDP (each block's all-gather and
reduce-scatter waits for the slowest rank, so every rank looks equally slow) and under
PP (receives). So the clock sits inside each block, inside FSDP's hooks: forward is
timed around the block's own forward; backward between two autograd markers, one on
the block's output (its backward runs first) and one on its input (runs last).
Activation recomputation runs the block's forward again and is counted: it is real work.
On CUDA the clock records events and resolves them once per step (no per-block sync).
The hooks are excluded from compilation: a block compiled by `--compile.enable` runs
its hooks eagerly around the compiled graph, so the clock never enters it.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.nn as nn

from sb_titan.attention.layout import AttnMeta
from sb_titan.runtime.context import RunContext


class BlockClock:
    """Accumulates seconds per micro-batch over every wrapped block on this rank."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self._cpu: dict[int, float] = defaultdict(float)
        self._events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._open: dict[tuple[int, int], object] = {}

    def start(self, key: tuple[int, int]) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._open[key] = event
        else:
            self._open[key] = time.perf_counter()

    def stop(self, key: tuple[int, int]) -> None:
        begin = self._open.pop(key, None)
        if begin is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((key[0], begin, end))
        else:
            self._cpu[key[0]] += time.perf_counter() - begin

    def seconds(self) -> dict[int, float]:
        """micro-batch -> compute seconds since reset (synchronizes once on CUDA)."""
        out = dict(self._cpu)
        if self._events:
            torch.cuda.synchronize()
            for mb, begin, end in self._events:
                out[mb] = out.get(mb, 0.0) + begin.elapsed_time(end) / 1000.0
        return out


class _BackwardMark(torch.autograd.Function):
    """Identity whose backward starts or stops the clock for one (micro-batch, block)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: BlockClock, key: tuple[int, int], start: bool):
        ctx.clock, ctx.key, ctx.start = clock, key, start
        # An alias, not a view: FSDP warns about blocks that return views (an in-place
        # op on one would skip its pre-backward hook).
        return x.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ctx.clock.start if ctx.start else ctx.clock.stop)(ctx.key)
        return grad, None, None, None


def instrument_blocks(model_parts: list[nn.Module], clock: BlockClock, context: RunContext) -> int:
    """Time every decoder block through forward hooks (no rebound forward): ours run
    after FSDP's pre-forward hook (its all-gather is not timed) and, prepended, before
    its post-forward hook, so FSDP's backward hooks sit outside our marks too.
    Returns how many blocks were instrumented."""
    n = 0
    for part in model_parts:
        layers = getattr(part, "layers", None)
        if layers is None:
            continue
        for block in layers.values():
            timer = _BlockTimer(clock, context, id(block))
            block.register_forward_pre_hook(timer.before, with_kwargs=True)
            block.register_forward_hook(timer.after, with_kwargs=True, prepend=True)
            n += 1
    return n


def _microbatch(args: tuple, kwargs: dict) -> int:
    for value in (*args, *kwargs.values()):
        if isinstance(value, AttnMeta) and value.microbatch is not None:
            return int(value.microbatch)
    return 0


class _BlockTimer:
    """Starts the clock before one block's forward and stops it after; the backward
    marks time its backward (the output's runs first, the input's last)."""

    def __init__(self, clock: BlockClock, context: RunContext, block_id: int) -> None:
        self.clock, self.context, self.block_id = clock, context, block_id

    @torch.compiler.disable
    def before(self, module: nn.Module, args: tuple, kwargs: dict):
        if not self.context.measuring:  # e.g. the pipeline's shape inference
            return None
        key = (_microbatch(args, kwargs), self.block_id)
        x = args[0]
        if torch.is_grad_enabled() and x.requires_grad:
            args = (_BackwardMark.apply(x, self.clock, key, False), *args[1:])  # stops
        self.clock.start(key)
        return args, kwargs

    @torch.compiler.disable
    def after(self, module: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor):
        if not self.context.measuring:
            return None
        key = (_microbatch(args, kwargs), self.block_id)
        self.clock.stop(key)
        if torch.is_grad_enabled() and out.requires_grad:
            return _BackwardMark.apply(out, self.clock, key, True)  # backward starts here
        return None
