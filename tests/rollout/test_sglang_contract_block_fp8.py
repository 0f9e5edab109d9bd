"""Block-FP8 export against SGLang's own dequantisation and loader (read from the pinned source).

SGLang's ``block_quant_dequant`` (``srt/layers/quantization/fp8_utils.py``, compiled from its
source) turns our (Q, S) into the same weight as our `dequantize`, within the e4m3 rounding bound
of the original; the names, dtypes and scale shapes are those ``Fp8LinearMethod.create_weights``
registers for ``weight_block_size: [128, 128]``.
"""

from __future__ import annotations

import ast

import pytest
import torch
from sglang_source import class_node, load_function, sglang_path

from megatron_rl.model.conversion import block_fp8

FP8_UTILS = "srt/layers/quantization/fp8_utils.py"
FP8 = "srt/layers/quantization/fp8.py"
SHAPES = [(300, 200), (256, 128), (1, 5), (129, 384)]  # edge blocks, exact blocks, a sliver


def sglang_dequant():
    return load_function(FP8_UTILS, "block_quant_dequant", {"torch": torch, "List": list})


def weight(shape, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=generator) * 0.02
    w[: min(shape[0], 3), : min(shape[1], 3)] *= 100  # one block with a far larger range
    return w.bfloat16()


@pytest.mark.parametrize("shape", SHAPES)
def test_sglangs_dequantisation_equals_ours_within_the_e4m3_bound(shape):
    w = weight(shape)
    q, s = block_fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == (-(-shape[0] // 128), -(-shape[1] // 128))
    theirs = sglang_dequant()(q, s, [128, 128], torch.float32)
    ours = block_fp8.dequantize(q, s)
    assert torch.equal(theirs, ours)
    s_rep = block_fp8.expand(s, shape, (128, 128))
    bound = s_rep * (w.float().abs() / s_rep * 2**-4 + 2**-10)
    error = (w.float() - ours).abs()
    assert bool((error <= bound * (1 + 1e-6)).all()), float((error - bound).max())
    assert float(error.max()) <= float(w.float().abs().max()) / 16


def test_an_edge_block_is_scaled_by_the_elements_it_holds():
    """The partial block at the lower right: its scale is its own amax / 448, not diluted or
    padded (SGLang cuts the repeated scale to the weight's shape)."""
    w = weight((300, 200)).float()
    _, s = block_fp8.quantize(w)
    assert s[2, 1] == w[256:, 128:].abs().amax() / 448
    assert s[0, 0] == w[:128, :128].abs().amax() / 448


def test_a_zero_block_stays_zero_and_nan_is_refused():
    w = torch.zeros(130, 130)
    w[129, 129] = 1.0
    q, s = block_fp8.quantize(w)
    assert torch.equal(block_fp8.dequantize(q, s), w)
    w[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        block_fp8.quantize(w)


def test_names_and_shapes_are_what_sglangs_fp8_block_loader_registers():
    """``Fp8LinearMethod.create_weights`` (checkpoint FP8, block quant) registers ``weight``
    in float8_e4m3fn and ``weight_scale_inv`` float32 of ``ceil(out/bn) x ceil(in/bk)``;
    ``Fp8Config.from_config`` takes the keys our ``quantization_config`` gives, and block
    quantisation needs the dynamic activation scheme."""
    source = ast.unparse(class_node(FP8, "Fp8LinearMethod"))
    assert "layer.register_parameter('weight_scale_inv', scale)" in source
    assert "(output_size_per_partition + block_n - 1) // block_n" in source
    assert "(input_size_per_partition + block_k - 1) // block_k" in source
    assert "torch.float8_e4m3fn if is_checkpoint_fp8_serialized else params_dtype" in source
    config = ast.unparse(class_node(FP8, "Fp8Config"))
    for key in ("quant_method", "activation_scheme", "weight_block_size"):
        assert f"['{key}']" in config
    assert "is_checkpoint_fp8_serialized = 'fp8' in quant_method" in config
    assert block_fp8.quantization_config() == {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]
    }  # fmt: skip
    moe = sglang_path(FP8).read_text()
    assert "w13_weight_scale_inv" in moe and "w2_weight_scale_inv" in moe


def test_linear_weights_are_quantised_and_embeddings_norms_head_and_router_are_not():
    """SGLang builds the router of Qwen3-MoE without a quant config (``gate_quant_config`` is
    None unless the checkpoint is modelslim) and its embeddings/head are not LinearBase."""
    qwen3 = sglang_path("srt/models/qwen3_moe.py").read_text()
    assert "quant_config=gate_quant_config" in qwen3
    m = torch.zeros(4, 4)
    quantized = [
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.shared_experts.up_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    ]  # fmt: skip
    kept = [
        "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
        "model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.mlp.gate.e_score_correction_bias", "model.layers.0.self_attn.q_proj.bias",
    ]  # fmt: skip
    assert all(block_fp8.is_quantized(n, m) for n in quantized)
    assert not any(block_fp8.is_quantized(n, m) for n in kept)
    out = dict(block_fp8.quantize_stream([(quantized[0], m), (kept[0], m)]))
    assert list(out) == [quantized[0], quantized[0] + "_scale_inv", kept[0]]
    assert out[kept[0]] is m
