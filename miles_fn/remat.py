"""Activation recomputation that composes with torch.func.grad.

torch.utils.checkpoint fails under torch.func transforms: the non-reentrant form
uses saved-tensor hooks ("torch.func.grad doesn't yet support saved tensor hooks")
and the reentrant form is an autograd.Function without setup_context. This one is
an autograd.Function with setup_context: forward runs fn without recording a graph
and keeps only its inputs; backward runs fn again under torch.func.vjp. Peak
activation memory of a stack of n blocks drops from n blocks' intermediates to
n block inputs plus one block's intermediates, for one extra forward per block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.func import vjp


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        return fn(*args)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.fn = inputs[0]
        ctx.save_for_backward(*inputs[1:])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        # No torch.enable_grad() here: vjp differentiates at its own level, and under plain autograd
        # enabling grad would also record the recomputation into the outer graph (saved args that
        # require grad), keeping every layer's intermediates alive until the end of backward.
        _, pullback = vjp(ctx.fn, *ctx.saved_tensors)
        return (None, *pullback(grad_out))


def recompute(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
    """fn(*args), keeping only args for the backward pass and recomputing fn's intermediates there.

    args are the floating-point tensors to differentiate through; fn closes over anything else
    (masks, rotary tables). Gradients equal those of fn(*args) itself.
    """
    return _Recompute.apply(fn, *args)
