"""Every HF name the weight sync sends for DeepSeek-V3 and GLM-4.5 is one SGLang 0.5.23 loads.

The names come from our exporter (`iter_hf_tensors`, what the weight sync streams) on the tiny
presets at world size 1. SGLang's side is read from its installed source (`sglang_source`):
the loader's ``stacked_params_mapping`` literal (gate/up -> ``gate_up_proj``; GLM's q/k/v ->
``qkv_proj``), the checkpoint names its ``FusedMoE.make_expert_params_mapping`` call expects for
the routed experts (``experts.{e}.{gate,up,down}_proj.``), DeepSeek's fusion of ``q_a_proj`` and
``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj_with_mqa``, and the module attributes its model
file defines (``self.<name> = ...``). After SGLang's own renaming, each dotted part of every name
(layer indices aside) must be an attribute of SGLang's model, or a parameter leaf (``weight``,
``e_score_correction_bias``) it defines.
"""

from __future__ import annotations

import ast
import re

import pytest
from sglang_source import sglang_path

from megatron_rl.model import build_model, preset_config
from megatron_rl.model.conversion import iter_hf_tensors

DEEPSEEK = ("srt/models/deepseek_v2.py", "srt/models/deepseek_common/deepseek_weight_loader.py")
GLM = ("srt/models/glm4_moe.py", "srt/models/glm4_moe.py")
LEAVES = {"weight", "bias"}  # the parameters of SGLang's linear and norm layers


def _tree(relative: str) -> ast.Module:
    return ast.parse(sglang_path(relative).read_text(encoding="utf-8"))


def _self_attributes(relative: str) -> set[str]:
    """Every ``self.<name>`` assigned in ``sglang/<relative>``."""
    names = set()
    for node in ast.walk(_tree(relative)):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:  # ``self.layers, self.start_layer, ... = make_layers(...)``
                for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(item, ast.Attribute) and getattr(item.value, "id", "") == "self":
                        names.add(item.attr)
    return names


def _loader_mappings(relative: str) -> tuple[list[tuple], dict[str, str]]:
    """The loader's ``stacked_params_mapping`` and its expert-mapping checkpoint names."""
    stacked, experts = None, {}
    for node in ast.walk(_tree(relative)):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == (
            "stacked_params_mapping"
        ):
            stacked = ast.literal_eval(node.value)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == (
            "make_expert_params_mapping"
        ):
            experts = {k.arg: k.value.value for k in node.keywords if k.arg.startswith("ckpt_")}
    assert stacked and set(experts) == {
        "ckpt_gate_proj_name", "ckpt_up_proj_name", "ckpt_down_proj_name",
    }, (stacked, experts)  # fmt: skip
    return stacked, experts


def _sglang_name(name: str, stacked, experts: dict[str, str], fused_a: bool) -> str | None:
    """The parameter path SGLang loads ``name`` into (None: a routed expert, FusedMoE's)."""
    expert = re.search(r"mlp\.experts\.\d+\.(\w+)\.", name)
    if expert:  # the expert branch: experts.{e}.{ckpt name}.
        assert expert.group(1) in experts.values(), name
        return None
    for param_name, weight_name, _ in stacked:
        if weight_name in name:
            return name.replace(weight_name, param_name)
    if fused_a and ("q_a_proj" in name or "kv_a_proj_with_mqa" in name):
        return re.sub(r"q_a_proj|kv_a_proj_with_mqa", "fused_qkv_a_proj_with_mqa", name)
    return name


@pytest.mark.parametrize(("preset", "files"), [("tiny-deepseek", DEEPSEEK), ("tiny-glm", GLM)])
def test_every_exported_name_is_one_sglangs_loader_maps(ws1, preset, files):
    model_file, loader_file = files
    attributes = _self_attributes(model_file) | LEAVES
    stacked, experts = _loader_mappings(loader_file)
    loader_text = sglang_path(loader_file).read_text(encoding="utf-8")
    fused_a = preset == "tiny-deepseek"
    if fused_a:  # the fusion this test models is SGLang's
        assert '"q_a_proj", "fused_qkv_a_proj_with_mqa"' in loader_text
        assert "fused_qkv_a_proj_with_mqa" in attributes
    config = preset_config(preset)
    names = [name for name, _ in iter_hf_tensors(build_model(config), config)]
    assert any("e_score_correction_bias" in n for n in names)
    assert any("shared_experts" in n for n in names)
    unknown = []
    for name in names:
        mapped = _sglang_name(name, stacked, experts, fused_a)
        if mapped is None:
            continue
        parts = [p for p in mapped.split(".") if not p.isdigit()]
        missing = [p for p in parts if p not in attributes]
        if missing:
            unknown.append(f"{name} -> {mapped}: {missing}")
    assert not unknown, "\n".join(unknown)


def test_the_exporters_deepseek_stream_keeps_each_layers_q_a_and_kv_a_in_one_bucket(ws1):
    """The weight sync's real stream of a q-LoRA MLA model (the exporter, in its own order: q_a,
    q_a_layernorm, q_b, kv_a, ...) cut at every bucket size from one tensor's to the whole
    model's: no layer's q_a_proj / kv_a_proj_with_mqa pair is ever split across buckets
    (SGLang fuses the pair only within one load call, see test_sglang_contract_flat_bucket)."""
    from megatron_rl.rollout.flat_bucket import flat_buckets, fuse_group

    config = preset_config("tiny-deepseek")
    stream = list(iter_hf_tensors(build_model(config), config))
    grouped = [n for n, _ in stream if fuse_group(n)]
    assert len(grouped) == 2 * config.num_hidden_layers, grouped
    sizes = sorted({t.numel() * t.element_size() for _, t in stream})
    total = sum(sizes)
    for bucket_bytes in sorted({*sizes, *range(sizes[0], total + 1, max(1, total // 97))}):
        where = {}
        for k, bucket in enumerate(flat_buckets(stream, bucket_bytes)):
            where.update({n: k for n, _ in bucket})
        assert len(where) == len(stream)
        for name in grouped:
            partner = re.sub(
                r"q_a_proj|kv_a_proj_with_mqa",
                lambda m: "kv_a_proj_with_mqa" if m.group() == "q_a_proj" else "q_a_proj",
                name,
            )
            assert where[name] == where[partner], (bucket_bytes, name)
