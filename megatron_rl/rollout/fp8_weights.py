"""FP8 serving of the in-process engine: weights rounded to float8 e4m3, compute in bf16.

RL stacks often serve rollouts from an FP8 copy of the bf16/fp32 policy (slime, verl and
NeMo-RL offer FP8 rollouts; Qwen3-30B-A3B-FP8 is such a checkpoint). The engine then disagrees
with the trainer far more than bf16 alone: e4m3 keeps 3 mantissa bits (relative rounding up to
2**-4) against bf16's 7 (2**-8), so the hidden states that reach each router drift further
and more top-k choices flip.

`quantize_dequantize_` rounds a weight to e4m3 with one scale per output channel (row), the
power of two ``scale = 2**ceil(log2(amax(|w_row|) / 448))`` (448 = e4m3's largest finite value;
a power-of-two scale as MXFP8's E8M0 scales), and stores ``q * scale`` back in the weight's own
dtype: what an FP8 GEMM computes, up to the accumulation order. ``q * scale`` is exact in bf16
(4 significant bits times a power of two), so rounding again changes nothing: the engine rounds
the whole model after every (partial) weight load. As in
the FP8 checkpoints of Qwen3-MoE, the router (``mlp.gate``), norms, embeddings and LM head stay
unquantized: only attention projections and expert/dense MLP matrices are rounded.

Approximation, stated: weights only (W8A16). SGLang's FP8 kernels also round activations per
token group (W8A8); this engine keeps bf16 activations, so its mismatch is a lower bound of
real FP8 serving's.
"""

from __future__ import annotations

import re

import torch

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_QUANTIZED = re.compile(
    r"\.(self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight"
    r"|mlp\.experts\.(gate_up_proj|down_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight"
    r"|mlp\.(gate_proj|up_proj|down_proj)\.weight)$"
)


def is_quantized(name: str) -> bool:
    """Whether FP8 serving rounds the in-memory parameter ``name`` (router, norms: no)."""
    return _QUANTIZED.search(name) is not None


@torch.no_grad()
def quantize_dequantize_(weight: torch.Tensor) -> torch.Tensor:
    """Round ``weight`` [..., out, in] to e4m3 per row (last dim) in place; returns it.

    An all-zero row stays zero. Idempotent in fp32 and bf16 (power-of-two scales).
    """
    w = weight.float()
    amax_O1 = w.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    scale_O1 = torch.exp2(torch.ceil(torch.log2(amax_O1 / E4M3_MAX)))
    q = (w / scale_O1).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    weight.copy_(q.float() * scale_O1)
    return weight


def quantize_model_(model: torch.nn.Module) -> int:
    """Round every FP8-served parameter of ``model`` in place; returns how many."""
    count = 0
    for name, param in model.named_parameters():
        if is_quantized(name):
            quantize_dequantize_(param.data)
            count += 1
    if count == 0:
        raise ValueError("FP8 serving: the model has no attention or MLP matrix to quantize")
    return count
