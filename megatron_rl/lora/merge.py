r"""Merge a PEFT LoRA adapter into its HF base checkpoint: ``W + s B A`` per adapted weight,
``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), as PEFT's
``merge_and_unload`` computes it; ``megatron-rl convert hf-to-hf --merge-lora ADAPTER``.

Adapters are matched to the base by name (``base_model.model.<path>.lora_A.weight``):

- ``<path>.weight`` in the base: a linear layer, ``W += s B A`` (``B`` ``[out, r]``, ``A``
  ``[r, in]``);
- ``<layer>.mlp.experts.base_layer`` / ``<layer>.mlp.experts``: PEFT's adapters of the fused
  routed experts' ``gate_up_proj`` / ``down_proj`` (`megatron_rl.lora.peft_export`), ``A``
  ``[E r, in]``, ``B`` ``[out, r E]``: expert ``e`` gains ``s B[:, e::E] A[e r:(e+1) r]``,
  added to the checkpoint's per-expert ``experts.<e>.gate_proj`` (rows ``:I``) and ``up_proj``
  (rows ``I:``), or ``down_proj``; or to fused ``gate_up_proj``/``down_proj`` ``[E, out, in]``
  when the checkpoint stores them so.

Computed in float32, written in the base tensor's dtype. Every other tensor and file (config,
tokenizer) is copied; the output folder appears whole or not at all (written as ``DST.tmp``,
then renamed). An adapter tensor that matches no base weight is a ValueError naming it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from megatron_rl.lora.peft_export import EXPERT_PAIRS
from megatron_rl.model.conversion.safetensors_io import CheckpointReader, write_checkpoint

PREFIX = "base_model.model."
# PEFT's module path of each fused-experts pair -> its parameter (the export's nesting)
FUSED = {"experts." + holder if holder else "experts": param for param, holder, _ in EXPERT_PAIRS}


def adapter_scale(config: dict) -> float:
    """PEFT's scaling ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA)."""
    for key in ("r", "lora_alpha"):
        if key not in config:
            raise ValueError(f"adapter_config.json has no {key!r}")
    if config.get("use_dora"):
        raise ValueError("adapter_config.json: use_dora is not supported (DoRA is not LoRA)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("adapter_config.json: rank_pattern/alpha_pattern are not supported")
    r = config["r"]
    return config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)


def weight_deltas(
    adapter: dict[str, torch.Tensor], scale: float, base_shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """``{base tensor name: float32 delta}`` for every adapter pair (module docstring);
    ``base_shapes``: the base checkpoint's tensor names and shapes."""
    deltas: dict[str, torch.Tensor] = {}
    for key in sorted(k for k in adapter if k.endswith(".lora_A.weight")):
        path = key.removeprefix(PREFIX).removesuffix(".lora_A.weight")
        b_key = key.replace(".lora_A.", ".lora_B.")
        if b_key not in adapter:
            raise ValueError(f"adapter tensor {key} has no {b_key}")
        a, b = adapter[key].float(), adapter[b_key].float()
        if f"{path}.weight" in base_shapes:
            deltas[f"{path}.weight"] = scale * b @ a
            continue
        holder = next((h for h in FUSED if path.endswith(".mlp." + h)), None)
        if holder is None:
            raise ValueError(f"adapter tensor {key}: the base has no {path}.weight")
        experts = path.removesuffix(".base_layer")
        deltas.update(_expert_deltas(experts, FUSED[holder], a, b, scale, base_shapes))
    return deltas


def _expert_deltas(experts: str, param: str, a, b, scale: float, base_shapes: dict) -> dict:
    """``{base name: delta}`` of one fused-experts pair; ``A`` ``[E r, in]``, ``B`` ``[out, r E]``
    (PEFT: ``r`` rows per expert in ``A``, column ``j E + e`` of ``B``)."""
    fused = f"{experts}.{param}"
    if fused in base_shapes:
        count = base_shapes[fused][0]
    else:
        indices = {
            n[len(experts) + 1 :].split(".")[0] for n in base_shapes if n.startswith(experts + ".")
        }
        count = len({i for i in indices if i.isdigit()})
    if not count or a.shape[0] % count or b.shape[1] != a.shape[0]:
        raise ValueError(
            f"adapter of {fused}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
            f"{count} experts of rank r (A [E r, in], B [out, r E])"
        )
    r = a.shape[0] // count
    stack = scale * torch.stack([b[:, e::count] @ a[e * r : (e + 1) * r] for e in range(count)])
    if fused in base_shapes:
        return {fused: stack}
    out = {}
    for e in range(count):
        if param == "down_proj":
            out[f"{experts}.{e}.down_proj.weight"] = stack[e]
        else:
            half = stack.shape[1] // 2  # gate rows, then up rows
            out[f"{experts}.{e}.gate_proj.weight"] = stack[e, :half]
            out[f"{experts}.{e}.up_proj.weight"] = stack[e, half:]
    return out


def merge_peft_adapter(
    base: str | os.PathLike,
    adapter: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    max_shard_bytes: int = 2 * 1024**3,
) -> int:
    """Write ``base`` with ``adapter`` merged to ``dst`` (module docstring); returns the number
    of weights changed."""
    base, adapter, dst = Path(base), Path(adapter), Path(dst)
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(adapter / "adapter_model.safetensors")
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with CheckpointReader(base) as reader:
        shapes = {n: reader.shape(n) for n in reader.names()}
        deltas = weight_deltas(tensors, adapter_scale(config), shapes)
        for name, delta in deltas.items():
            if tuple(delta.shape) != shapes[name]:
                raise ValueError(
                    f"{name}: the adapter's update is {tuple(delta.shape)}, the base weight "
                    f"{shapes[name]} (an adapter of another model?)"
                )

        def merged() -> Iterator[tuple[str, torch.Tensor]]:
            for name in reader.names():
                weight = reader.get(name)
                if name in deltas:
                    weight = (weight.float() + deltas[name]).to(weight.dtype)
                yield name, weight

        write_checkpoint(merged(), tmp, max_shard_bytes=max_shard_bytes)
    for item in base.iterdir():  # config, tokenizer, generation config: all but the weights
        if item.is_file() and "safetensors" not in item.name:  # shards and their index
            shutil.copy2(item, tmp / item.name)
    if dst.exists():
        shutil.rmtree(dst)
    os.replace(tmp, dst)
    return len(deltas)
