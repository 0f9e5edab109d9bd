"""Megatron's local linear layers as ``F.linear`` where its autograd function adds nothing.

``ColumnParallelLinear`` and ``RowParallelLinear`` (the local spec's attention projections and
output layer) call ``linear_with_grad_accumulation_and_async_allreduce``, a Python
``autograd.Function`` that exists for tensor parallelism: an asynchronous all-reduce of the input
gradient, sequence-parallel gathers, gradient-accumulation fusion into ``main_grad`` and delayed
weight gradients. With none of them (TP 1 on the CPU: no all-reduce, no sequence parallelism, no
fusion kernel, no deferral) its forward is ``input @ weight^T (+ bias)`` and its backward is
``grad @ weight`` and ``grad_2d^T @ input_2d``: what ``F.linear``'s C++ autograd computes, with
the same products on the same layouts, so the results are bitwise megatron's (tested: logits and
every gradient of the tiny presets), without a Python ``forward``/``backward`` per layer and call.

Anything else (a flag set, a tensor on another device) goes to megatron's function unchanged.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

LAYERS = "megatron.core.tensor_parallel.layers"
_MEGATRON: dict[str, object] = {}


def linear_at_tp1(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: list | None = None,
    wgrad_deferral_limit: int | None = 0,
    async_grad_allreduce: bool | None = None,
    tp_group=None,
) -> torch.Tensor:
    """``linear_with_grad_accumulation_and_async_allreduce`` with the same arguments and results
    (module docstring)."""
    if (
        gradient_accumulation_fusion
        or allreduce_dgrad
        or sequence_parallel
        or grad_output_buffer is not None
        or async_grad_allreduce
        or input.device.type != "cpu"
    ):
        return _MEGATRON["linear"](
            input,
            weight,
            bias,
            gradient_accumulation_fusion,
            allreduce_dgrad,
            sequence_parallel,
            grad_output_buffer,
            wgrad_deferral_limit,
            async_grad_allreduce,
            tp_group,
        )
    return F.linear(input, weight, bias)


# megatron's function warns once through an attribute it reads off its own global name, which
# now names this function
linear_at_tp1.warned = False


def use_plain_linear() -> None:
    """Make megatron's local linear layers call `linear_at_tp1` (idempotent; process-wide)."""
    layers = importlib.import_module(LAYERS)
    current = layers.linear_with_grad_accumulation_and_async_allreduce
    if current is not linear_at_tp1:
        _MEGATRON["linear"] = current
        layers.linear_with_grad_accumulation_and_async_allreduce = linear_at_tp1
