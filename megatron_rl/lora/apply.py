"""Install LoRA adapters on a built megatron model (`add_adapters`) and freeze everything else.

Run it before megatron's DDP wraps the model: DDP allocates gradient buffers, and the optimizer
state, only for parameters that require a gradient, so the frozen base has neither. Routers are
never adapted (they are no target), so R2/R3 replay records and replays the same routes.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from megatron_rl.lora.config import LoRAConfig
from megatron_rl.lora.experts import LoRAGroupedExperts
from megatron_rl.lora.layers import COLUMN, ROW, LoRALinear
from megatron_rl.model.grouped_experts import TorchGroupedMLP

ADAPTERS = (LoRALinear, LoRAGroupedExperts)


def add_adapters(model: torch.nn.Module, config: LoRAConfig, seed: int) -> list[str]:
    """Wrap every target layer of ``model`` in a `LoRALinear` (in place) and freeze all other
    parameters; returns the wrapped layers' names. A target that is neither a column- nor a
    row-parallel linear layer is a TypeError naming it (a spec this module does not know)."""
    suffixes = config.target_modules()
    wrapped: list[str] = []
    for name, module in list(model.named_modules()):
        if not any(name.endswith("." + s) for s in suffixes):
            continue
        if isinstance(module, ADAPTERS):
            raise ValueError(f"{name} already has an adapter")
        if isinstance(module, TorchGroupedMLP):
            if config.lora_dropout:
                raise ValueError(
                    f"{name}: --lora-dropout on routed experts is not supported; use 0 or "
                    "leave routed_experts out of --lora-targets"
                )
            adapter = LoRAGroupedExperts(
                module,
                name=global_layer_name(model, name),
                rank=config.lora_rank,
                alpha=config.lora_alpha,
                seed=seed,
                mode=config.lora_experts,
            )
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, adapter)
            wrapped.append(name)
            continue
        if isinstance(module, ColumnParallelLinear):
            kind = COLUMN
        elif isinstance(module, RowParallelLinear):
            kind = ROW
        else:
            raise TypeError(
                f"LoRA target {name} is a {type(module).__name__}, not megatron's column- or "
                "row-parallel linear layer nor the grouped experts (routed experts need "
                "--moe-grouped-gemm); drop it from --lora-targets"
            )
        adapter = LoRALinear(
            module,
            kind,
            name=global_layer_name(model, name),
            rank=config.lora_rank,
            alpha=config.lora_alpha,
            dropout=config.lora_dropout,
            seed=seed,
            sequence_parallel=bool(getattr(module, "sequence_parallel", False)),
        )
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, adapter)
        wrapped.append(name)
    if not wrapped:
        raise ValueError(
            f"--lora-targets {config.lora_targets}: no layer of this model matches "
            f"({', '.join(suffixes)}); choose targets the family has"
        )
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_A" in name or ".lora_B" in name)
    return wrapped


def global_layer_name(model: torch.nn.Module, name: str) -> str:
    """``name`` with its stage-local ``decoder.layers.<i>`` as the global layer (megatron's
    ``layer_number``, 1-based), so a pipeline stage seeds the same ``A`` as world 1."""
    parts = name.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            layer = model.get_submodule(".".join(parts[: i + 2]))
            number = getattr(layer, "layer_number", None)
            if number is not None:
                parts[i + 1] = str(number - 1)
            break
    return ".".join(parts)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of this rank's adapter parameters (detached), by parameter name."""
    return {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n}


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as a model without adapters names it, with every adapted weight
    merged (``W + (alpha / r) B A``, this rank's shard); the model's own state dict when it has
    no adapter."""
    state = model.state_dict()
    for prefix, module in model.named_modules():
        if isinstance(module, ADAPTERS):
            unwrap_entries(state, f"{prefix}.", module.merged_state())
    return state


def unwrap_entries(entries: dict, dotted: str, merged: dict[str, torch.Tensor]) -> None:
    """In place: ``entries``' names under the adapted module ``dotted`` (``<module>.``) as the
    unadapted module's (``<module>.base.<x>`` -> ``<module>.<x>``), its adapters dropped and
    ``merged``'s entries (computed tensors: writing into them changes no parameter) set."""
    for key in [k for k in entries if k.startswith(dotted)]:
        value = entries.pop(key)
        rest = key[len(dotted) :]
        if rest.startswith("base."):
            entries[dotted + rest[len("base.") :]] = value
    entries.update({dotted + name: tensor for name, tensor in merged.items()})
