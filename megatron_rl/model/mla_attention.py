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
"""

from __future__ import annotations

import importlib.util

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
