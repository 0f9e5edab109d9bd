"""Optimizer state for training checkpoints: megatron-core's optimizer (each chained one), with
the distributed optimizer's parameter state that its plain ``state_dict()`` leaves out.

megatron-core 0.16's ``get_parameter_state_dp_reshardable()`` writes no ``padding`` entry per
parameter, while ``load_parameter_state_from_dp_reshardable()`` reads one (megatron's own
sharded-checkpoint path adds ``padding=False`` for real parameters); `load_optimizer_state` adds
the missing entries the same way, so a saved state loads back.

Its ``DistributedOptimizer.load_state_dict`` (without Apex/TE, i.e. torch's Adam: every CPU run and
GPU runs without Transformer Engine) also gives every parameter the *same* ``step`` tensor; torch's
Adam increments it in place once per parameter, so after a resume the bias correction counted one
step per parameter per update (seen here: 49 per update on the tiny model) and the run diverged
from an uninterrupted one. `load_optimizer_state` gives each parameter its own copy. Its
``state_dict()`` also asserts before the first update (no ``step`` yet); `optimizer_state` first
gives such parameters the state torch's Adam would create (zero moments, step 0), which changes
nothing about the next update.
"""

from __future__ import annotations

import contextlib

import torch


def inner_optimizers(optimizer) -> list:
    """The optimizers whose state is saved: megatron's (each chained one)."""
    inner = optimizer.inner if hasattr(optimizer, "inner") else optimizer
    return list(getattr(inner, "chained_optimizers", [inner]))


def _calls(optimizer):
    """The shim megatron's optimizer calls need on this device (see `PolicyOptimizer`)."""
    shim = getattr(optimizer, "_megatron_calls", None)
    return shim() if shim is not None else contextlib.nullcontext()


def optimizer_state(optimizer) -> list[dict]:
    states = []
    with _calls(optimizer):
        for inner in inner_optimizers(optimizer):
            _fresh_adam_state(_torch_optimizer(inner))
            state = {"state_dict": inner.state_dict()}
            if hasattr(inner, "get_parameter_state_dp_reshardable"):  # distributed optimizer
                state["param_state"] = inner.get_parameter_state_dp_reshardable()
            states.append(state)
    return states


def _torch_optimizer(inner):
    """The torch optimizer that holds the per-parameter state (megatron wraps one)."""
    return getattr(inner, "optimizer", inner)


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
        saved_dict = state["state_dict"].get("optimizer", state["state_dict"])
        groups = [g["params"] for g in _torch_optimizer(inner).param_groups]
        saved_groups = saved_dict.get("param_groups", [])
        if [len(g) for g in groups] != [len(g.get("params", ())) for g in saved_groups]:
            return f"optimizer {index}: parameter groups differ from the checkpoint's"
        params = [p for group in groups for p in group]
        for param_id, param_state in saved_dict.get("state", {}).items():
            if not isinstance(param_id, int) or param_id >= len(params):
                continue  # megatron's own bookkeeping entries (e.g. a shared step)
            for key, value in param_state.items():
                if torch.is_tensor(value) and value.dim() and value.shape != params[param_id].shape:
                    return (
                        f"optimizer {index}: {key} of parameter #{param_id} has shape "
                        f"{tuple(value.shape)}, the parameter {tuple(params[param_id].shape)}"
                    )
    return None


def load_optimizer_state(optimizer, saved: list[dict]) -> None:
    # no_grad: megatron copies into the (leaf) main parameters in place
    with _calls(optimizer), torch.no_grad():
        for state, inner in zip(saved, inner_optimizers(optimizer), strict=True):
            inner.load_state_dict(state["state_dict"])
            _unshare_steps(_torch_optimizer(inner))
            if "param_state" in state:
                inner.load_parameter_state_from_dp_reshardable(_with_padding(state["param_state"]))


def _with_padding(param_state: dict) -> dict:
    """Mark every saved parameter entry as real (``padding=False``) where megatron left it out."""
    for key, per_dtype in param_state.items():
        if not isinstance(key, int):
            continue  # per_bucket_numel* bookkeeping
        for buckets in per_dtype.values():
            for bucket in buckets:
                for entry in bucket:
                    entry.setdefault("padding", False)
    return param_state


def _unshare_steps(torch_optimizer) -> None:
    """One ``step`` tensor per parameter (megatron's loader hands them all the same one)."""
    for param_state in torch_optimizer.state.values():
        step = param_state.get("step")
        if torch.is_tensor(step):
            param_state["step"] = step.clone()


def _fresh_adam_state(torch_optimizer) -> None:
    """Adam's initial state (step 0, zero moments) for parameters not updated yet."""
    if not isinstance(torch_optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in torch_optimizer.param_groups:
        for param in group["params"]:
            if not torch_optimizer.state[param]:
                torch_optimizer.state[param].update(
                    step=torch.tensor(0.0),
                    exp_avg=torch.zeros_like(param, memory_format=torch.preserve_format),
                    exp_avg_sq=torch.zeros_like(param, memory_format=torch.preserve_format),
                )
