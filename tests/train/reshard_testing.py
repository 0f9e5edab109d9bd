"""Helpers for the reshardable-checkpoint tests: a rank worker that trains the tiny model on
fixed batches at one TP/EP/DP layout and saves, or loads at another layout and steps once more.

Every phase writes ``{phase}.pt`` (rank 0) with the canonical (layout-independent) full tensors
of the model right after the save or load and after one more update on a fixed batch.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

SEQ_LEN = 9
BATCH = 2


def fixed_batch(index: int, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + index)
    return torch.randint(0, vocab_size, (BATCH, SEQ_LEN), generator=generator)


def train_on(model, optimizer, vocab_size: int, index: int) -> None:
    """One update on batch ``index``: each data-parallel rank takes its slice of the batch."""
    from megatron.core import parallel_state

    from megatron_rl.model import causal_lm_logits

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    tokens_BT = fixed_batch(index, vocab_size)[dp_rank::dp_size]
    optimizer.zero_grad()
    logits_BTV = causal_lm_logits(model, tokens_BT[:, :-1])
    loss = F.cross_entropy(logits_BTV.reshape(-1, vocab_size), tokens_BT[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()


def canonical(model, hf_config) -> dict[str, torch.Tensor]:
    from megatron_rl.model.conversion import iter_canonical_tensors

    return {name: t.detach().clone() for name, t in iter_canonical_tensors(model.module, hf_config)}


def reshard_worker(
    rank, world_size, init_method, tmp_dir, phase, parallel_kwargs, fmt, grouped=True
) -> None:
    """``phase`` "save": 2 updates, save step 2, 1 more update. Any other phase: load, 1 update
    (and with ``phase`` ending in "_control", a second load whose Adam moments are zeroed).
    ``grouped``: the model's experts are grouped (else megatron's SequentialMLP)."""
    from train_state_testing import build_tiny

    from megatron_rl.backend import ParallelConfig, init_distributed
    from megatron_rl.train.checkpoint.load import load_training_state
    from megatron_rl.train.checkpoint.optimizer_state import inner_optimizers
    from megatron_rl.train.checkpoint.save import save_training_state

    init_distributed(
        ParallelConfig(seed=3, **parallel_kwargs),
        rank=rank,
        world_size=world_size,
        init_method=init_method,
        device="cpu",
    )
    # no clipping: a TP2 expert-gradient difference (see the tests) would rescale every update
    hf_config, model, optimizer = build_tiny(
        seed=11 if phase == "save" else 99, clip_grad=0.0, grouped=grouped
    )
    vocab = hf_config.vocab_size
    save_dir = os.path.join(tmp_dir, "..", "ckpt")
    result: dict = {}
    if phase == "save":
        train_on(model, optimizer, vocab, 0)
        train_on(model, optimizer, vocab, 1)  # Adam moments of two updates: bias correction < 1
        save_training_state(
            save_dir, 2, model=model, optimizer=optimizer, rl_state={"step": 2}, fmt=fmt
        )
    else:
        result["rl_state"] = load_training_state(save_dir, model=model, optimizer=optimizer)
    result["loaded"] = canonical(model, hf_config)
    train_on(model, optimizer, vocab, 2)
    result["after"] = canonical(model, hf_config)
    if phase.endswith("_control"):
        load_training_state(save_dir, model=model, optimizer=optimizer)
        for inner in inner_optimizers(optimizer):
            for state in inner.optimizer.state.values():
                state["exp_avg"].zero_()
        train_on(model, optimizer, vocab, 2)
        result["after_without_exp_avg"] = canonical(model, hf_config)
    if rank == 0:
        torch.save(result, os.path.join(tmp_dir, f"{phase}.pt"))


def run_phase(tmp_path, phase: str, layout, fmt: str = "torch_dist", grouped: bool = True) -> dict:
    """Spawn `reshard_worker` for ``phase`` at ``layout`` (``(ParallelConfig kwargs, world
    size)``) in ``tmp_path / phase``; rank 0's result."""
    from qwen3_moe_testing import spawn_ranks

    kwargs, world_size = layout
    folder = tmp_path / phase
    folder.mkdir()
    spawn_ranks(reshard_worker, folder, world_size, phase, kwargs, fmt, grouped)
    return torch.load(folder / f"{phase}.pt")


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference over the same-named tensors of ``a`` and ``b``."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
