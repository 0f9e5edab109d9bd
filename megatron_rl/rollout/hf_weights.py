"""Load checkpoint-named HF tensors into a live transformers Qwen3-MoE model, in place.

Checkpoints (and `megatron_rl.model.conversion.iter_hf_tensors`) name experts one by one
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` [I, H], ``up_proj`` [I, H],
``down_proj`` [H, I]). transformers 5 keeps them fused in memory:
``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows first) and ``mlp.experts.down_proj``
[E, H, I]. `resolve` maps a checkpoint name to the in-memory parameter slice it fills; names
that are already in-memory names (older transformers, dense tensors) map to themselves.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from megatron_rl.rollout.flat_bucket import nonfinite_name

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def resolve(params: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The view of an in-memory parameter that checkpoint tensor ``name`` fills.

    Raises:
        ValueError: ``name`` is not a tensor of this model.
    """
    if name in params:
        return params[name]
    match = _EXPERT.match(name)
    if match:
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        if proj == "down_proj" and f"{prefix}.down_proj" in params:
            return params[f"{prefix}.down_proj"][expert]
        fused = params.get(f"{prefix}.gate_up_proj")
        if fused is not None and proj != "down_proj":
            half = fused.shape[1] // 2
            rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
            return fused[expert, rows]
    raise ValueError(f"weight {name!r} is not a tensor of this model (checkpoint name unknown)")


def hf_param_table(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """In-memory parameters and buffers by name (tied weights appear under every name)."""
    table = dict(model.named_parameters(remove_duplicate=False))
    table.update(dict(model.named_buffers()))
    return table


def stage_weights(
    model: torch.nn.Module,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    check_finite: bool = True,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Validate a stream against ``model`` and return (target view, source) pairs; no writes.

    Raises ValueError naming the first unknown name, shape mismatch or (``check_finite``)
    tensor holding NaN/Inf, so that a bad stream leaves the model untouched (the caller writes
    only after staging all of it). Sources are held, not copied: they must not change before
    `apply_staged`.
    """
    params = hf_param_table(model)
    staged, names = [], []
    for name, tensor in named_tensors:
        target = resolve(params, name)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(target.shape)}"
            )
        staged.append((target, tensor.detach()))
        names.append(name)
    bad = nonfinite_name(zip(names, (s for _, s in staged), strict=True)) if check_finite else None
    if bad is not None:
        raise ValueError(f"weight {bad!r} holds non-finite values")
    return staged


@torch.no_grad()
def apply_staged(staged: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy every staged source into its target view (dtype/device converted by ``copy_``)."""
    for target, source in staged:
        target.copy_(source)


def checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Per-tensor checksum: float64 sum of ``x * (1 + position mod 97)`` (order-sensitive)."""
    out = {}
    for name, tensor in named:
        flat = tensor.detach().reshape(-1).to(torch.float64, copy=True).cpu()
        weights = 1.0 + (torch.arange(flat.numel(), dtype=torch.float64) % 97)
        out[name] = float((flat * weights).sum())
    return out


def read_back(model: torch.nn.Module, names: Iterable[str]) -> Iterable[tuple[str, torch.Tensor]]:
    """(checkpoint name, current in-memory tensor) for ``names``; for engine-side checksums."""
    params = hf_param_table(model)
    for name in names:
        yield name, resolve(params, name)
