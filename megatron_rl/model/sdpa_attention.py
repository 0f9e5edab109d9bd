"""Megatron's local core attention as one fused torch op: ``scaled_dot_product_attention``.

Without Transformer Engine megatron-core computes causal attention unfused
(`DotProductAttention`): keys and values repeated per query group, ``baddbmm`` for the
``[b * np, sq, sk]`` scores, a masked softmax (the ``-10000`` fill of a ``[sq, sk]`` causal
mask), dropout and ``bmm``, each a kernel and an autograd node. `SdpaDotProductAttention`
computes the same

    context[b, h, i] = sum_{j <= i} softmax_j(q_i . k_j * scale) v_j

with ``torch.nn.functional.scaled_dot_product_attention(is_causal=True, enable_gqa=...)``: one
kernel forward and one backward (a flash-attention kernel on the CPU), which on a CPU model of
head size 16 is most of the attention's cost. The two agree to float rounding (the fused kernel
sums the softmax blockwise): within 1e-6 of the context in fp32 (tested), not bitwise.

It takes the fused path only where it computes exactly megatron's function: a causal self-attention
mask built by megatron itself (``attention_mask`` None), ``sq == sk``, no dropout in effect, the
vanilla softmax, no sliding window, no query-key layer scaling, no attention bias or packed
sequences; anything else runs megatron's own forward unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SdpaDotProductAttention(DotProductAttention):
    """`DotProductAttention` whose causal case runs torch's fused attention (module docstring).

    Inputs ``query`` [sq, b, np, hn], ``key``/``value`` [sk, b, ng, hn]; output [sq, b, np * hn],
    as megatron's.
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if not self._fusable(query, key, attention_mask, attention_bias, packed_seq_params):
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        sq, b = query.shape[0], query.shape[1]
        grouped = self.num_query_groups_per_partition != self.num_attention_heads_per_partition
        # [s, b, heads, hn] -> [b, heads, s, hn] (views; the kernel reads strided inputs)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = torch.nn.functional.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=grouped,
        )
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _fusable(self, query, key, attention_mask, attention_bias, packed_seq_params) -> bool:
        dropout = self.attention_dropout.p if self.training else 0.0
        return (
            attention_mask is None
            and self.attn_mask_type == AttnMaskType.causal
            and attention_bias is None
            and packed_seq_params is None
            and query.shape[0] == key.shape[0]
            and dropout == 0.0
            and self.softmax_offset is None
            and self.scale_mask_softmax.scale is None
            and self.scale_mask_softmax.window_size is None
        )
