"""Load an HF or canonical Megatron checkpoint into a (possibly sharded) megatron GPTModel.

Each rank reads only the tensors its shard needs. Everything is validated (tensor names against
the config, shapes against the config and the model) before the first weight is written.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

import torch
from transformers import Qwen3MoeConfig

from megatron_rl.model.chunks import as_chunks
from megatron_rl.model.conversion.names import (
    TensorMap,
    expected_canonical_shapes,
    expected_hf_shapes,
    rank_tensor_maps,
)
from megatron_rl.model.conversion.safetensors_io import CheckpointReader
from megatron_rl.model.conversion.sharding import (
    model_layout_name,
    model_rank_layout,
    shard_coords,
)
from megatron_rl.model.conversion.transforms import fuse, shard
from megatron_rl.model.presets import load_hf_config, model_family

logger = logging.getLogger(__name__)

FORMATS = ("hf", "megatron")
_MAX_LISTED = 12


def mtp_hf_names(cfg, names: Iterable[str]) -> list[str]:
    """HF tensor names of multi-token-prediction layers (DeepSeek-V3 and GLM-4.5; none for
    Qwen3-MoE)."""
    if model_family(cfg) not in ("deepseek_v3", "glm4_moe"):
        return []
    from megatron_rl.model.conversion.names_deepseek import mtp_hf_names as deepseek_mtp_names

    return deepseek_mtp_names(cfg, names)


def detect_format(folder: str | os.PathLike) -> str:
    """ "megatron" for a canonical Megatron checkpoint, "hf" for a Hugging Face one."""
    with CheckpointReader(folder) as reader:
        return "megatron" if "decoder.final_layernorm.weight" in reader.names() else "hf"


def _listed(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def validate_checkpoint(
    reader: CheckpointReader,
    expected: dict[str, tuple[int, ...]],
    what: str,
    skipped: Iterable[str] = (),
) -> None:
    """Raise ValueError naming every missing, unexpected or wrongly shaped tensor (the names in
    ``skipped`` are neither expected nor unexpected)."""
    present = set(reader.names()) - set(skipped)
    problems = []
    missing = set(expected) - present
    extra = present - set(expected)
    if missing:
        problems.append(f"{len(missing)} missing tensors: {_listed(missing)}")
    if extra:
        problems.append(f"{len(extra)} unexpected tensors: {_listed(extra)}")
    bad = {
        name: (reader.shape(name), shape)
        for name, shape in expected.items()
        if name in present and reader.shape(name) != shape
    }
    if bad:
        problems.append(
            f"{len(bad)} tensors with wrong shapes: "
            + _listed(f"{n} has {got}, model expects {want}" for n, (got, want) in bad.items())
        )
    if problems:
        raise ValueError(
            f"{what} {reader.folder} does not match the model config: "
            + "; ".join(problems)
            + ". Check that the checkpoint and the model config (experts, layers, sizes) agree."
        )


EXTRA_STATE_SUFFIX = "._extra_state"


def weight_entries(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict tensors that hold weights, by the names `rank_tensor_maps` uses.

    Transformer Engine modules add ``<module>._extra_state`` entries (their FP8 scaling metadata,
    a serialised blob): they have no HF name and are not weights, so they are left out. Grouped
    experts (`TorchGroupedMLP`) hold each layer's experts in two stacked tensors; they appear as
    one view per expert and projection (`expert_weight_views`), so conversion and weight sync see
    the per-expert tensors every other layout has. An adapted layer (`megatron_rl.lora`)
    appears as the unadapted one, its weight merged: ``W + (alpha / r) B A``.
    """
    from megatron_rl.lora.apply import ADAPTERS, unwrap_entries
    from megatron_rl.model.grouped_experts import TorchGroupedMLP, expert_weight_views

    entries = {
        name: value
        for name, value in model.state_dict(keep_vars=True).items()
        if torch.is_tensor(value) and not name.endswith(EXTRA_STATE_SUFFIX)
    }
    for prefix, module in model.named_modules():
        if isinstance(module, TorchGroupedMLP):
            dotted = f"{prefix}." if prefix else ""
            del entries[f"{dotted}weight1"], entries[f"{dotted}weight2"]
            entries.update(expert_weight_views(module, dotted))
    for prefix, module in model.named_modules():  # exported and synced merged (megatron_rl/lora)
        if isinstance(module, ADAPTERS):
            unwrap_entries(entries, f"{prefix}.", module.merged_entries())
    return entries


def load_checkpoint(
    model: torch.nn.Module,
    folder: str | os.PathLike,
    hf_config: Qwen3MoeConfig | str | os.PathLike,
    *,
    fmt: str = "auto",
    progress: Callable[[Iterable], Iterable] | None = None,
) -> None:
    """Copy this rank's shard of the checkpoint in ``folder`` into ``model``'s parameters.

    Args:
        model: a GPTModel (or the `ModelChunks` of an interleaved pipeline) from
            `megatron_rl.model.build_model` (local or TE spec, any TP/EP/PP/VP).
        folder: HF checkpoint or canonical Megatron checkpoint (safetensors, sharded or not).
        hf_config: the model's HF config (object, config.json or folder).
        fmt: "hf", "megatron" or "auto" (detected from the tensor names).
        progress: optional wrapper around the per-tensor loop (e.g. ``tqdm``).
    """
    cfg = load_hf_config(hf_config)
    fmt = detect_format(folder) if fmt == "auto" else fmt
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r}: choose 'auto' or one of {FORMATS}")
    with CheckpointReader(folder) as reader:
        expected = expected_hf_shapes(cfg) if fmt == "hf" else expected_canonical_shapes(cfg)
        skipped = mtp_hf_names(cfg, reader.names()) if fmt == "hf" else []
        if skipped:
            logger.warning(
                "skipping %d tensors of %s's multi-token-prediction layers "
                "(num_nextn_predict_layers=%d): MTP is not built, the main model loads without it",
                len(skipped),
                os.fspath(folder),
                cfg.num_nextn_predict_layers,
            )
        validate_checkpoint(reader, expected, f"{fmt} checkpoint", skipped)

        def full_tensor(tmap: TensorMap) -> torch.Tensor:
            if fmt == "hf":
                return fuse(tmap, [reader.get(name) for name in tmap.hf], cfg)
            return reader.get(tmap.canonical)

        count = copy_full_tensors(model, cfg, full_tensor, progress=progress)
    logger.info("loaded %d tensors from %s (%s)", count, os.fspath(folder), fmt)


def copy_full_tensors(
    model: torch.nn.Module,
    cfg: Qwen3MoeConfig,
    full_tensor: Callable[[TensorMap], torch.Tensor],
    *,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> int:
    """Copy this rank's shard of each canonical tensor ``full_tensor(tmap)`` into ``model``.

    Every shard is computed and checked against its parameter's shape before the first weight
    is written, so a failure leaves the model as it was. Returns the number of tensors copied.
    """
    from megatron_rl.lora.apply import ADAPTERS

    if any(isinstance(m, ADAPTERS) for m in model.modules()):
        raise RuntimeError(
            "load the base checkpoint before adding LoRA adapters: an adapted layer's weight "
            "entry is the merged W + (alpha / r) B A, not a parameter to copy into"
        )
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for chunk in as_chunks(model):  # interleaved pipeline: each chunk maps its own layers
        rank = model_rank_layout(chunk)
        maps = rank_tensor_maps(cfg, model_layout_name(chunk), rank)
        params = weight_entries(chunk)
        unmapped = set(params) - {m.param for m in maps}
        unknown = {m.param for m in maps} - set(params)
        if unmapped or unknown:
            raise RuntimeError(
                f"model parameters and name map disagree: unmapped {_listed(unmapped)}; "
                f"not in model {_listed(unknown)}"
            )
        for tmap in progress(maps) if progress else maps:
            part = shard(tmap, full_tensor(tmap), *shard_coords(tmap.group, rank))
            target = params[tmap.param]
            if tuple(part.shape) != tuple(target.shape):
                raise ValueError(
                    f"{tmap.param}: checkpoint shard has shape {tuple(part.shape)}, "
                    f"the model parameter {tuple(target.shape)}"
                )
            staged.append((target, part))
    with torch.no_grad():
        for target, tensor in staged:
            target.copy_(tensor)
    return len(staged)
