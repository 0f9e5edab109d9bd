"""Megatron-core's local (no Transformer Engine) attention, for multi-latent attention.

megatron-core 0.16.1's ``MLASelfAttention`` builds its core attention with ``k_channels`` (the
query/key head size, nope + rope) and ``v_channels`` (the value head size), which only Transformer
Engine's ``TEDotProductAttention`` accepts; the local ``DotProductAttention`` raises a TypeError
and sizes its output as ``kv_channels`` per head. `MLADotProductAttention` takes both and returns
``[s, b, heads_per_partition * v_channels]``; the scores and softmax are the parent's:
softmax(q k^T * softmax_scale + causal mask) v, with MLA's ``softmax_scale`` (1 / sqrt(k_channels)
without YaRN).

`without_te_mla` fixes the other obstacle: without Transformer Engine, megatron's
``extensions.transformer_engine`` still imports (it substitutes a ``MagicMock`` for ``te``), so
``multi_latent_attention.HAVE_TE`` is True while ``TELinear`` is a mock instance, and
``isinstance(self.linear_proj, TELinear)`` raises a TypeError in every ``MLASelfAttention``.
It sets ``HAVE_TE`` to False there when ``transformer_engine`` cannot be imported (the value the
module's own ``except ImportError`` branch sets), so that check is skipped as intended.

`shard_mla_kv_down_proj_grads` fixes a gradient that megatron-core 0.16.1 drops under tensor
parallelism on the local spec. ``linear_kv_down_proj`` is a ``ColumnParallelLinear`` there: each
TP rank computes a slice of [c_kv; k_rope] (``kv_lora_rank + qk_pos_emb_head_dim`` columns) and
MLA all-gathers the slices. k_rope is shared by all heads, but each rank uses it for its own
heads only, and the all-gather's backward keeps each rank's own slice of the gradient: the
gradient of k_rope from the other ranks' heads is lost (c_kv's is not: it reaches the
gather through ``linear_kv_up_proj``, whose input gradient is already summed over TP). Measured on
``tiny-deepseek`` at TP 2 + SP: ``kv_a_proj_with_mqa``'s gradient off by up to 0.9%, every
other tensor's by up to 0.1% through it.
"""

from __future__ import annotations

import importlib.util

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.dot_product_attention import DotProductAttention


def without_te_mla() -> bool:
    """Tell megatron's MLA module that TE is absent when it is; returns whether it was absent."""
    absent = importlib.util.find_spec("transformer_engine") is None
    if absent:
        multi_latent_attention.HAVE_TE = False
    return absent


class MLADotProductAttention(DotProductAttention):
    """`DotProductAttention` whose value heads may differ in size from its query/key heads.

    Without ``v_channels`` it is the parent (megatron's base ``Attention`` builds one such
    instance, which ``MLASelfAttention`` then replaces by its own).
    """

    def __init__(
        self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        del k_channels  # the scores take the query/key head size from the tensors
        if v_channels is not None:
            self.hidden_size_per_partition = self.num_attention_heads_per_partition * v_channels


class KVDownProjection(ColumnParallelLinear):
    """MLA's ``linear_kv_down_proj`` whose output is whole, with k_rope's gradient summed over TP.

    The weight is megatron's column shard (same parameters, same names); only the output
    changes: x -> y_local [s, b, (r_kv + r_rope) / TP] -> y = all-gather over TP
    [s, b, r_kv + r_rope]. Without SP, y = [c_kv; copy_to_tp(k_rope)] (identity forward,
    all-reduce of k_rope's gradient backward); with SP, y is scattered over the sequence
    [s / TP, b, r_kv + r_rope] and MLA all-gathers k_rope itself, whose backward (a
    reduce-scatter) sums the ranks' heads. MLA sees a whole last dim and takes its
    replicated-linear branch.
    """

    def forward(self, input_: torch.Tensor, *args, **kwargs):
        output_local, bias = super().forward(input_, *args, **kwargs)
        output = gather_from_tensor_model_parallel_region(output_local)
        if self.config.sequence_parallel:
            return scatter_to_sequence_parallel_region(output), bias
        rank_kv = self.config.kv_lora_rank
        kv_compressed, k_rope = output[..., :rank_kv], output[..., rank_kv:]
        return torch.cat([kv_compressed, copy_to_tensor_model_parallel_region(k_rope)], -1), bias


def shard_mla_kv_down_proj_grads(model: torch.nn.Module) -> int:
    """Make every MLA ``linear_kv_down_proj`` of ``model`` a `KVDownProjection` under TP > 1.

    Only the class changes (its forward), not the parameters; returns how many were changed.
    """
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, multi_latent_attention.MLASelfAttention):
            proj = module.linear_kv_down_proj
            if type(proj) is ColumnParallelLinear:
                proj.__class__ = KVDownProjection
                count += 1
    return count
