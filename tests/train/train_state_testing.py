"""Helpers for the checkpoint tests: a tiny megatron training step and 2-rank gloo workers.

Workers are top-level functions so ``torch.multiprocessing.spawn`` can pickle them; each rank
initialises gloo through a ``file://`` rendezvous inside the test's tmp_path and always tears its
process groups down.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

SEQ_LEN = 9
BATCH = 2


def linear_with_adam_state(seed: int):
    """A plain torch model and AdamW with state: the checkpoint logic without megatron."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def build_tiny(seed: int, clip_grad: float = 1.0, grouped: bool = True):
    """(hf_config, DDP-wrapped tiny megatron model, megatron optimizer); groups initialised.
    ``grouped``: grouped experts (the default), else megatron's SequentialMLP."""
    from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
    from megatron_rl.model import ModelOptions, build_model, preset_config

    torch.manual_seed(seed)
    config = preset_config("tiny")
    model = wrap_for_training(build_model(config, ModelOptions(moe_grouped_gemm=grouped)))
    optimizer = build_optimizer(model, OptimizerConfig(lr=3e-3, clip_grad=clip_grad))
    return config, model, optimizer


def train_steps(model, optimizer, vocab_size: int, num_steps: int) -> None:
    """CE steps on batches drawn from the global torch RNG (so resuming needs the RNG state)."""
    from megatron_rl.model import causal_lm_logits

    for _ in range(num_steps):
        tokens_BT = torch.randint(0, vocab_size, (BATCH, SEQ_LEN))
        optimizer.zero_grad()
        logits_BTV = causal_lm_logits(model, tokens_BT[:, :-1])
        loss = F.cross_entropy(logits_BTV.reshape(-1, vocab_size), tokens_BT[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def adam_state(optimizer) -> list[dict[str, torch.Tensor]]:
    """Per-parameter Adam state tensors (exp_avg, exp_avg_sq, step), cloned, in param order."""
    from megatron_rl.train.checkpoint.optimizer_state import inner_optimizers

    out = []
    for inner in inner_optimizers(optimizer):
        adam = inner.optimizer  # the torch Adam inside megatron's optimizer (fp32 main params)
        params = [p for group in adam.param_groups for p in group["params"]]
        out.extend({k: v.clone() for k, v in adam.state[p].items()} for p in params)
    return out


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def expert_parallel_worker(rank, world_size, init_method, tmp_dir) -> None:
    """EP=2: train, save, train on, load; writes ``result{rank}.pt`` with what was restored."""
    from megatron_rl.backend import ParallelConfig, init_distributed
    from megatron_rl.train.checkpoint.load import load_training_state
    from megatron_rl.train.checkpoint.save import save_training_state

    init_distributed(
        ParallelConfig(expert_parallel=2, seed=3),
        rank=rank,
        world_size=world_size,
        init_method=init_method,
        device="cpu",
    )
    config, model, optimizer = build_tiny(seed=11, clip_grad=0.0)
    save_dir = os.path.join(tmp_dir, "ckpt")
    train_steps(model, optimizer, config.vocab_size, 1)
    save_training_state(
        save_dir, 1, model=model, optimizer=optimizer, rl_state={"step": 1, "rank": rank}
    )
    saved_weights, saved_adam = weights(model), adam_state(optimizer)
    expected_draw = torch.rand(4)
    train_steps(model, optimizer, config.vocab_size, 1)
    rl_state = load_training_state(save_dir, model=model, optimizer=optimizer)
    restored_adam = adam_state(optimizer)
    torch.save(
        {
            "rl_state": rl_state,
            "weights_equal": same_tensors(weights(model), saved_weights),
            "adam_equal": all(
                same_tensors(a, b) for a, b in zip(saved_adam, restored_adam, strict=True)
            ),
            "rng_equal": torch.equal(torch.rand(4), expected_draw),
            "expert_weight": weights(model)["decoder.layers.0.mlp.experts.weight1"][0],
        },
        os.path.join(tmp_dir, f"result{rank}.pt"),
    )
