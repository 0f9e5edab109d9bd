"""GLM-4.5 at TP=2 (+SP) and EP=2 on 2 gloo ranks: logits and routing equal transformers' on a
hidden config (q/k/v biases and the fused QKV split by query group, shared experts split over TP,
routed experts over EP), and the sharded HF export is bit-exact."""

from __future__ import annotations

import os

import pytest
import torch
from glm4_moe_testing import ATOL, hidden_config, make_glm_checkpoint
from qwen3_moe_testing import (
    fixed_input_ids,
    hf_reference,
    hf_routes_for_rank,
    megatron_forward,
    spawn_ranks,
)

SEED = 3


def glm_parity_worker(rank, world_size, init_method, tmp_dir, parallel_kwargs) -> None:
    """One rank: load the HF checkpoint's shards, compare with the reference, export HF again."""
    from megatron_rl.backend import ParallelConfig, init_distributed
    from megatron_rl.model import build_model
    from megatron_rl.model.conversion import load_checkpoint, save_checkpoint
    from megatron_rl.model.conversion.safetensors_io import CheckpointReader

    parallel = ParallelConfig(**parallel_kwargs)
    init_distributed(
        parallel, rank=rank, world_size=world_size, init_method=init_method, device="cpu"
    )
    reference = torch.load(os.path.join(tmp_dir, "reference.pt"))
    config = hidden_config()
    hf_dir = os.path.join(tmp_dir, "hf")
    model = build_model(config)
    load_checkpoint(model, hf_dir, config)
    model.eval()
    result = megatron_forward(model, reference["input_ids"])
    sp_size = parallel.tensor_parallel if parallel.sequence_parallel else 1
    expected = hf_routes_for_rank(reference["routes"], rank % sp_size, sp_size)
    out_hf = os.path.join(tmp_dir, "export_hf")
    save_checkpoint(model, config, out_hf, fmt="hf")
    exact = None
    if rank == 0:
        with CheckpointReader(hf_dir) as a, CheckpointReader(out_hf) as b:
            exact = sorted(a.names()) == sorted(b.names()) and all(
                torch.equal(a.get(n), b.get(n)) for n in a.names()
            )
    torch.save(
        {
            "diff": (result["logits"] - reference["logits"]).abs().max().item(),
            "routes_equal": [
                torch.equal(g, w) for g, w in zip(result["routes"], expected, strict=True)
            ],
            "exact_hf": exact,
        },
        os.path.join(tmp_dir, f"result{rank}.pt"),
    )


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param({"tensor_parallel": 2, "sequence_parallel": True}, id="tp2_sp"),
        pytest.param({"expert_parallel": 2}, id="ep2"),
    ],
)
def test_two_rank_logits_match_transformers_and_export_is_exact(tmp_path, parallel):
    config = hidden_config()
    hf_model = make_glm_checkpoint(tmp_path / "hf", config, SEED)
    input_ids = fixed_input_ids(config.vocab_size, seed=SEED + 1)
    torch.save(
        {**hf_reference(hf_model, input_ids), "input_ids": input_ids}, tmp_path / "reference.pt"
    )
    spawn_ranks(glm_parity_worker, tmp_path, 2, parallel)
    for rank in range(2):
        result = torch.load(os.path.join(tmp_path, f"result{rank}.pt"))
        print(f"glm4_moe {parallel} rank {rank}: max |logits diff| {result['diff']:.3e}")
        assert result["diff"] <= ATOL, f"rank {rank}: max |logits diff| {result['diff']:.3e}"
        assert len(result["routes_equal"]) == 3 and all(result["routes_equal"]), result
    assert torch.load(os.path.join(tmp_path, "result0.pt"))["exact_hf"], "HF export not exact"
