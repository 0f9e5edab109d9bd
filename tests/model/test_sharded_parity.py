"""TP=2 (+SP) and EP=2 on 2 gloo ranks: HF parity, identical routing, exact sharded round trips."""

from __future__ import annotations

import os

import pytest
import torch
from qwen3_moe_testing import (
    fixed_input_ids,
    hf_reference,
    make_hf_checkpoint,
    parity_worker,
    spawn_ranks,
    tiny_config,
)

ATOL = 1e-5


def _prepare(tmp_path) -> None:
    """HF checkpoint, its canonical Megatron twin (converted at world size 1), the reference."""
    from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.model import build_model
    from megatron_rl.model.conversion import load_checkpoint, save_checkpoint

    config = tiny_config()
    hf_model = make_hf_checkpoint(str(tmp_path / "hf"), config)
    input_ids = fixed_input_ids(config.vocab_size)
    reference = hf_reference(hf_model, input_ids)
    torch.save({**reference, "input_ids": input_ids}, tmp_path / "reference.pt")
    init_distributed(ParallelConfig(), init_method=f"file://{tmp_path}/rdzv0", device="cpu")
    try:
        model = build_model(config)
        load_checkpoint(model, tmp_path / "hf", config)
        save_checkpoint(model, config, tmp_path / "megatron", fmt="megatron")
    finally:
        destroy_distributed()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel",
    [
        pytest.param({"tensor_parallel": 2, "sequence_parallel": True}, id="tp2_sp"),
        pytest.param({"expert_parallel": 2}, id="ep2"),
    ],
)
def test_two_rank_logits_match_hf_and_round_trip_is_exact(tmp_path, parallel):
    _prepare(tmp_path)
    spawn_ranks(parity_worker, tmp_path, 2, parallel)
    for rank in range(2):
        result = torch.load(os.path.join(tmp_path, f"result{rank}.pt"))
        print(f"{parallel} rank {rank}: max |logits diff| {result['diff']:.3e}")
        assert result["diff"] < ATOL, f"rank {rank}: max |logits diff| {result['diff']:.3e}"
        assert result["routes_equal"] and all(result["routes_equal"]), result["routes_equal"]
        assert result["shards_equal"], f"rank {rank}: sharded canonical load != sharded HF load"
    assert result["routes_equal"]
    exact = torch.load(os.path.join(tmp_path, "result0.pt"))["exact_hf"]
    assert exact, "HF -> sharded Megatron -> HF export is not bit-exact"
