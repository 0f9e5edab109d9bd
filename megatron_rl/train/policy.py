"""The policy the trainer updates: megatron's model, its initial weights, optimizer and frozen
reference, built in one place and in megatron's order (`build_policy`, `build_reference`)."""

from __future__ import annotations

import dataclasses

import torch

from megatron_rl.backend.optimizer import build_optimizer, wrap_for_training
from megatron_rl.lora.apply import add_adapters, merged_state_dict
from megatron_rl.model import build_model
from megatron_rl.model.conversion.seeded_init import init_from_seed
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.reference import ReferencePolicy


def build_policy(config: TrainConfig, hf_config, checkpoint_dir: str | None):
    """``(model, optimizer)``: this rank's stage and shards of the model wrapped for training
    (megatron's DDP), loaded from ``checkpoint_dir`` (HF or canonical megatron) or, without one,
    initialised from ``--seed`` the same way at every parallel layout (`init_from_seed`), with
    ``--lora-rank``'s adapters on it (the base frozen), and megatron's optimizer over it."""
    model = build_model(hf_config, config.model)
    if checkpoint_dir is not None:
        from megatron_rl.model.conversion import load_checkpoint

        load_checkpoint(model, checkpoint_dir, hf_config)
    else:  # megatron's own draws depend on the layout
        init_from_seed(model, hf_config, config.parallel.seed)
    if config.lora.enabled:  # before DDP: the frozen base gets no gradient buffer
        add_adapters(model, config.lora, config.parallel.seed)
    wrapped = wrap_for_training(
        model,
        use_distributed_optimizer=config.optimizer.use_distributed_optimizer,
        overlap_grad_reduce=config.optimizer.overlap_grad_reduce,
    )
    return wrapped, build_optimizer(wrapped, config.optimizer)


def build_reference(
    config: TrainConfig, hf_config, policy: torch.nn.Module, device: torch.device
) -> ReferencePolicy | None:
    """A frozen copy of the initial ``policy`` (megatron's module) for the KL term, without
    routing replay; None when ``--kl-coef`` is 0."""
    if config.objective.kl_coef <= 0:
        return None
    options = dataclasses.replace(config.model, routing_replay=False)
    reference = build_model(hf_config, options)
    # with LoRA the reference is the merged policy (the base, while B is 0): no adapter names
    reference.load_state_dict(merged_state_dict(policy), strict=False)
    return ReferencePolicy(reference, device, offload=config.objective.reference_offload)
