r"""The policy's adapters in PEFT's format: ``adapter_model.safetensors`` + ``adapter_config.json``,
which ``peft.PeftModel.from_pretrained`` loads onto the HF model of the base checkpoint.

Names and layouts follow the base weight's conversion (`megatron_rl.model.conversion`): each
adapted megatron layer maps to the HF module(s) its weight maps to. ``B`` has the weight's rows,
so it is gathered over tensor parallelism and split into HF tensors exactly as the weight is
(fused q/k/v into ``q_proj``/``k_proj``/``v_proj`` per query group, gate+up into
``gate_proj``/``up_proj``); ``A`` has the weight's columns, so a row-parallel layer's ``A`` is
gathered as its weight is, and a fused layer's one ``A`` is each HF module's ``lora_A``. A fused
layer's adapter is thus exactly a PEFT adapter per HF module whose ``A`` factors are equal.

Routed experts (`LoRAGroupedExperts`): transformers 5 fuses a layer's experts into 3-D
parameters, ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up: megatron's
``weight1`` per expert) and ``mlp.experts.down_proj`` ``[E, H, I]``, which PEFT adapts through
``target_parameters`` with one pair per parameter: ``A`` ``[E r, in]`` expert-major and ``B``
``[out, r E]`` expert-minor (expert ``e``'s ``B`` is columns ``e, e + E, ...``), so that
``W[e] += (alpha / r) B[:, e::E] A[e r:(e + 1) r]`` (peft 0.21's ``ParamWrapper``). The experts
are gathered over expert parallelism; shared adapters are repeated per expert. PEFT nests its
two wrappers, so ``gate_up_proj``'s pair is saved under ``mlp.experts.base_layer`` and
``down_proj``'s under ``mlp.experts``.

Every target is a ``target_parameters`` entry, the full HF path of the weight: PEFT matches it
whole, so it adapts exactly the exported weights. (Given in ``target_modules``, peft 0.21 with
transformers 5 runs the names through its MoE checkpoint conversion, which turns full paths
into leaf names (a module adapted in every layer) and maps every ``gate_proj``/``up_proj``/
``down_proj``, the dense MLP's and the shared experts' included, onto the routed experts.)
PEFT's parameter adapters take no dropout: the export says ``lora_dropout`` 0 (dropout acts in
training only; the adapted function is the same).
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
EXPERT_PAIRS = (  # (HF parameter of the fused experts, where PEFT saves its pair, factors)
    ("gate_up_proj", "base_layer", ("lora_A1", "lora_B1")),
    ("down_proj", "", ("lora_A2", "lora_B2")),
)


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


def expert_factors(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """``(HF experts path, "gate_up_proj"/"down_proj", A [E, r, in], B [E, out, r])`` for every
    routed-expert adapter of this pipeline stage, all ``E`` experts (gathered over expert
    parallelism: a collective over each layer's expert-parallel group; shared adapters
    repeated)."""
    from megatron_rl.lora.experts import LoRAGroupedExperts

    for module in model.modules():
        if not isinstance(module, LoRAGroupedExperts):
            continue
        layer = re.search(r"layers\.(\d+)\.", module.name)
        if layer is None:
            raise ValueError(f"{module.name}: no layer number in the adapter's name")
        experts = f"model.layers.{layer.group(1)}.mlp.experts"
        group = module.base.ep_group
        for param, _, (a_name, b_name) in EXPERT_PAIRS:
            a, b = getattr(module, a_name).detach(), getattr(module, b_name).detach()
            if module.mode == "shared":  # the same pair for every expert
                total = module.base.weight1.shape[0] * group.size()
                a, b = a.expand(total, -1, -1), b.expand(total, -1, -1)
            elif group.size() > 1:
                a, b = _gather_experts(a, group), _gather_experts(b, group)
            yield experts, param, a, b


def iter_expert_peft_tensors(model: torch.nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(HF parameter path, f"{PEFT module path}.lora_A"/"lora_B", factor)`` for every routed
    expert adapter of this pipeline stage in PEFT's fused layout (module docstring); a
    collective (`expert_factors`)."""
    holders = {param: holder for param, holder, _ in EXPERT_PAIRS}
    for experts, param, a, b in expert_factors(model):
        count, rank, width = a.shape
        path = f"{experts}.{holders[param]}" if holders[param] else experts
        yield f"{experts}.{param}", f"{path}.lora_A", a.reshape(count * rank, width)
        yield f"{experts}.{param}", f"{path}.lora_B", b.permute(1, 2, 0).reshape(-1, rank * count)


def iter_expert_module_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(f"{HF module}.lora_A"/"lora_B", factor)`` per expert and projection, unfused:
    ``experts.<e>.gate_proj`` and ``up_proj`` share ``A1[e]`` and split ``B1[e]``'s rows (gate,
    then up), ``down_proj`` is ``A2[e]``, ``B2[e]`` (the per-expert names SGLang's LoRA loader
    reads); a collective (`expert_factors`)."""
    for experts, param, a, b in expert_factors(model):
        for e in range(a.shape[0]):
            if param == "down_proj":
                parts = (("down_proj", b[e]),)
            else:
                half = b.shape[1] // 2
                parts = (("gate_proj", b[e, :half]), ("up_proj", b[e, half:]))
            for name, b_part in parts:
                yield f"{experts}.{e}.{name}.lora_A", a[e]
                yield f"{experts}.{e}.{name}.lora_B", b_part


def _from_every_stage(tensors: dict, targets: list) -> tuple[dict, list]:
    """Every pipeline stage's tensors and targets, on the ranks of global rank 0's pipeline group
    (in layer order); unchanged without pipeline parallelism."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        return tensors, targets
    group = parallel_state.get_pipeline_model_parallel_group()
    ranks = torch.distributed.get_process_group_ranks(group)
    if group.size() == 1 or 0 not in ranks:  # only rank 0 writes
        return tensors, targets
    stages: list = [None] * group.size()
    torch.distributed.all_gather_object(stages, (tensors, targets), group=group)
    return (
        {k: v for stage, _ in stages for k, v in stage.items()},
        [t for _, stage in stages for t in stage],
    )


def _gather_experts(local: torch.Tensor, group) -> torch.Tensor:
    """``[E_local, ...]`` stacks of every rank of ``group``, in global expert order."""
    parts = [torch.empty_like(local) for _ in range(group.size())]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


def peft_adapter(
    model: torch.nn.Module, hf_config, *, experts_unfused: bool = False
) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, adapter_config)`` of ``model``'s adapters in PEFT's format (module docstring),
    float32, complete on the ranks of global rank 0's pipeline group. Collective: every rank
    calls it (tensor- and expert-parallel gathers; the pipeline stages' tensors gathered).

    ``experts_unfused``: routed experts as per-expert ``gate_proj``/``up_proj``/``down_proj``
    modules (`iter_expert_module_tensors`) and every target a leaf module name in
    ``target_modules``: the form SGLang's LoRA loader reads (its adapters are matched by layer
    and module name), not one PEFT loads onto transformers 5."""
    from megatron_rl.lora.experts import LoRAGroupedExperts

    modules = [m for m in model.modules() if isinstance(m, (LoRALinear, LoRAGroupedExperts))]
    if not modules:
        raise ValueError("the model has no LoRA adapter (--lora-rank 0)")
    first = modules[0]
    tensors, targets = {}, []
    for name, tensor in iter_peft_tensors(model, hf_config):
        tensors[f"{PEFT_PREFIX}{name}.weight"] = tensor.float().cpu().clone()  # no shared A
        if name.endswith(".lora_A"):
            targets.append(name.removesuffix(".lora_A") + ".weight")
    if experts_unfused:
        for name, tensor in iter_expert_module_tensors(model):
            tensors[f"{PEFT_PREFIX}{name}.weight"] = tensor.float().cpu().contiguous()
            if name.endswith(".lora_A"):
                targets.append(name.removesuffix(".lora_A") + ".weight")
    else:
        for param, name, tensor in iter_expert_peft_tensors(model):
            tensors[f"{PEFT_PREFIX}{name}.weight"] = tensor.float().cpu().contiguous()
            if name.endswith(".lora_A"):
                targets.append(param)
    tensors, targets = _from_every_stage(tensors, targets)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": 0.0,  # PEFT's parameter adapters take none (module docstring)
        "target_modules": [],
        "target_parameters": targets,  # full paths: exactly these weights (module docstring)
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    if experts_unfused:
        leaves = {t.removesuffix(".weight").rsplit(".", 1)[-1] for t in targets}
        config.update(target_modules=sorted(leaves), target_parameters=None)
    return tensors, config


def save_peft_adapter(
    model: torch.nn.Module, hf_config, folder: str | os.PathLike, *, base_model: str = ""
) -> None:
    """Write ``model``'s adapters to ``folder`` in PEFT's format (`peft_adapter`; collective,
    global rank 0 writes). ``base_model``: ``base_model_name_or_path`` in the config."""
    tensors, config = peft_adapter(model, hf_config)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    write_adapter_folder(folder, tensors, {"base_model_name_or_path": base_model, **config})


def write_adapter_folder(folder: str | os.PathLike, tensors: dict, config: dict) -> None:
    """``adapter_model.safetensors`` and ``adapter_config.json`` in ``folder``, each written
    atomically."""
    os.makedirs(folder, exist_ok=True)
    atomic_save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), {"format": "pt"})
    atomic_write_text(
        os.path.join(folder, "adapter_config.json"), json.dumps(config, indent=2) + "\n"
    )
