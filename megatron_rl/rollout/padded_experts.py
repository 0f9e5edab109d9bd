"""Padded batched-matmul experts for transformers' Qwen3-MoE: an expert kernel for the engine.

transformers 5 runs an experts module decorated with ``@use_experts_implementation`` through
the function its config names (``config._experts_implementation``), looked up in
``transformers.integrations.moe.ExpertsInterface``; the default, ``"grouped_mm"``, calls
``torch._grouped_mm``, which costs ~1 ms a call in bf16 on CPU. `padded_bmm_experts_forward`
computes the same thing with one ``torch.bmm`` per projection over the stacked expert weights:

    x_ECH[e, c] = hidden[t]    for the c-th (token t, slot k) pair routed to expert e,
    y_ECH = bmm(act(bmm(x_ECH, W_gate_up[e]^T)), W_down[e]^T),
    out[t] = sum_k w[t, k] * y[expert(t, k), slot(t, k)],

with ``C`` the largest per-expert count (rows past an expert's count are zeros and are never
read back). The weighting, un-permutation and sum over k are the grouped path's own tensor
operations. In bf16 the CPU matmul computes each output element on its own (fp32 dot product,
one rounding), so the output is bitwise equal to ``"grouped_mm"`` (tested, 1 and 2 threads). In
fp32 it is equal within rounding only: MKL picks its kernel by the row count (on AVX2: 1, 2-3,
4+ rows) and splits rows by thread count, so a ``[count, H]`` product and the padded ``[C, H]``
one can round a row differently.

Measured on the engine (2-core AVX2 CPU, one thread, the study's 16 x 8 request;
``megatron-rl bench engine``): slower than ``"grouped_mm"``, 0.94x (tiny, fp32) to 0.27x
(tiny-mismatch, bf16). The study's rows repeat, so routing piles onto a few experts and every
slice is padded to the busiest one, and bf16 matmuls on a CPU without native bf16 cost per
padded row. The engine therefore keeps transformers' default; ``InProcessEngineConfig.
experts_implementation="padded_bmm"`` selects this one. `use_padded_experts` registers it under
`PADDED_BMM` through transformers' own registry and selects it on one model.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

PADDED_BMM = "padded_bmm"  # the name this module registers in transformers' ExpertsInterface


def check_qwen3_experts(experts: torch.nn.Module, name: str) -> None:
    """Refuse an experts module whose layout is not Qwen3-MoE's (what ``name`` computes)."""
    if (
        experts.has_bias
        or experts.is_transposed
        or not experts.has_gate
        or experts.has_post_expert_norm
    ):
        raise ValueError(
            f"{name} experts: {type(experts).__name__} needs a layout other than Qwen3-MoE's "
            "(gated, untransposed, no bias, no post-expert norm); use experts_implementation="
            "'grouped_mm'"
        )
    if experts._is_expert_parallel:
        raise ValueError(f"{name} experts: expert parallelism is not supported")


def expert_order(
    top_k_index: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(expert_sorted_S, perm_S, counts_E)``: the S = T K (token, slot) pairs of
    ``top_k_index`` [T, K] (token-major) sorted by expert as transformers' grouped path sorts
    them, the permutation, and the pairs per expert."""
    expert_ids_S = top_k_index.reshape(-1)
    expert_sorted_S, perm_S = torch.sort(expert_ids_S)
    return expert_sorted_S, perm_S, torch.bincount(expert_ids_S, minlength=num_experts)


def unpermute_sum(
    proj_SH: torch.Tensor, top_k_weights: torch.Tensor, perm_S: torch.Tensor
) -> torch.Tensor:
    """``out[t] = sum_k w[t, k] y[t, k]`` [T, H] from the expert outputs ``proj_SH`` in sorted
    order (`expert_order`) and the routing weights ``top_k_weights`` [T, K]."""
    num_tokens, num_top_k = top_k_weights.shape
    weighted_SH = proj_SH * top_k_weights.reshape(-1)[perm_S].unsqueeze(-1)
    inv_perm_S = torch.empty_like(perm_S)
    inv_perm_S[perm_S] = torch.arange(perm_S.numel(), device=perm_S.device)
    return weighted_SH[inv_perm_S].view(num_tokens, num_top_k, -1).sum(dim=1)


def padded_bmm_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """[T, H] expert mixture of ``hidden_states`` [T, H] routed by ``top_k_index`` [T, K].

    ``self``: a Qwen3-MoE experts module (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I],
    concatenated gate/up, no bias); ``top_k_weights`` [T, K] weights the K expert outputs.
    """
    check_qwen3_experts(self, PADDED_BMM)
    num_top_k = top_k_index.shape[-1]
    hidden_dim = hidden_states.size(-1)
    expert_sorted_S, perm_S, counts_E = expert_order(top_k_index, self.num_experts)
    starts_E = torch.cumsum(counts_E, dim=0) - counts_E
    slot_S = torch.arange(perm_S.numel(), device=perm_S.device) - starts_E[expert_sorted_S]
    capacity = int(counts_E.max()) if perm_S.numel() else 0
    weight_dtype = self.gate_up_proj.dtype
    x_ECH = hidden_states.new_zeros(self.num_experts, capacity, hidden_dim, dtype=weight_dtype)
    x_ECH[expert_sorted_S, slot_S] = hidden_states[perm_S // num_top_k].to(weight_dtype)
    gate_up_EC2I = torch.bmm(x_ECH, self.gate_up_proj.transpose(1, 2))
    act_ECI = self._apply_gate(gate_up_EC2I)
    out_ECH = torch.bmm(act_ECI, self.down_proj.transpose(1, 2))
    proj_SH = out_ECH[expert_sorted_S, slot_S]  # sorted order, as grouped_mm returns it
    return unpermute_sum(proj_SH, top_k_weights, perm_S).to(hidden_states.dtype)


def register_padded_experts() -> None:
    """Add `PADDED_BMM` to transformers' experts registry (idempotent; nothing else changes)."""
    if PADDED_BMM not in ALL_EXPERTS_FUNCTIONS:
        ExpertsInterface.register(PADDED_BMM, padded_bmm_experts_forward)


def use_padded_experts(model) -> None:
    """Run every experts module of ``model`` (a transformers ``PreTrainedModel``) with
    `padded_bmm_experts_forward`; ``model.set_experts_implementation(old)`` switches back."""
    register_padded_experts()
    model.set_experts_implementation(PADDED_BMM)
