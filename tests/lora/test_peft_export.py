"""The PEFT export against the real ``peft`` package: the adapters of a megatron policy, loaded by
``PeftModel.from_pretrained`` onto transformers' model of the base checkpoint, give the megatron
policy's logits (the families' parity bound, fp32); PEFT's ``merge_and_unload`` equals the
merged HF export tensor by tensor. Qwen3-MoE, DeepSeek-V3 and GLM-4.5 on configs no other test
uses; attention only and every linear layer (dense MLP, shared and routed experts, per expert
and shared)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
from qwen3_moe_testing import spawn_ranks
from safetensors.torch import load_file

from megatron_rl.backend import ParallelConfig, init_distributed
from megatron_rl.lora.apply import add_adapters
from megatron_rl.lora.config import LoRAConfig
from megatron_rl.lora.experts import LoRAGroupedExperts
from megatron_rl.lora.peft_export import save_peft_adapter
from megatron_rl.model import build_model
from megatron_rl.model.builder import causal_lm_logits
from megatron_rl.model.conversion import save_checkpoint
from megatron_rl.model.conversion.seeded_init import init_from_seed
from megatron_rl.model.presets import hf_causal_lm_class, preset_config

peft = pytest.importorskip("peft")

ATOL = 1e-5  # the families' fp32 parity bound (tests/model/test_hf_parity.py)
CONFIGS = {  # family -> (preset, overrides no other test uses)
    "qwen3-moe": ("tiny", dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8)),
    "deepseek-v3": ("tiny-deepseek", dict(num_attention_heads=2)),
    "glm-4.5": ("tiny-glm", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8)),
}


def _adapted(tmp_path, family: str, targets: str, experts: str = "per-expert"):
    """A seeded megatron model of ``family``, its base exported to ``base/``, adapters with B
    away from 0; its logits on random ids, its PEFT export (``adapter/``) and its merged HF
    export (``merged/``)."""
    preset, overrides = CONFIGS[family]
    hf_config = preset_config(preset, **overrides)
    model = build_model(hf_config)
    init_from_seed(model, hf_config, seed=5)
    save_checkpoint(model, hf_config, tmp_path / "base")
    lora = LoRAConfig(lora_rank=4, lora_alpha=8, lora_targets=targets, lora_experts=experts)
    add_adapters(model, lora, seed=2)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # a trained adapter: B away from 0
        for name, param in model.named_parameters():
            if ".lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    ids = torch.randint(0, hf_config.vocab_size, (2, 11), generator=gen)
    model.eval()
    with torch.no_grad():
        logits = causal_lm_logits(model, ids)
    save_peft_adapter(model, hf_config, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    save_checkpoint(model, hf_config, tmp_path / "merged")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    return hf_config, ids, logits, config


def _hf(hf_config, folder):
    return hf_causal_lm_class(hf_config).from_pretrained(folder, dtype=torch.float32).eval()


CASES = {  # name -> (family, targets, expert adapters)
    **{f"{f}-attention": (f, "attention", "per-expert") for f in CONFIGS},
    # q/k/v or MLA's up-projections, o_proj, the dense MLP, shared and routed experts
    **{f"{f}-all-linear": (f, "all_linear", "per-expert") for f in CONFIGS},
    "deepseek-v3-all-linear-shared": ("deepseek-v3", "all_linear", "shared"),
}


@pytest.mark.parametrize("case", CASES)
def test_peft_loads_the_adapters_and_merges_as_the_export_does(ws1, tmp_path, case):
    """PEFT adapts exactly the exported weights (no layer of the same leaf name elsewhere, no
    dense MLP retargeted onto the routed experts), its model gives the megatron logits, and its
    ``merge_and_unload`` equals transformers' model of the merged export, tensor by tensor."""
    family, targets, experts = CASES[case]
    hf_config, ids, want, config = _adapted(tmp_path, family, targets, experts)
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    exported = set(config["target_parameters"])
    if targets == "all_linear":
        assert any(t.endswith("experts.gate_up_proj") for t in exported)
        if family != "qwen3-moe":  # DeepSeek-V3 and GLM-4.5 have dense layers, shared experts
            assert any(t.endswith("shared_experts.gate_proj.weight") for t in exported)
            assert any(t.endswith("mlp.down_proj.weight") for t in exported)
    peft_model = peft.PeftModel.from_pretrained(
        _hf(hf_config, tmp_path / "base"), tmp_path / "adapter"
    )
    adapted = {
        n.removeprefix("base_model.model.").split(".lora_A")[0]
        for n, _ in peft_model.named_parameters()
        if ".lora_A." in n
    }
    holders = {t.removesuffix(".weight").rsplit(".", 1)[0] for t in exported if ".experts." in t}
    dense = {t.removesuffix(".weight") for t in exported if ".experts." not in t}
    want_adapted = dense | {f"{h}.base_layer" for h in holders} | holders
    assert adapted == want_adapted  # these, no other
    with torch.no_grad():
        got = peft_model.eval()(input_ids=ids).logits
        base = _hf(hf_config, tmp_path / "base")(input_ids=ids).logits
    diff = (got - want).abs().max().item()
    print(f"{case}: max |PEFT - megatron| {diff:.2e}")
    assert diff < ATOL
    assert (want - base).abs().max() > 100 * ATOL  # the adapters change the logits
    merged = peft_model.merge_and_unload().state_dict()
    reference = _hf(hf_config, tmp_path / "merged").state_dict()
    assert set(merged) == set(reference)
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-6, rtol=0, msg=name)


def _seeded_export(folder) -> None:
    """``tiny`` with ``all_linear`` adapters whose ``B`` is drawn whole per tensor (seeded by its
    name) and sliced to this rank's experts, exported to ``folder``: the same adapters at every
    expert-parallel layout."""
    hf_config = preset_config("tiny")
    model = build_model(hf_config)
    init_from_seed(model, hf_config, seed=5)
    add_adapters(model, LoRAConfig(lora_rank=4, lora_alpha=8, lora_targets="all_linear"), seed=2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B" not in name:
                continue
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            module = model.get_submodule(name.rpartition(".")[0])
            if isinstance(module, LoRAGroupedExperts):  # [E_local, out, r] of the global stack
                group, local = module.base.ep_group, param.shape[0]
                whole = torch.randn((local * group.size(), *param.shape[1:]), generator=gen)
                param.copy_(whole[group.rank() * local : (group.rank() + 1) * local])
            else:
                param.copy_(torch.randn(param.shape, generator=gen))
    save_peft_adapter(model, hf_config, folder)


def _ep_worker(rank, world_size, init_method, tmp_dir) -> None:
    init_distributed(
        ParallelConfig(expert_parallel=world_size),
        rank=rank,
        world_size=world_size,
        init_method=init_method,
        device="cpu",
    )
    _seeded_export(Path(tmp_dir) / "ep2")


@pytest.mark.slow  # two spawned ranks each import megatron-core
@pytest.mark.distributed
def test_expert_parallel_ranks_export_the_world_1_adapter(ws1, tmp_path):
    """Routed-expert adapters split over two EP ranks are gathered in global expert order: the
    export equals world 1's tensor for tensor, and so does its config."""
    _seeded_export(tmp_path / "ep1")
    spawn_ranks(_ep_worker, tmp_path, 2)
    want, got = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("ep1", "ep2"))
    assert set(got) == set(want) and any(".experts." in k for k in want)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
    configs = [(tmp_path / d / "adapter_config.json").read_text() for d in ("ep1", "ep2")]
    assert configs[0] == configs[1]
