"""megatron's unfused rotary embedding with its cos and sin tables taken once per ``freqs``.

``_apply_rotary_pos_emb_bshd`` (the local spec's RoPE when no fused kernel exists, as on the
CPU) computes ``cos(freqs) * mscale`` and ``sin(freqs) * mscale`` on every call: for the query
and the key of every layer, on the same ``freqs`` tensor, which megatron's rotary module builds
once per forward (and caches per sequence length) for all layers. When the rotation covers the
whole head it also concatenates the result with an empty pass-through part, one more copy and
autograd node. `rotary_bshd` keeps the tables of the last ``freqs`` (the same tensor object at the
same version, dtype and mscale) and leaves out the empty concatenation. Every product and sum is
the one megatron computes on the same operands, so outputs and gradients are bitwise megatron's
(tested on random heads and on the tiny presets' logits and gradients).

Anything else (MLA's de-interleaving, interleaved rotation, ``freqs`` that require a gradient, a
tensor off the CPU) goes to megatron's function unchanged.
"""

from __future__ import annotations

import importlib

import torch

ROPE = "megatron.core.models.common.embeddings.rope_utils"
_MEGATRON: dict[str, object] = {}
# (freqs, its version, dtype, mscale, cos, sin) of the last call: one entry, replaced whole
_last: tuple | None = None


def rotary_bshd(
    t: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    multi_latent_attention: bool = False,
    mscale: float = 1.0,
) -> torch.Tensor:
    """``_apply_rotary_pos_emb_bshd`` with the same arguments and results (module docstring):
    ``t [s, b, h, d]``, ``freqs [s, 1, 1, rot_dim]``; ``t * cos + rotate_half(t) * sin`` on the
    first ``rot_dim`` channels, the others passed through."""
    if (
        multi_latent_attention
        or rotary_interleaved
        or freqs.requires_grad
        or t.device.type != "cpu"
        or freqs.device != t.device
    ):
        return _MEGATRON["bshd"](t, freqs, rotary_interleaved, multi_latent_attention, mscale)
    cos_, sin_ = _tables(freqs, t.dtype, mscale)
    rotate_half = _MEGATRON["rotate_half"]
    rot_dim = freqs.shape[-1]
    if t.shape[-1] == rot_dim:
        return (t * cos_) + (rotate_half(t, False) * sin_)
    head, rest = t[..., :rot_dim], t[..., rot_dim:]
    return torch.cat(((head * cos_) + (rotate_half(head, False) * sin_), rest), dim=-1)


def _tables(freqs: torch.Tensor, dtype: torch.dtype, mscale: float) -> tuple:
    """``(cos(freqs) * mscale, sin(freqs) * mscale)`` in ``dtype``, as megatron computes them."""
    global _last
    last = _last
    if (
        last is not None
        and last[0] is freqs
        and last[1] == freqs._version
        and last[2] == dtype
        and last[3] == mscale
    ):
        return last[4], last[5]
    cos_ = (torch.cos(freqs) * mscale).to(dtype)
    sin_ = (torch.sin(freqs) * mscale).to(dtype)
    _last = (freqs, freqs._version, dtype, mscale, cos_, sin_)
    return cos_, sin_


def use_rope_tables() -> None:
    """Make megatron's unfused RoPE call `rotary_bshd` (idempotent; process-wide)."""
    rope = importlib.import_module(ROPE)
    current = rope._apply_rotary_pos_emb_bshd
    if current is not rotary_bshd:
        _MEGATRON["bshd"] = current
        _MEGATRON["rotate_half"] = rope._rotate_half
        rope._apply_rotary_pos_emb_bshd = rotary_bshd
