"""Grouped experts (`TorchGroupedMLP`) compute what megatron's SequentialMLP computes, bit for bit,
and convert to and from HF checkpoints exactly as it does."""

from __future__ import annotations

import pytest
import torch
from qwen3_moe_testing import fixed_input_ids, make_hf_checkpoint, tiny_config

from megatron_rl.model import build_model
from megatron_rl.model.config import ModelOptions
from megatron_rl.model.conversion import load_checkpoint
from megatron_rl.model.conversion.export import iter_hf_tensors
from megatron_rl.model.conversion.names import rank_tensor_maps
from megatron_rl.model.conversion.sharding import model_layout_name
from megatron_rl.model.grouped_experts import TorchGroupedMLP, expert_weight_views


def _expert_modules(model) -> list[type]:
    return [type(layer.mlp.experts) for layer in model.decoder.layers]


def _models(config, folder):
    """(grouped, sequential) megatron models of ``config`` loaded from the same HF checkpoint."""
    grouped = build_model(config, ModelOptions(moe_grouped_gemm=True))
    sequential = build_model(config, ModelOptions(moe_grouped_gemm=False))
    for model in (grouped, sequential):
        load_checkpoint(model, folder, config)
    return grouped, sequential


def _forward_backward(model, config, input_ids):
    """Logits and, per canonical tensor name, its gradient for a fixed scalar of the logits."""
    model.zero_grad(set_to_none=True)
    position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None)
    weights = torch.linspace(-1.0, 1.0, logits.numel()).view_as(logits)
    (logits.float() * weights).sum().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    for prefix, module in model.named_modules():
        if isinstance(module, TorchGroupedMLP):
            del grads[f"{prefix}.weight1"], grads[f"{prefix}.weight2"]
            grads.update(expert_weight_views(module, f"{prefix}.", gradients=True))
    maps = rank_tensor_maps(config, model_layout_name(model))
    return logits.detach(), {tmap.canonical: grads[tmap.param] for tmap in maps}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grouped_experts_forward_and_gradients_bitwise_equal_sequential(ws1, tmp_path, dtype):
    config = tiny_config()
    make_hf_checkpoint(str(tmp_path / "hf"), config)
    options = {"dtype": dtype}
    grouped = build_model(config, ModelOptions(moe_grouped_gemm=True, **options))
    sequential = build_model(config, ModelOptions(moe_grouped_gemm=False, **options))
    assert set(_expert_modules(grouped)) == {TorchGroupedMLP}
    assert TorchGroupedMLP not in _expert_modules(sequential)
    for model in (grouped, sequential):
        load_checkpoint(model, tmp_path / "hf", config)
    input_ids = fixed_input_ids(config.vocab_size)
    logits_g, grads_g = _forward_backward(grouped, config, input_ids)
    logits_s, grads_s = _forward_backward(sequential, config, input_ids)
    assert torch.equal(logits_g, logits_s)
    assert grads_g.keys() == grads_s.keys()
    for name, grad in grads_s.items():
        assert torch.equal(grads_g[name], grad), name


def test_grouped_experts_export_the_same_hf_names_shapes_and_bytes(ws1, tmp_path):
    config = tiny_config()
    make_hf_checkpoint(str(tmp_path / "hf"), config)
    grouped, sequential = _models(config, tmp_path / "hf")
    exported_g = list(iter_hf_tensors(grouped, config, experts_last=True))
    exported_s = list(iter_hf_tensors(sequential, config, experts_last=True))
    assert [name for name, _ in exported_g] == [name for name, _ in exported_s]
    for (name, tensor_g), (_, tensor_s) in zip(exported_g, exported_s, strict=True):
        assert tensor_g.is_contiguous(), name
        assert tensor_g.dtype == tensor_s.dtype and tensor_g.shape == tensor_s.shape, name
        assert torch.equal(tensor_g, tensor_s), name


def test_grouped_experts_stack_each_layers_experts_in_two_parameters(ws1):
    config = tiny_config()
    grouped = build_model(config, ModelOptions(moe_grouped_gemm=True))
    sequential = build_model(config, ModelOptions(moe_grouped_gemm=False))
    count = lambda m: sum(1 for _ in m.parameters())  # noqa: E731
    moe_layers = len(grouped.decoder.layers)
    assert count(sequential) - count(grouped) == moe_layers * (2 * config.num_experts - 2)


def test_grouped_experts_without_tokens_keep_their_input_and_weights_in_the_graph(ws1):
    config = tiny_config()
    model = build_model(config, ModelOptions(moe_grouped_gemm=True))
    experts = model.decoder.layers[0].mlp.experts
    hidden = torch.zeros(0, config.hidden_size, requires_grad=True)
    counts = torch.zeros(experts.num_local_experts, dtype=torch.int64)
    probs = torch.zeros(0, requires_grad=True)
    out, _ = experts(hidden, counts, probs)
    out.sum().backward()
    assert out.shape == (0, config.hidden_size)
    assert torch.count_nonzero(experts.weight1.grad) == 0
    assert experts.weight2.grad is not None
    # the backward reaches both inputs: under EP their producers are the dispatcher's
    # all-to-alls, which every rank must run
    assert hidden.grad is not None and probs.grad is not None


def _seeded_model(config, grouped: bool):
    """A model built right after megatron's seeding (as `init_distributed` seeds)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return build_model(config, ModelOptions(moe_grouped_gemm=grouped))


def test_grouped_experts_initialise_the_weights_sequential_experts_get(ws1):
    config = tiny_config()
    exported_g = dict(iter_hf_tensors(_seeded_model(config, True), config))
    exported_s = dict(iter_hf_tensors(_seeded_model(config, False), config))
    assert exported_g.keys() == exported_s.keys()
    for name, tensor in exported_s.items():
        assert torch.equal(exported_g[name], tensor), name


def test_grouped_experts_refuse_rows_torch_cannot_group_and_name_the_fix(ws1):
    config = tiny_config(moe_intermediate_size=6)  # 24-byte fp32 rows
    with pytest.raises(ValueError, match=r"16 bytes.*--no-moe-grouped-gemm"):
        build_model(config, ModelOptions(moe_grouped_gemm=True))
    build_model(config, ModelOptions(moe_grouped_gemm=False))  # the loop takes any width
