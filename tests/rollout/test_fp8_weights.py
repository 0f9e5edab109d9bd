"""FP8 serving: e4m3 weights per output channel, the router and norms untouched, idempotent."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.model.presets import preset_config
from megatron_rl.rollout import InProcessEngine, InProcessEngineConfig
from megatron_rl.rollout.fp8_weights import E4M3_MAX, is_quantized, quantize_dequantize_
from megatron_rl.rollout.route_capture import RouteCapture


def _on_e4m3_grid(weight: torch.Tensor) -> bool:
    """Every row is a power of two times e4m3 values (the scale recovered from the row)."""
    w = weight.float()
    amax = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)  # an all-zero row: any scale
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    q = w / scale
    return torch.equal(q.to(torch.float8_e4m3fn).float(), q)


def test_rows_round_to_e4m3_within_its_precision_and_rounding_again_changes_nothing():
    weight = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(0))
    weight[1, 2] = 0.0  # an all-zero row stays zero
    rounded = quantize_dequantize_(weight.clone())
    assert _on_e4m3_grid(rounded) and not torch.equal(rounded, weight)
    assert torch.equal(rounded[1, 2], torch.zeros(40))
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for values in its normal range
    normal = weight.abs() > weight.abs().amax(dim=-1, keepdim=True) / 2**6
    rel = ((rounded - weight).abs() / weight.abs())[normal]
    assert float(rel.max()) <= 2**-4
    for dtype in (torch.float32, torch.bfloat16):
        stored = rounded.to(dtype)
        assert torch.equal(stored.float(), rounded)  # exact in bf16 (power-of-two scales)
        assert torch.equal(quantize_dequantize_(stored.clone()), stored)


@pytest.mark.parametrize(
    ("name", "rounded"),
    [
        ("model.layers.0.self_attn.q_proj.weight", True),
        ("model.layers.3.self_attn.o_proj.weight", True),
        ("model.layers.0.mlp.experts.gate_up_proj", True),
        ("model.layers.0.mlp.experts.down_proj", True),
        ("model.layers.0.mlp.experts.7.up_proj.weight", True),
        ("model.layers.0.mlp.down_proj.weight", True),
        ("model.layers.0.mlp.gate.weight", False),  # the router stays as served
        ("model.layers.0.self_attn.q_norm.weight", False),
        ("model.layers.0.input_layernorm.weight", False),
        ("model.embed_tokens.weight", False),
        ("lm_head.weight", False),
    ],
)
def test_attention_and_mlp_matrices_are_rounded_router_norms_and_embeddings_are_not(name, rounded):
    assert is_quantized(name) is rounded


def test_a_float8_engine_serves_rounded_weights_after_every_load_and_routes_differently():
    hf = preset_config("tiny-mismatch")
    fp8 = InProcessEngine.from_hf_config(hf, InProcessEngineConfig(dtype="float8"), seed=0)
    ref = InProcessEngine.from_hf_config(hf, InProcessEngineConfig(dtype="float32"), seed=0)
    source = {n: p.detach().clone() for n, p in ref.model.named_parameters()}
    for engine in (fp8, ref):
        engine.update_weights(source.items(), version=1)
    params = dict(fp8.model.named_parameters())
    for name, param in params.items():
        assert param.dtype == torch.bfloat16
        if is_quantized(name):
            assert _on_e4m3_grid(param.detach()), name
        else:
            assert torch.equal(param.detach(), source[name].to(torch.bfloat16)), name
    tokens = torch.randint(1, hf.vocab_size, (4, 24), generator=torch.Generator().manual_seed(1))
    routes = []
    for engine in (fp8, ref):
        with torch.no_grad(), RouteCapture(engine.model, 4) as capture:
            engine.model(tokens)
        routes.append(capture.routes_BTLK().sort(dim=-1).values)
    same_set = (routes[0] == routes[1]).all(dim=-1).float().mean()
    assert 0.5 < float(same_set) < 0.97  # at initialisation a fifth of token-layers differ
