"""LoRA on the routed experts (`TorchGroupedMLP`, the grouped-experts path): each expert's
``W1`` (gate and up) and ``W2`` (down) gain ``(alpha / r) B A``.

Two geometries (``--lora-experts``):

- ``per-expert``: every expert has its own ``A``/``B`` (``[E_local, ...]`` stacks beside the
  weights, computed with the same grouped matmuls: ``grouped(grouped(x, A1), B1)``); as
  Megatron-Bridge's and NeMo-RL's expert LoRA. Under expert parallelism the adapters live with
  their experts and, like the expert weights, reduce over the expert-data-parallel group.
- ``shared``: one ``A``/``B`` per projection shared by the layer's experts (slime's
  ``moe_language_all`` preset since September 2025): ``x A1^T B1^T`` for every routed token, as a
  dense product. Its gradient is the sum of what every expert's tokens give it: each
  expert-parallel rank computes its local experts' part, the forward passes the four factors
  through `SumGradOver` (identity; the backward all-reduces their gradients over the
  expert-parallel group, one collective per layer), and megatron's DDP then reduces them as the
  expert weights it sits beside (expert-data-parallel group, scaled by 1 / data-parallel size).
  Every expert-parallel rank then holds the same factors and the same gradient; ranks other than
  the first mark them ``shared`` so megatron's gradient norm counts them once.

The probabilities still scale the activation between the two projections, as in the base module:

    ``h = x W1[e]^T + s (x A1[e]^T) B1[e]^T``,  ``a = silu(h_g) * h_u * p``,
    ``y = a W2[e]^T + s (a A2[e]^T) B2[e]^T``,  ``s = alpha / r``.

Expert tensor parallelism (``etp > 1``) is refused: its partial sums would need the adapters'
reductions over that group. ``A`` is seeded by the layer's global name and the global expert
index (`layout_independent_a`), so expert-parallel layouts start from world 1's adapters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.kernels.grouped_gemm import grouped_mm
from megatron_rl.lora.layers import layout_independent_a
from megatron_rl.model.grouped_experts import TorchGroupedMLP

EXPERT_MODES = ("per-expert", "shared")


class SumGradOver(torch.autograd.Function):
    """Identity on ``tensors``; the backward all-reduces (sums) their gradients over ``group``,
    flattened into one buffer: one collective, however many tensors."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        ctx.like = [(t.shape, t.dtype, t.device) for t in tensors]
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        grads = [
            torch.zeros(shape, dtype=dtype, device=device) if g is None else g
            for g, (shape, dtype, device) in zip(grads, ctx.like, strict=True)
        ]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, group=ctx.group)
        out, start = [], 0
        for g in grads:
            out.append(flat[start : start + g.numel()].view_as(g).to(g.dtype))
            start += g.numel()
        return (None, *out)


class LoRAGroupedExperts(torch.nn.Module):
    """``base`` (frozen) with adapters on both projections; the base module's call signature.

    Parameters (``n`` = ``E_local`` per expert, 1 shared): ``lora_A1`` ``[n, r, hidden]``,
    ``lora_B1`` ``[n, fc1, r]``, ``lora_A2`` ``[n, r, ffn]``, ``lora_B2`` ``[n, hidden, r]``."""

    def __init__(
        self,
        base: TorchGroupedMLP,
        *,
        name: str,
        rank: int,
        alpha: float,
        seed: int,
        mode: str,
    ):
        super().__init__()
        if mode not in EXPERT_MODES:
            raise ValueError(f"--lora-experts {mode!r}: choose {' or '.join(EXPERT_MODES)}")
        if base.tp_group.size() > 1:
            raise ValueError(
                f"{name}: LoRA on routed experts with expert tensor parallelism "
                f"{base.tp_group.size()} is not supported (tensor parallelism without expert "
                "parallelism splits the experts); add --expert-model-parallel-size > 1 (the "
                "experts kept whole) or leave routed_experts out of --lora-targets"
            )
        dtype = base.weight1.dtype
        if rank * torch.empty((), dtype=dtype).element_size() % 16:
            raise ValueError(
                f"{name}: --lora-rank {rank} gives rows of {rank * dtype.itemsize} bytes; torch's "
                "grouped matmul needs multiples of 16 bytes (a rank that is a multiple of "
                f"{16 // dtype.itemsize} in {dtype})"
            )
        self.base, self.name, self.mode = base, name, mode
        self.rank, self.alpha, self.scale, self.dropout = rank, alpha, alpha / rank, 0.0
        for p in base.parameters():
            p.requires_grad_(False)
        local, fc1, hidden = base.weight1.shape
        ffn = base.weight2.shape[2]
        shared = mode == "shared"
        first = 0 if shared else base.ep_group.rank() * local
        count = 1 if shared else local

        def stack(tag: str, width: int) -> torch.nn.Parameter:
            draws = [
                layout_independent_a(
                    name if shared else f"{name}.{first + j}.{tag}", seed, rank, width
                )
                for j in range(count)
            ]
            return torch.nn.Parameter(torch.stack(draws).to(base.weight1.device, dtype))

        self.lora_A1, self.lora_A2 = stack("fc1", hidden), stack("fc2", ffn)
        zeros = dict(device=base.weight1.device, dtype=dtype)
        self.lora_B1 = torch.nn.Parameter(torch.zeros(count, fc1, rank, **zeros))
        self.lora_B2 = torch.nn.Parameter(torch.zeros(count, hidden, rank, **zeros))
        for p in (self.lora_A1, self.lora_B1, self.lora_A2, self.lora_B2):
            # megatron's attributes as the expert weights carry them (DDP's reduction group, the
            # grad norm's duplicate rule): the adapters are expert parameters like them
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce"):
                if hasattr(base.weight1, attr):
                    setattr(p, attr, getattr(base.weight1, attr))
            if shared and base.ep_group.rank() > 0:
                p.shared = True  # a replica of the first EP rank's: counted once in the norm

    @property
    def config(self):
        return self.base.config

    def factors(self) -> tuple[torch.Tensor, ...]:
        """``A1, B1, A2, B2`` as the forward uses them: shared ones through `SumGradOver` when
        experts are split over more than one rank."""
        factors = (self.lora_A1, self.lora_B1, self.lora_A2, self.lora_B2)
        if self.mode == "shared" and self.base.ep_group.size() > 1 and torch.is_grad_enabled():
            return SumGradOver.apply(self.base.ep_group, *factors)
        return factors

    def _delta(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets) -> torch.Tensor:
        if self.mode == "shared":
            return (x @ a[0].transpose(0, 1)) @ b[0].transpose(0, 1) * self.scale
        u = grouped_mm(x, a.transpose(1, 2), offsets)
        return grouped_mm(u, b.transpose(1, 2), offsets) * self.scale

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        base, x = self.base, permuted_local_hidden_states
        a1, b1, a2, b2 = self.factors()  # every rank, tokens or none: a collective's backward
        if x.shape[0] == 0:  # every weight and adapter stays in the graph (see the base module)
            adapters = a1.sum() + b1.sum() + a2.sum() + b2.sum()
            anchor = x.sum() + permuted_probs.sum() + adapters
            return x.new_zeros(0, base.config.hidden_size) + 0.0 * anchor, None
        offsets = torch.cumsum(tokens_per_expert.to(device=x.device), 0, dtype=torch.int32)
        fc1 = grouped_mm(x, base.weight1.transpose(1, 2), offsets)
        fc1 = fc1 + self._delta(x, a1, b1, offsets)
        if base.config.gated_linear_unit:
            gate, linear = torch.chunk(fc1, 2, dim=-1)
            hidden = base.config.activation_func(gate) * linear
        else:
            hidden = base.config.activation_func(fc1)
        hidden = (hidden * permuted_probs.unsqueeze(-1)).to(fc1.dtype)
        out = grouped_mm(hidden, base.weight2.transpose(1, 2), offsets)
        return out + self._delta(hidden, a2, b2, offsets), None

    def backward_dw(self) -> None:
        """No delayed weight-gradient computation (megatron's expert-module interface)."""

    def merged_stacks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W1 + s B1 A1`` and ``W2 + s B2 A2`` per local expert (detached, the weights' dtype)."""
        with torch.no_grad():
            out = []
            for w, a, b in (
                (self.base.weight1, self.lora_A1, self.lora_B1),
                (self.base.weight2, self.lora_A2, self.lora_B2),
            ):
                delta = torch.bmm(b.float(), a.float()) * self.scale  # [n, out, in]
                out.append((w.float() + delta).to(w.dtype))
            return out[0], out[1]

    def merged_state(self) -> dict[str, torch.Tensor]:
        """The unadapted module's state-dict entries, merged: ``weight1``, ``weight2``."""
        w1, w2 = self.merged_stacks()
        return {"weight1": w1, "weight2": w2}

    def merged_entries(self) -> dict[str, torch.Tensor]:
        """Merged per-expert tensors under `expert_weight_views`' names (conversion, sync)."""
        w1, w2 = self.merged_stacks()
        out = {}
        for fc, stacked in (("linear_fc1", w1), ("linear_fc2", w2)):
            for j in range(stacked.shape[0]):
                out[f"{fc}.weight{j}"] = stacked[j]
        return out
