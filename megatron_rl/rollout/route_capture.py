"""Capture the top-k experts every MoE layer of a transformers Qwen3-MoE or DeepSeek-V3 model
chooses.

A forward hook on each layer's ``mlp.gate`` (``Qwen3MoeTopKRouter``, or ``DeepseekV3TopkRouter``:
sigmoid scores plus ``e_score_correction_bias``, group-limited top-k; both return
``(router_logits, router_scores, router_indices)`` with indices ``[tokens, K]``) records the
indices of every forward call, prefill and KV-cached decoding steps alike, in the narrowest
integer dtype that holds the expert count (never an int64 copy of the batch).
"""

from __future__ import annotations

import torch

from megatron_rl.routing.codec import DTYPES


def moe_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router of every MoE layer, in layer order (dense layers have none)."""
    layers = model.model.layers
    return [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "gate")]


def storage_dtype(num_experts: int) -> torch.dtype:
    """Narrowest of uint8/int16/int32 that holds ``num_experts - 1``."""
    for dtype in DTYPES.values():
        if torch.iinfo(dtype).max >= num_experts - 1:
            return dtype
    raise ValueError(f"num_experts={num_experts} does not fit int32")


class RouteCapture:
    """Context manager: ``steps`` gets one ``[B, T, L, K]`` tensor per forward call.

    Args:
        model: a transformers Qwen3-MoE or DeepSeek-V3 causal LM (dense layers have no gate).
        batch_size: rows of every forward call made while capturing (B).
    """

    def __init__(self, model: torch.nn.Module, batch_size: int) -> None:
        self.gates = moe_gates(model)
        if not self.gates:
            raise ValueError("the model has no MoE layer (no mlp.gate): nothing to capture")
        self.batch_size = batch_size
        self.dtype = storage_dtype(self.gates[0].num_experts)
        self.steps: list[torch.Tensor] = []
        self._layer_rows: list[torch.Tensor] = []
        self._handles: list = []

    def __enter__(self) -> RouteCapture:
        self._handles = [gate.register_forward_hook(self._hook) for gate in self.gates]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, module, args, output) -> None:
        del module, args
        indices_NK = output[2]
        self._layer_rows.append(indices_NK.to(device="cpu", dtype=self.dtype))
        if len(self._layer_rows) == len(self.gates):
            step_LNK = torch.stack(self._layer_rows)
            self._layer_rows = []
            num_layers, _, topk = step_LNK.shape
            step_BTLK = step_LNK.reshape(num_layers, self.batch_size, -1, topk).permute(1, 2, 0, 3)
            self.steps.append(step_BTLK)

    def routes_BTLK(self) -> torch.Tensor:
        """All captured positions ``[B, sum of T over calls, L, K]``."""
        if self._layer_rows:
            raise RuntimeError("a forward call ended with only some MoE layers captured")
        return torch.cat(self.steps, dim=1)
