"""Gradients under TP=2 (+SP) and EP=2 equal those at world size 1: the same HF weights, the same
tokens, a causal-LM loss, megatron's DDP + ``finalize_model_grads`` (what the optimizer step runs),
gradients exported under HF names and compared element by element.

Before `ParallelConfig` tied ``expert_tensor_parallel`` to ``tensor_parallel`` when experts are not
expert-parallel, TP=2 kept each rank's own-token expert gradients unreduced (tp2 cases failed
with relative errors up to 1.2)."""

from __future__ import annotations

import os

import pytest
import torch
from qwen3_moe_testing import fixed_input_ids, make_hf_checkpoint, spawn_ranks, tiny_config

RTOL, ATOL = 1e-4, 1e-6


def grad_worker(rank, world_size, init_method, tmp_dir, parallel_kwargs) -> None:
    from megatron.core.distributed import finalize_model_grads

    from megatron_rl.backend import ParallelConfig, init_distributed
    from megatron_rl.backend.optimizer import wrap_for_training
    from megatron_rl.model import build_model, causal_lm_logits
    from megatron_rl.model.conversion import iter_hf_tensors, load_checkpoint

    parallel = ParallelConfig(**parallel_kwargs)
    init_distributed(
        parallel, rank=rank, world_size=world_size, init_method=init_method, device="cpu"
    )
    config = tiny_config()
    model = build_model(config)
    load_checkpoint(model, os.path.join(tmp_dir, "hf"), config)
    ddp = wrap_for_training(model, use_distributed_optimizer=False)
    ids = fixed_input_ids(config.vocab_size)
    logits = causal_lm_logits(ddp, ids).float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])
    (-logp.mean()).backward()
    finalize_model_grads([ddp])
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.main_grad)
    grads = {name: t.clone() for name, t in iter_hf_tensors(model, config)}
    if rank == 0:
        torch.save(grads, os.path.join(tmp_dir, f"grads_{world_size}.pt"))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param({"tensor_parallel": 2, "sequence_parallel": True}, id="tp2_sp"),
        pytest.param({"tensor_parallel": 2, "sequence_parallel": False}, id="tp2"),
        pytest.param({"expert_parallel": 2}, id="ep2"),
        pytest.param({"tensor_parallel": 2, "expert_parallel": 2}, id="tp2_sp_ep2"),
    ],
)
def test_two_rank_gradients_equal_world_size_one(tmp_path, parallel):
    for run in ("one", "two"):  # a rendezvous file each
        (tmp_path / run).mkdir()
        make_hf_checkpoint(str(tmp_path / run / "hf"), tiny_config())
    spawn_ranks(grad_worker, tmp_path / "one", 1, {})
    spawn_ranks(grad_worker, tmp_path / "two", 2, parallel)
    want = torch.load(tmp_path / "one" / "grads_1.pt")
    got = torch.load(tmp_path / "two" / "grads_2.pt")
    assert sorted(want) == sorted(got)
    bad = []
    for name, w in want.items():
        g = got[name]
        if not torch.allclose(g, w, rtol=RTOL, atol=ATOL):
            bad.append(f"{name}: max |diff| {(g - w).abs().max():.3e}, max |w| {w.abs().max():.3e}")
    assert not bad, "\n".join(bad)
