"""LoRA in the memory plan, exact: the adapters a GPU holds (`megatron_rl.lora`) and the frozen
base beside them.

With ``--lora-rank r`` every base tensor stays (frozen, in the parameter dtype) and each adapted
tensor gains ``A`` and ``B``; megatron's DDP then builds its gradient buffers, and the optimizer
its state, over the adapters only. Per adapted megatron layer ``W`` (this GPU's shard):

- column-parallel (``linear_qkv``, MLA's up-projections, ``linear_fc1``; input width ``d``):
  ``A`` ``[r, d]`` whole, ``B`` ``[out / tp, r]``: ``r (d + numel(W) / d)`` elements;
- row-parallel (``linear_proj``, ``linear_fc2``; output width ``d``): ``A`` ``[r, in / tp]``,
  ``B`` ``[d, r]`` whole: ``r (numel(W) / d + d)``;
- routed experts: per expert as the column/row layers above (expert parameters: the expert
  buffer under EP), or once per layer and projection when shared (also expert parameters,
  whole on every expert-parallel rank).

Not counted: the adapters' activations (``r`` columns per adapted layer and token, against the
layer's ``in + out``) and the merged weights the sync computes one tensor at a time.
"""

from __future__ import annotations

import dataclasses

from megatron_rl.lora.config import LoRAConfig
from megatron_rl.memory_plan.layout import Layout
from megatron_rl.memory_plan.shape import ModelShape

COLUMN, ROW = "column", "row"
EXPERTS = "mlp.experts.local_experts."


def _geometry(shape: ModelShape) -> dict[str, tuple[str, int]]:
    """Plan-name suffix (before ``.weight``) -> (kind, the unsplit input width of a column layer
    or output width of a row layer)."""
    h = shape.hidden_size
    return {
        "self_attention.linear_qkv": (COLUMN, h),
        "self_attention.linear_proj": (ROW, h),
        "self_attention.linear_q_up_proj": (COLUMN, shape.q_lora_rank or 0),
        "self_attention.linear_kv_up_proj": (COLUMN, shape.kv_lora_rank or 0),
        "mlp.linear_fc1": (COLUMN, h),
        "mlp.linear_fc2": (ROW, h),
        "mlp.shared_experts.linear_fc1": (COLUMN, h),
        "mlp.shared_experts.linear_fc2": (ROW, h),
        "linear_fc1": (COLUMN, h),  # a routed expert's, after `EXPERTS` + "<e>."
        "linear_fc2": (ROW, h),
    }


def adapter_numels(kind: str, width: int, numel: int, rank: int) -> tuple[int, int]:
    """(A, B) elements on this GPU for a local weight of ``numel`` elements (module docstring)."""
    other = numel // width
    return (rank * width, other * rank) if kind == COLUMN else (rank * other, width * rank)


def with_adapters(tensors: list, shape: ModelShape, layout: Layout, lora: LoRAConfig) -> list:
    """``tensors`` (`ParamTensor`, one stage's) frozen, followed by the adapters ``lora`` adds.
    The trainer's refusal applies: routed-expert adapters need expert TP 1."""
    from megatron_rl.memory_plan.params import ParamTensor

    targets = lora.target_modules()
    geometry = _geometry(shape)
    p = layout.parallel
    experts = "mlp.experts" in targets
    if experts and p.expert_tensor_parallel > 1:
        raise ValueError(
            "LoRA on routed experts needs expert tensor parallelism 1 (add expert parallelism)"
        )
    out = [dataclasses.replace(t, frozen=True) for t in tensors]
    shared_done: set[str] = set()
    for t in tensors:
        name = t.name.removesuffix(".weight")
        if t.expert:
            if not experts:
                continue
            layer, _, rest = name.partition(EXPERTS)
            fc = rest.split(".", 1)[1]
            kind, width = geometry[fc]
            a, b = adapter_numels(kind, width, t.numel, lora.lora_rank)
            if lora.lora_experts == "per-expert":
                out += [
                    ParamTensor(f"{name}.lora_A", a, True),
                    ParamTensor(f"{name}.lora_B", b, True),
                ]
            elif f"{layer}{fc}" not in shared_done:
                shared_done.add(f"{layer}{fc}")
                shared = f"{layer}mlp.experts.shared.{fc}"
                out += [
                    ParamTensor(f"{shared}.lora_A", a, True),
                    ParamTensor(f"{shared}.lora_B", b, True),
                ]
            continue
        suffix = next((s for s in targets if name.endswith("." + s)), None)
        if suffix is None or t.name.endswith(".bias"):
            continue
        kind, width = geometry[suffix]
        a, b = adapter_numels(kind, width, t.numel, lora.lora_rank)
        out += [ParamTensor(f"{name}.lora_A", a), ParamTensor(f"{name}.lora_B", b)]
    return out
