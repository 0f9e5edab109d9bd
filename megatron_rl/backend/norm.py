"""A torch RMSNorm/LayerNorm that megatron-core's local layer spec can use with sequence parallel.

megatron-core's ``WrappedTorchNorm`` (the norm of the local spec when apex is absent) asserts
``not config.sequence_parallel``. The norm itself needs nothing from sequence parallelism: each
rank normalises its own tokens. Only the gradients of its weight differ per rank and must be
summed over the tensor-parallel group, which megatron's ``finalize_model_grads`` does for every
parameter marked ``sequence_parallel``. `SequenceParallelTorchNorm` does exactly that marking,
and the builder swaps it into the spec (a spec swap, not a patch). Needed by 0.16-0.19.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.spec_utils import ModuleSpec


class SequenceParallelTorchNorm:
    """Factory with ``WrappedTorchNorm``'s signature returning ``torch.nn.RMSNorm``/``LayerNorm``.

    Shapes: input [..., hidden_size] -> output [..., hidden_size].
    """

    def __new__(
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> torch.nn.Module:
        del persist_layer_norm, zero_centered_gamma, normalization
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma is not supported by the torch norm")
        if config.normalization == "RMSNorm":
            norm: torch.nn.Module = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(
                f"normalization={config.normalization!r} is not supported; use RMSNorm/LayerNorm"
            )
        norm = norm.to(dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def swap_module_in_spec(spec: Any, old: type, new: type) -> Any:
    """Replace every occurrence of the class ``old`` in a (nested) megatron spec by ``new``.

    Walks ``ModuleSpec`` objects, their ``submodules`` dataclasses, lists and tuples in place and
    returns the (possibly replaced) root.
    """
    if spec is old:
        return new
    if isinstance(spec, ModuleSpec):
        if spec.module is old:
            spec.module = new
        if spec.submodules is not None:
            spec.submodules = swap_module_in_spec(spec.submodules, old, new)
        return spec
    if isinstance(spec, list):
        return [swap_module_in_spec(item, old, new) for item in spec]
    if isinstance(spec, tuple):
        return tuple(swap_module_in_spec(item, old, new) for item in spec)
    if hasattr(spec, "__dataclass_fields__"):
        for field_name in spec.__dataclass_fields__:
            value = getattr(spec, field_name)
            setattr(spec, field_name, swap_module_in_spec(value, old, new))
    return spec
