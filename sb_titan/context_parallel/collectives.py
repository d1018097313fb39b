"""All-gather along a dimension whose backward is a reduce-scatter, as custom ops.

Functional collectives run on gloo and NCCL alike, and custom ops with fakes keep the
pair traceable (one graph node each way), as the attention ops are."""

from __future__ import annotations

import torch
from torch import Tensor

from sb_titan.compat.distributed import all_gather_single, group_size, reduce_scatter_single


@torch.library.custom_op("sb_titan::cp_all_gather", mutates_args=())
def _all_gather(x: Tensor, dim: int, group_name: str) -> Tensor:
    return all_gather_single(x.contiguous(), dim, group_name).contiguous()


@_all_gather.register_fake
def _(x, dim, group_name):
    shape = list(x.shape)
    shape[dim] *= group_size(group_name)
    return x.new_empty(shape)


@torch.library.custom_op("sb_titan::cp_reduce_scatter", mutates_args=())
def _reduce_scatter(x: Tensor, dim: int, group_name: str) -> Tensor:
    return reduce_scatter_single(x.contiguous(), dim, group_name).contiguous()


@_reduce_scatter.register_fake
def _(x, dim, group_name):
    shape = list(x.shape)
    shape[dim] //= group_size(group_name)
    return x.new_empty(shape)


def _setup(ctx, inputs, output) -> None:
    _, ctx.dim, ctx.group_name = inputs


def _gather_backward(ctx, grad: Tensor):
    return _reduce_scatter(grad, ctx.dim, ctx.group_name), None, None


_all_gather.register_autograd(_gather_backward, setup_context=_setup)


def all_gather(x: Tensor, dim: int, group_name: str) -> Tensor:
    """Every rank's `x` concatenated along `dim` in rank order; gradients are summed
    over the group and scattered back (each rank gets its own slice's)."""
    return _all_gather(x, dim, group_name)
