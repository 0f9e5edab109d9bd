r"""The policy's adapters in PEFT's format: ``adapter_model.safetensors`` + ``adapter_config.json``,
which ``peft.PeftModel.from_pretrained`` loads onto the HF model of the base checkpoint.

Names and layouts follow the base weight's conversion (`megatron_rl.model.conversion`): each
adapted megatron layer maps to the HF module(s) its weight maps to. ``B`` has the weight's rows,
so it is gathered over tensor parallelism and split into HF tensors exactly as the weight is
(fused q/k/v into ``q_proj``/``k_proj``/``v_proj`` per query group, gate+up into
``gate_proj``/``up_proj``); ``A`` has the weight's columns, so a row-parallel layer's ``A`` is
gathered as its weight is, and a fused layer's one ``A`` is each HF module's ``lora_A``. A fused
layer's adapter is thus exactly a PEFT adapter per HF module whose ``A`` factors are equal.

Target modules are one regular expression of the full HF paths (``model\.layers\.0\.self_attn
\.q_proj|...``), which PEFT matches against whole module names: it adapts exactly the exported
modules and never, say, a routed expert that shares a suffix. (Given as a list, peft 0.21 with
transformers 5 maps the names through transformers' checkpoint conversions and was measured to
adapt DeepSeek-V3's fused routed experts instead of its shared experts.)
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import torch

from megatron_rl.atomic_io import atomic_write_text
from megatron_rl.lora.layers import COLUMN, LoRALinear
from megatron_rl.model.conversion.names import rank_tensor_maps
from megatron_rl.model.conversion.safetensors_io import atomic_save_file
from megatron_rl.model.conversion.sharding import (
    all_gather,
    model_layout_name,
    model_rank_layout,
    shard_coords,
)
from megatron_rl.model.conversion.transforms import split, unshard
from megatron_rl.model.presets import load_hf_config

PEFT_PREFIX = "base_model.model."


def adapted_layers(model: torch.nn.Module) -> dict[str, LoRALinear]:
    """``{layer name: adapter}`` of ``model``'s adapted layers."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def iter_peft_tensors(model: torch.nn.Module, hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """``(f"{HF module path}.lora_A", A)`` and ``(... .lora_B, B)`` for every adapted layer of
    this pipeline stage, gathered over tensor parallelism (a collective: every rank of the stage
    calls it)."""
    cfg = load_hf_config(hf_config)
    layers = adapted_layers(model)
    rank = model_rank_layout(model)
    for tmap in rank_tensor_maps(cfg, model_layout_name(model), rank):
        layer = tmap.param.removesuffix(".weight")
        if layer not in layers or tmap.param == layer:
            continue
        adapter = layers[layer]
        if adapter.kind == COLUMN:  # B split like the weight's rows, A whole
            a_parts = [adapter.lora_A.detach()] * len(tmap.hf)
            b_parts = split(tmap, _gathered(adapter.lora_B, tmap, rank), cfg)
        else:  # A split like the weight's columns, B whole
            a_parts = split(tmap, _gathered(adapter.lora_A, tmap, rank), cfg)
            b_parts = [adapter.lora_B.detach()] * len(tmap.hf)
        for hf_name, a, b in zip(tmap.hf, a_parts, b_parts, strict=True):
            path = hf_name.removesuffix(".weight")
            yield f"{path}.lora_A", a.contiguous()
            yield f"{path}.lora_B", b.contiguous()


def _gathered(local: torch.Tensor, tmap, rank) -> torch.Tensor:
    """The whole factor from every rank's shard, laid out as ``tmap``'s weight is."""
    _, size = shard_coords(tmap.group, rank)
    local = local.detach()
    return unshard(tmap, all_gather(local, tmap.group, size)) if size > 1 else local


def save_peft_adapter(
    model: torch.nn.Module, hf_config, folder: str | os.PathLike, *, base_model: str = ""
) -> None:
    """Write ``model``'s adapters to ``folder`` in PEFT's format (rank 0 writes; every rank of a
    tensor-parallel group calls it). ``base_model``: ``base_model_name_or_path`` in the config.
    One pipeline stage's layers only (pipeline parallelism: not yet)."""
    from megatron_rl.lora.experts import LoRAGroupedExperts

    experts = [n for n, m in model.named_modules() if isinstance(m, LoRAGroupedExperts)]
    if experts:
        raise ValueError(
            f"save_peft_adapter: {experts[0]} adapts routed experts, which have no PEFT export "
            "yet (transformers 5 fuses them; peft targets their 3-D parameters); export the "
            "merged model (save_checkpoint) instead"
        )
    layers = adapted_layers(model)
    if not layers:
        raise ValueError("save_peft_adapter: the model has no LoRA adapter (--lora-rank 0)")

    first = next(iter(layers.values()))
    tensors, targets = {}, []
    for name, tensor in iter_peft_tensors(model, hf_config):
        tensors[f"{PEFT_PREFIX}{name}.weight"] = tensor.float().cpu().clone()  # no shared A
        if name.endswith(".lora_A"):
            targets.append(name.removesuffix(".lora_A"))
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": float(first.dropout),
        # one regex of the full paths: PEFT matches it whole, and a list would go through
        # transformers' checkpoint-key conversions (seen to retarget shared experts' names)
        "target_modules": "|".join(re.escape(t) for t in targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    os.makedirs(folder, exist_ok=True)
    atomic_save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), {"format": "pt"})
    atomic_write_text(
        os.path.join(folder, "adapter_config.json"), json.dumps(config, indent=2) + "\n"
    )
