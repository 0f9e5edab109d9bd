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
    """Context manager: each forward call's routes ``[rows, T, L, K]``, kept with the batch rows
    and the positions they are for, assembled by `routes_BTLK`.

    The batch may lose rows between calls (`keep_rows`: the engine drops finished rows) and may
    restart at position 0 (`restart`: a retract's re-prefill, whose routes replace the earlier
    ones of the rows it recomputes; a row dropped before keeps what it had).

    Args:
        model: a transformers Qwen3-MoE or DeepSeek-V3 causal LM (dense layers have no gate).
        batch_size: rows of the first forward call (B).
    """

    def __init__(self, model: torch.nn.Module, batch_size: int) -> None:
        self.gates = moe_gates(model)
        if not self.gates:
            raise ValueError("the model has no MoE layer (no mlp.gate): nothing to capture")
        self.batch_size = batch_size
        self.dtype = storage_dtype(self.gates[0].num_experts)
        self.rows = torch.arange(batch_size)  # the batch rows of the next call, in B
        self.position = 0  # where the next call's positions start
        self.steps: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (start, rows, [r,T,L,K])
        self._layer_rows: list[torch.Tensor] = []
        self._handles: list = []

    def __enter__(self) -> RouteCapture:
        self._handles = [gate.register_forward_hook(self._hook) for gate in self.gates]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Later calls hold only the current rows at positions ``keep`` (an index tensor)."""
        self.rows = self.rows[keep]

    def restart(self) -> None:
        """The next call starts again at position 0 (a re-prefill)."""
        self.position = 0

    def _hook(self, module, args, output) -> None:
        del module, args
        indices_NK = output[2]
        self._layer_rows.append(indices_NK.to(device="cpu", dtype=self.dtype))
        if len(self._layer_rows) == len(self.gates):
            step_LNK = torch.stack(self._layer_rows)
            self._layer_rows = []
            num_layers, _, topk = step_LNK.shape
            rows = self.rows.numel()
            step_rTLK = step_LNK.reshape(num_layers, rows, -1, topk).permute(1, 2, 0, 3)
            self.steps.append((self.position, self.rows, step_rTLK))
            self.position += step_rTLK.shape[1]

    def routes_BTLK(self) -> torch.Tensor:
        """Every captured position ``[B, T, L, K]`` (T: the furthest position reached); where a
        row was not in a call (dropped before it) its entries are 0."""
        if self._layer_rows:
            raise RuntimeError("a forward call ended with only some MoE layers captured")
        if not self.steps:
            raise RuntimeError("no forward call was captured")
        length = max(start + step.shape[1] for start, _, step in self.steps)
        _, _, layers, topk = self.steps[0][2].shape
        out = torch.zeros((self.batch_size, length, layers, topk), dtype=self.dtype)
        for start, rows, step in self.steps:  # in call order: a re-prefill overwrites
            out[rows, start : start + step.shape[1]] = step
        return out
