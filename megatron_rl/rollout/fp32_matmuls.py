"""bf16 serving with fp32 matrix products: the engine's bf16 arithmetic at fp32 speed on a CPU.

A bf16 matmul on the CPU computes each output element as an fp32 dot product of the bf16
operands and rounds it to bf16 once (``padded_experts`` relies on the same fact); GPU kernels
with fp32 accumulation do the same. On a CPU without native bf16 (AVX2) that kernel is emulated
and slow: ``torch._grouped_mm`` costs 2-6x its fp32 time and ``F.linear`` ~5x (measured on the
study's shapes). `use_fp32_matmuls` runs the engine's bf16 products as

    y = bf16( fp32(x) @ fp32(W)^T )

i.e. the same operands and the same single rounding, with MKL's fp32 kernels; every other
operation (norms, activations, softmax, residual adds, the router) stays in the model's bf16.
The one difference from the native kernel is the order of the fp32 additions inside a dot
product: a sum that lands within fp32 rounding of a bf16 rounding boundary can round to the
neighbouring bf16 value, measured on 0.002-0.005% of output elements (one bf16 ulp each). That
is far below the bf16 serving mismatch itself (tested: `tests/rollout/test_fp32_matmuls.py`).

What it changes, on one model: every ``torch.nn.Linear`` with bf16 weights (attention
projections, ``lm_head``) and the experts, through `FP32_GROUPED_MM`, an experts function
registered in transformers' ``ExpertsInterface`` (the same grouping, gating and weighting as
transformers' ``"grouped_mm"``, with the two grouped products in fp32). The router's logits
keep their bf16 product: routing is where the mismatch under study lives.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

from megatron_rl.kernels.grouped_gemm import grouped_mm
from megatron_rl.rollout.padded_experts import check_qwen3_experts, expert_order, unpermute_sum

FP32_GROUPED_MM = "fp32_grouped_mm"  # the name registered in transformers' ExpertsInterface


def _fp32_linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if self.bias is None else self.bias.float()
    return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def fp32_grouped_mm_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """[T, H] expert mixture of ``hidden_states`` [T, H] routed by ``top_k_index`` [T, K]
    (weights ``top_k_weights`` [T, K]); a Qwen3-MoE experts module ``self`` (``gate_up_proj``
    [E, 2I, H], ``down_proj`` [E, H, I]). Each grouped product is ``bf16(fp32 @ fp32)``."""
    check_qwen3_experts(self, FP32_GROUPED_MM)
    dtype = hidden_states.dtype
    _, perm_S, counts_E = expert_order(top_k_index, self.num_experts)
    offsets_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
    x_SH = hidden_states[perm_S // top_k_index.shape[-1]]
    gate_up = self.gate_up_proj.float().transpose(-2, -1)
    up_S2I = grouped_mm(x_SH.float(), gate_up, offsets_E).to(dtype)
    act_SI = self._apply_gate(up_S2I)
    down = self.down_proj.float().transpose(-2, -1)
    proj_SH = grouped_mm(act_SI.float(), down, offsets_E).to(dtype)
    return unpermute_sum(proj_SH, top_k_weights, perm_S).to(dtype)


def use_fp32_matmuls(model: torch.nn.Module) -> int:
    """Run ``model``'s bf16 linear layers and experts with fp32 products (see the module
    docstring); returns the number of linear layers switched. A model whose weights are not
    bf16 is refused: its products already run in its own dtype."""
    linears = [
        m
        for m in model.modules()
        if type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16
    ]
    if not linears:
        raise ValueError(
            "fp32 matmuls: the model has no bf16 linear layer; they apply to bf16 (or FP8) "
            "serving only (InProcessEngineConfig.bf16_matmul='native' otherwise)"
        )
    for module in linears:
        module.forward = types.MethodType(_fp32_linear_forward, module)
    if FP32_GROUPED_MM not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(FP32_GROUPED_MM, fp32_grouped_mm_experts_forward)
    model.set_experts_implementation(FP32_GROUPED_MM)
    return len(linears)
