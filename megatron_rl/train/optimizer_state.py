"""Optimizer state for training checkpoints: torch's AdamW on CPU, megatron's (distributed)
optimizer on GPU, including the distributed optimizer's parameter state that a plain
``state_dict()`` leaves out."""

from __future__ import annotations

import torch


def inner_optimizers(optimizer) -> list:
    """The optimizers whose state is saved: megatron's (each chained one) or torch's."""
    inner = optimizer.inner if hasattr(optimizer, "inner") else optimizer
    return list(getattr(inner, "chained_optimizers", [inner]))


def optimizer_state(optimizer) -> list[dict]:
    states = []
    for inner in inner_optimizers(optimizer):
        state = {"state_dict": inner.state_dict()}
        if hasattr(inner, "get_parameter_state_dp_reshardable"):  # megatron distributed optimizer
            state["param_state"] = inner.get_parameter_state_dp_reshardable()
        states.append(state)
    return states


def optimizer_difference(saved: list[dict], optimizer) -> str | None:
    inners = inner_optimizers(optimizer)
    if len(saved) != len(inners):
        return f"checkpoint has {len(saved)} optimizers, this job has {len(inners)}"
    for index, (state, inner) in enumerate(zip(saved, inners, strict=True)):
        if "param_state" in state:
            if state["param_state"]["per_bucket_numel_unpadded"] != inner.per_bucket_numel_unpadded:
                return (
                    f"optimizer {index}: distributed-optimizer buckets differ from the checkpoint"
                )
            continue
        groups = [g["params"] for g in inner.param_groups]
        saved_groups = state["state_dict"].get("param_groups", [])
        if [len(g) for g in groups] != [len(g.get("params", ())) for g in saved_groups]:
            return f"optimizer {index}: parameter groups differ from the checkpoint's"
        params = [p for group in groups for p in group]
        for param_id, param_state in state["state_dict"].get("state", {}).items():
            for key, value in param_state.items():
                if torch.is_tensor(value) and value.dim() and value.shape != params[param_id].shape:
                    return (
                        f"optimizer {index}: {key} of parameter #{param_id} has shape "
                        f"{tuple(value.shape)}, the parameter {tuple(params[param_id].shape)}"
                    )
    return None


def load_optimizer_state(optimizer, saved: list[dict]) -> None:
    for state, inner in zip(saved, inner_optimizers(optimizer), strict=True):
        inner.load_state_dict(state["state_dict"])
        if "param_state" in state:
            inner.load_parameter_state_from_dp_reshardable(state["param_state"])
