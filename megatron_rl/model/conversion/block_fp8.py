"""Block-FP8 weights as SGLang loads a pre-quantised checkpoint (``quantization_config`` with
``quant_method: fp8``, ``weight_block_size: [128, 128]``, ``activation_scheme: dynamic``).

For a linear weight ``W`` of shape ``[N, K]`` (out, in) and blocks of ``bn x bk``:

    S[i, j] = max(amax(|W[i*bn:(i+1)*bn, j*bk:(j+1)*bk]|), tiny) / 448      (float32)
    Q       = e4m3fn(clamp(W / S_rep, -448, 448))                             (round to nearest)
    W      ~= Q * S_rep,  S_rep = S repeated bn times along rows, bk along columns, cut to [N, K]

``S`` is ``[ceil(N/bn), ceil(K/bk)]``; a block at the lower or right edge is the partial block
(its amax over the elements that exist), which is what SGLang's ``block_quant_dequant``
(``srt/layers/quantization/fp8_utils.py``) undoes: it repeats each scale over a full block and
cuts the result to ``[N, K]``. 448 is e4m3fn's largest finite value. The checkpoint names the
scale ``<module>.weight_scale_inv`` (SGLang multiplies by it: it is the inverse of the
quantisation scale ``448 / amax``).

Rounding error: e4m3 keeps 3 mantissa bits, so ``|W - Q S| <= S (|W/S| 2^-4 + 2^-10)``
elementwise (relative 2^-4 for normal values, half the subnormal spacing 2^-10 of ``S`` below
2^-6).

Which weights: SGLang's ``Fp8Config`` quantises its ``LinearBase`` layers and ``FusedMoE``
experts; embeddings and the LM head (``VocabParallelEmbedding``), norms and the MoE router
(``ReplicatedLinear`` built without a quant config in Qwen3-MoE; a plain module in DeepSeek)
stay in the checkpoint's dtype. `QUANTIZED_MODULES` names those linear modules by their HF name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"  # "<module>.weight" -> "<module>.weight_scale_inv"
# HF names of the linear modules SGLang builds as quantised layers (Qwen3-MoE, DeepSeek-V3,
# GLM-4-MoE: attention, MLA projections, dense MLP, shared and routed experts)
QUANTIZED_MODULES = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
     "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"}
)  # fmt: skip


def quantization_config(block: tuple[int, int] = BLOCK) -> dict:
    """The ``config.json`` entry SGLang reads (``Fp8Config.from_config``)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """A 2-D floating ``<...>.<module>.weight`` of a module in `QUANTIZED_MODULES`."""
    parts = name.split(".")
    return (
        len(parts) >= 2
        and parts[-1] == "weight"
        and parts[-2] in QUANTIZED_MODULES
        and tensor.dim() == 2
        and tensor.is_floating_point()
    )


def quantize(
    weight: torch.Tensor, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] (any float dtype) -> (Q [N, K] float8_e4m3fn, S [ceil(N/bn), ceil(K/bk)]
    float32) by the formula of the module docstring. Raises ValueError on NaN or Inf."""
    if weight.dim() != 2:
        raise ValueError(f"block-FP8 quantizes 2-D weights, got shape {tuple(weight.shape)}")
    bn, bk = block
    n, k = weight.shape
    rows, cols = -(-n // bn), -(-k // bk)
    w = weight.detach().float()
    padded = w.new_zeros(rows * bn, cols * bk)
    padded[:n, :k] = w  # zeros never raise a block's amax
    amax = padded.abs().view(rows, bn, cols, bk).amax(dim=(1, 3))
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("block-FP8: the weight holds NaN or Inf")
    scale = amax.clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    q = (w / expand(scale, (n, k), block)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK, dtype=torch.float32
) -> torch.Tensor:
    """``Q * S_rep`` in ``dtype``: the weight SGLang computes with."""
    return (q.float() * expand(scale, tuple(q.shape), block)).to(dtype)


def expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """S [R, C] repeated over its blocks and cut to ``shape`` [N, K]."""
    rep = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return rep[: shape[0], : shape[1]]


def quantize_stream(
    stream: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int] = BLOCK
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs with each `is_quantized` weight replaced by
    ``(name, Q)`` and ``(name + "_scale_inv", S)`` (on the weight's device); the rest as is."""
    for name, tensor in stream:
        if not is_quantized(name, tensor):
            yield name, tensor
            continue
        try:
            q, scale = quantize(tensor, block)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
        yield name, q
        yield name + SCALE_SUFFIX, scale
