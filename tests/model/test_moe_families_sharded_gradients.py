"""DeepSeek-V3 (MLA) and GLM-4.5 gradients under TP=2 (+SP) and EP=2 equal those at world size 1.

The seeded initial weights of the tiny presets (`init_from_seed`), the same tokens, a causal-LM
loss, megatron's DDP + ``finalize_model_grads`` (what the optimizer step runs); gradients are
exported under HF names and compared element by element, as tests/model/test_sharded_gradients.py
does for Qwen3-MoE.
"""

from __future__ import annotations

import os

import pytest
import torch
from qwen3_moe_testing import fixed_input_ids, spawn_ranks

RTOL, ATOL = 1e-4, 1e-6


def grad_worker(rank, world_size, init_method, tmp_dir, preset, parallel_kwargs) -> None:
    from megatron.core.distributed import finalize_model_grads

    from megatron_rl.backend import ParallelConfig, init_distributed
    from megatron_rl.backend.optimizer import wrap_for_training
    from megatron_rl.model import build_model, causal_lm_logits, preset_config
    from megatron_rl.model.conversion import iter_hf_tensors
    from megatron_rl.model.conversion.seeded_init import init_from_seed

    parallel = ParallelConfig(**parallel_kwargs)
    init_distributed(
        parallel, rank=rank, world_size=world_size, init_method=init_method, device="cpu"
    )
    config = preset_config(preset)
    model = build_model(config)
    init_from_seed(model, config, seed=7)
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
@pytest.mark.parametrize("preset", ["tiny-deepseek", "tiny-glm"])
@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param({"tensor_parallel": 2, "sequence_parallel": True}, id="tp2_sp"),
        pytest.param({"tensor_parallel": 2, "sequence_parallel": False}, id="tp2"),
        pytest.param({"expert_parallel": 2}, id="ep2"),
    ],
)
def test_two_rank_gradients_equal_world_size_one(tmp_path, preset, parallel):
    for run in ("one", "two"):  # a rendezvous file each
        (tmp_path / run).mkdir()
    spawn_ranks(grad_worker, tmp_path / "one", 1, preset, {})
    spawn_ranks(grad_worker, tmp_path / "two", 2, preset, parallel)
    want = torch.load(tmp_path / "one" / "grads_1.pt")
    got = torch.load(tmp_path / "two" / "grads_2.pt")
    assert sorted(want) == sorted(got)
    bad = []
    for name, w in want.items():
        g = got[name]
        if not torch.allclose(g, w, rtol=RTOL, atol=ATOL):
            bad.append(f"{name}: max |diff| {(g - w).abs().max():.3e}, max |w| {w.abs().max():.3e}")
    assert not bad, "\n".join(bad)
