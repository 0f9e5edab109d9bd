"""Grouped MoE experts for megatron-core without Transformer Engine: `TorchGroupedMLP`.

megatron-core offers three expert modules: ``SequentialMLP`` (one ``MLP`` per expert, a Python
loop: ~6,000 autograd calls per embedded step, 41% of its time), ``TEGroupedMLP`` (needs
Transformer Engine) and the legacy ``GroupedMLP`` (needs the CUDA-only ``grouped_gemm`` package
and bf16). `TorchGroupedMLP` takes the legacy module's place in megatron's local layer spec
(``moe_grouped_gemm=True``) and computes its two grouped GEMMs with torch's own
``torch._grouped_mm``, which runs on CPU (fp32 and bf16, with autograd) and on CUDA:

    h_t = x_t @ W1[e(t)]^T                 W1: [E_local, 2F / etp, hidden]  (gate rows, up rows)
    a_t = (silu(h_t[:F]) * h_t[F:] * p_t)  p_t: the token's routing probability
    y_t = a_t @ W2[e(t)]^T                 W2: [E_local, hidden, F / etp]

over tokens already sorted by local expert (megatron's dispatcher does that), with
``offs = cumsum(tokens_per_expert)``. Each ``W[e]`` is exactly the weight of the ``SequentialMLP``
expert's linear layer (``[out, in]``), and ``_grouped_mm`` gets its transposed view as
``F.linear`` does, so the results are bitwise those of ``SequentialMLP`` on CPU (tested; a
``[in, out]`` layout, the legacy module's, differs in the last bit for few-token experts). On
the CPU in fp32 the products run through `megatron_rl.kernels.grouped_gemm` (the same products,
bitwise, without ATen's per-expert dispatch).

Checkpoints: `TorchGroupedMLP.sharded_state_dict` writes the experts under ``SequentialMLP``'s
sharded keys and global shapes (``experts.linear_fc1.weight`` ``[E, 2F, hidden]`` as gate and up
halves, ``experts.linear_fc2.weight`` ``[E, hidden, F]``, the linears' empty ``_extra_state``), so
torch_dist checkpoints load across the two modules and reshard over EP/ETP. For conversion and
weight sync each expert's weights are exposed as views under Transformer Engine's per-expert
names (`expert_weight_views`), so HF conversion produces the same names, shapes and bytes.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
from megatron.core.utils import divide

from megatron_rl.backend import cuda_available
from megatron_rl.kernels.grouped_gemm import grouped_mm


def grouped_mm_available() -> bool:
    """Whether this torch has ``torch._grouped_mm`` (2.8 and newer)."""
    return hasattr(torch, "_grouped_mm")


class TorchGroupedMLP(MegatronModule):
    """Grouped experts on ``torch._grouped_mm`` (see the module docstring).

    Built by megatron's MoE layer from a spec like any expert module:
    ``TorchGroupedMLP(num_local_experts, config, pg_collection=...)``. Supports no bias, SwiGLU
    or a plain activation, expert tensor parallelism (each rank holds ``F / etp`` rows of every
    local expert's gate and up projections and columns of its down projection) and expert
    parallelism (``E_local`` of the experts).
    """

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)
        if not hasattr(torch, "_grouped_mm"):
            raise RuntimeError(
                f"torch {torch.__version__} has no torch._grouped_mm: install torch >= 2.8 or "
                "turn grouped experts off (--no-moe-grouped-gemm)"
            )
        if config.add_bias_linear:
            raise ValueError("TorchGroupedMLP has no expert bias: set add_bias_linear=False")
        if config.gated_linear_unit and config.activation_func is not F.silu:
            raise ValueError("TorchGroupedMLP's gated unit is SwiGLU: activation_func must be silu")
        if config.moe_apply_probs_on_input or config.fp8 or config.fp4:
            raise ValueError(
                "TorchGroupedMLP does not support moe_apply_probs_on_input, fp8 or fp4; use "
                "Transformer Engine's grouped experts or --no-moe-grouped-gemm"
            )
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        ffn = divide(config.moe_ffn_hidden_size, self.tp_group.size())
        fc1 = 2 * ffn if config.gated_linear_unit else ffn
        _check_alignment(config, ffn)
        self.weight1 = self._new_weight((num_local_experts, fc1, config.hidden_size), 1)
        self.weight2 = self._new_weight((num_local_experts, config.hidden_size, ffn), 2)
        if config.perform_initialization:  # SequentialMLP's draws, in its order: same weights
            with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                for j in range(num_local_experts):
                    config.init_method(self.weight1.data[j])
                    config.output_layer_init_method(self.weight2.data[j])
        self.register_load_state_dict_post_hook(_ignore_extra_states)

    def _new_weight(self, shape: tuple[int, ...], partition_dim: int) -> torch.nn.Parameter:
        if self.config.use_cpu_initialization or not cuda_available():
            device = torch.device("cpu")
        else:
            device = torch.device("cuda", torch.cuda.current_device())
        weight = torch.nn.Parameter(
            torch.empty(shape, device=device, dtype=self.config.params_dtype)
        )
        set_tensor_model_parallel_attributes(weight, True, partition_dim, 1)
        weight.allreduce = self.ep_group.size() == 1  # as megatron's expert weights
        return weight

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """``[T, hidden]`` tokens sorted by local expert -> ``([T, hidden], None)``.

        ``tokens_per_expert`` ``[E_local]`` (any integer dtype and device) counts the rows of each
        expert; ``permuted_probs`` ``[T]`` are the routing probabilities that scale each row. The
        input and the weights stay in the graph when no token comes (zero gradients), so every
        rank's backward reaches every expert's gradient hook and the dispatcher's collectives.
        """
        x = permuted_local_hidden_states
        if x.shape[0] == 0:  # torch's grouped matmul has no backward for zero rows
            # the inputs and both weights stay in the graph: the weights get zero gradients and
            # the backward reaches the dispatcher's all-to-alls (tokens and probabilities) on
            # this rank as on its peers, in the same order
            anchor = x.sum() + permuted_probs.sum() + self.weight1.sum() + self.weight2.sum()
            return x.new_zeros(0, self.config.hidden_size) + 0.0 * anchor, None
        offsets = torch.cumsum(tokens_per_expert.to(device=x.device), 0, dtype=torch.int32)
        fc1 = grouped_mm(x, self.weight1.transpose(1, 2), offsets)
        if self.config.gated_linear_unit:
            gate, linear = torch.chunk(fc1, 2, dim=-1)
            hidden = self.config.activation_func(gate) * linear
        else:
            hidden = self.config.activation_func(fc1)
        hidden = (hidden * permuted_probs.unsqueeze(-1)).to(fc1.dtype)
        return grouped_mm(hidden, self.weight2.transpose(1, 2), offsets), None

    def backward_dw(self) -> None:
        """No delayed weight-gradient computation (megatron's expert-module interface)."""

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None) -> dict:
        """The experts under ``SequentialMLP``'s sharded keys and global shapes (non-singleton
        layout): each ``[E_local, ...]`` weight is one shard at expert offset
        ``ep_rank * E_local`` of the ``[E, ...]`` global tensor; SwiGLU's gate and up halves are
        separate shards of the fc1 rows (``tp_rank`` and ``etp + tp_rank`` of ``2 * etp``)."""
        if (metadata or {}).get("singleton_local_shards", False):
            raise NotImplementedError("TorchGroupedMLP saves the non-singleton layout only")
        ep_size, ep_rank = self.ep_group.size(), self.ep_group.rank()
        tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
        num_global = ep_size * self.num_local_experts
        axis = len(sharded_offsets)  # the experts' axis in the global tensor
        replica_id = (0, 0, self.dp_group.rank())
        experts = (axis, ep_rank, ep_size)

        def build(key, tensor, replica, flattened_range, *, halves: bool):
            if flattened_range is not None:
                raise NotImplementedError("TorchGroupedMLP: flattened ranges are not supported")
            if not halves:  # fc2 [E_local, hidden, F/etp]: TP splits the last axis
                rows = (axis + 2, tp_rank, tp_size)
                return ShardedTensor.from_rank_offsets(
                    key, tensor, *sharded_offsets, experts, rows,
                    replica_id=replica, prepend_axis_num=axis,
                )  # fmt: skip
            gate, up = torch.chunk(tensor, 2, dim=1)
            return [
                ShardedTensor.from_rank_offsets(
                    key,
                    half.contiguous(),
                    *sharded_offsets,
                    experts,
                    (axis + 1, offset + tp_rank, 2 * tp_size),
                    replica_id=replica,
                    prepend_axis_num=axis,
                )
                for half, offset in ((gate, 0), (up, tp_size))
            ]

        def merge(parts, *, halves: bool):
            return torch.cat(parts, dim=1) if halves else parts

        out = {}
        for name, fc, halves in (
            ("weight1", "linear_fc1", self.config.gated_linear_unit),
            ("weight2", "linear_fc2", False),
        ):
            out[f"{prefix}{name}"] = ShardedTensorFactory(
                f"{prefix}experts.{fc}.weight",
                getattr(self, name),
                functools.partial(build, halves=halves),
                functools.partial(merge, halves=halves),
                replica_id,
            )
        for j in range(self.num_local_experts):  # the linears' (empty) extra states
            expert = (axis, ep_rank * self.num_local_experts + j, num_global)
            for fc in ("linear_fc1", "linear_fc2"):
                out[f"{prefix}expert{j}.{fc}._extra_state"] = make_sharded_object_for_checkpoint(
                    None,
                    f"{prefix}experts.{fc}._extra_state",
                    (*sharded_offsets, expert),
                    (0, tp_rank, self.dp_group.rank()),
                )
        return out


def _check_alignment(config: TransformerConfig, ffn: int) -> None:
    """``torch._grouped_mm`` needs every row stride to be a multiple of 16 bytes (CPU and CUDA
    kernels alike): the hidden size and this rank's expert FFN width, in the parameter dtype."""
    itemsize = torch.empty((), dtype=config.params_dtype).element_size()
    for name, size in (("hidden_size", config.hidden_size), ("moe_ffn_hidden_size / etp", ffn)):
        if size * itemsize % 16:
            raise ValueError(
                f"grouped experts: {name} = {size} gives rows of {size * itemsize} bytes, and "
                "torch's grouped matmul needs multiples of 16 bytes; choose sizes that are, or "
                "run the experts one by one (--no-moe-grouped-gemm)"
            )


def _ignore_extra_states(module: torch.nn.Module, incompatible_keys) -> None:
    """The linears' ``_extra_state`` entries of the sharded state dict hold nothing to load."""
    for key in [k for k in incompatible_keys.unexpected_keys if "_extra_state" in k]:
        incompatible_keys.unexpected_keys.remove(key)


def expert_weight_views(
    module: TorchGroupedMLP, prefix: str, *, gradients: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each local expert's weights as views of the stacked storage, under Transformer Engine's
    per-expert names: ``{prefix}linear_fc1.weight{j}`` ``[2F/etp, hidden]`` and
    ``{prefix}linear_fc2.weight{j}`` ``[hidden, F/etp]`` (contiguous; writing into a view writes
    the parameter). ``gradients``: the same views of the parameters' ``.grad``."""
    for fc, weight in (("linear_fc1", module.weight1), ("linear_fc2", module.weight2)):
        stacked = weight.grad if gradients else weight
        for j in range(module.num_local_experts):
            yield f"{prefix}{fc}.weight{j}", stacked[j]
