"""R3 from an independent implementation: routes captured from the HF Qwen3-MoE model (hooks on
its gates) replay exactly in megatron-core, at world size 1 and over 2 gloo ranks (TP=2 with
sequence parallelism, EP=2), also after perturbing megatron's routers."""

from __future__ import annotations

import os

import pytest
import torch
from qwen3_moe_testing import make_hf_checkpoint, spawn_ranks, tiny_config
from replay_testing import chosen_experts, logits_of, make_driver, perturb_routers

from megatron_rl.routing import RoutingCodec, local_token_sources

BATCH, SEQ = 2, 8


def hf_sample_routes(hf_model, tokens_BT, codec: RoutingCodec):
    """What a rollout engine returns: per sample, routes of every position but the last, encoded."""
    per_layer: list[torch.Tensor] = []
    handles = [
        layer.mlp.gate.register_forward_hook(lambda m, a, out: per_layer.append(out[2]))
        for layer in hf_model.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    with torch.no_grad():
        hf_model(input_ids=tokens_BT)
    for handle in handles:
        handle.remove()
    routes_BTLK = torch.stack(per_layer, dim=1).reshape(BATCH, SEQ, len(per_layer), -1)
    return [codec.encode(routes_BTLK[b, : SEQ - 1]) for b in range(BATCH)], routes_BTLK


def expected_rows(routes_BTLK, tp_size=1, tp_rank=0, replayed=True):
    """HF routes in megatron's [s, b] row order for one SP chunk; replayed: final token = s - 2."""
    routes = routes_BTLK.clone()
    if replayed:
        routes[:, SEQ - 1] = routes[:, SEQ - 2]
    chunk = SEQ // tp_size
    local_SBLK = routes[:, tp_rank * chunk : (tp_rank + 1) * chunk].transpose(0, 1)
    rows_RLK = local_SBLK.reshape(-1, *routes.shape[2:])
    return [rows_RLK[:, j].sort(dim=-1).values for j in range(rows_RLK.shape[1])]


def r3_worker(rank, world_size, init_method, tmp_dir, parallel_kwargs) -> None:
    from megatron_rl.backend import ParallelConfig, init_distributed
    from megatron_rl.model import ModelOptions, build_model
    from megatron_rl.model.conversion import load_checkpoint

    parallel = ParallelConfig(**parallel_kwargs)
    init_distributed(
        parallel, rank=rank, world_size=world_size, init_method=init_method, device="cpu"
    )
    data = torch.load(os.path.join(tmp_dir, "r3.pt"), weights_only=False)  # test-written
    config = tiny_config()
    model = build_model(config, ModelOptions(routing_replay=True, recompute=data["recompute"]))
    load_checkpoint(model, os.path.join(tmp_dir, "hf"), config)
    driver = make_driver(model, config, mode="r3")
    sp = parallel.sequence_parallel
    tp_rank = rank % parallel.tensor_parallel
    sources = local_token_sources(
        [SEQ] * BATCH,
        seq_len=SEQ,
        tp_size=parallel.tensor_parallel,
        tp_rank=tp_rank,
        sequence_parallel=sp,
    )
    routes = driver.routes_for_micro_batch(data["blobs"], [SEQ] * BATCH, sources)
    with torch.no_grad():
        _, free = chosen_experts(model, lambda: logits_of(model, data["tokens"]))
    perturb_routers(model, seed=rank)  # different perturbation per rank: replay must not care
    with driver.replay(routes=routes):
        logits, replayed = chosen_experts(model, lambda: logits_of(model, data["tokens"]))
        logits.float().pow(2).mean().backward()
    chunk = (parallel.tensor_parallel if sp else 1, tp_rank if sp else 0)
    want = expected_rows(data["routes"], *chunk)
    hf_choice = expected_rows(data["routes"], *chunk, replayed=False)
    result = {
        "free_equal": [torch.equal(f, w) for f, w in zip(free, hf_choice, strict=True)],
        "replay_equal": [torch.equal(r, w) for r, w in zip(replayed, want, strict=True)],
        "router_grad": all(
            m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in driver.routers
        ),
    }
    torch.save(result, os.path.join(tmp_dir, f"result{rank}.pt"))
    driver.close()


def _prepare(tmp_path, recompute=False):
    config = tiny_config()
    hf_model = make_hf_checkpoint(str(tmp_path / "hf"), config)
    codec = RoutingCodec(config.num_experts, config.num_experts_per_tok, "packed")
    tokens = torch.randint(
        0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(4)
    )
    blobs, routes = hf_sample_routes(hf_model, tokens, codec)
    torch.save(
        {"blobs": blobs, "routes": routes, "tokens": tokens, "recompute": recompute},
        tmp_path / "r3.pt",
    )


def _check(tmp_path, world_size):
    for rank in range(world_size):
        result = torch.load(tmp_path / f"result{rank}.pt")
        # converted weights route like HF on the positions the engine processed
        assert all(result["free_equal"]), result
        assert all(result["replay_equal"]), result
        assert result["router_grad"]


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [False, True])
def test_r3_routes_from_hf_replay_exactly_at_world_size_1(tmp_path, recompute):
    _prepare(tmp_path, recompute)
    spawn_ranks(r3_worker, tmp_path, 1, {})
    _check(tmp_path, 1)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "parallel",
    [{"tensor_parallel": 2, "sequence_parallel": True}, {"expert_parallel": 2}],
    ids=["tp2_sp", "ep2"],
)
def test_r3_routes_from_hf_replay_exactly_on_two_ranks(tmp_path, parallel):
    _prepare(tmp_path, recompute=True)
    spawn_ranks(r3_worker, tmp_path, 2, parallel)
    _check(tmp_path, 2)
