"""`ReplayPasses`: one policy per mode, on a real megatron-core MoE model (world size 1, gloo).

The trainer calls ``behaviour`` (old-logprob pass) and ``update`` around every micro-batch and
never branches on the mode; these tests prove what each mode does inside those calls.
"""

from __future__ import annotations

import pytest
import torch
from replay_testing import chosen_experts, logits_of, perturb_routers, tiny_moe

from megatron_rl.moe_layers import moe_layer_numbers
from megatron_rl.routing import RoutingCodec
from megatron_rl.routing.modes import ReplayConfig
from megatron_rl.routing.passes import (
    ReplayPasses,
    RoutedMicroBatch,
    TokenLayout,
    build_replay_passes,
)


@pytest.fixture
def ws1_seed() -> int:
    return 3


def _passes(model, config, **replay):
    return build_replay_passes(
        model,
        ReplayConfig(**replay),
        num_experts=config.num_experts,
        topk=config.num_experts_per_tok,
        moe_layer_numbers=moe_layer_numbers(config),
        layout=TokenLayout(),
    )


def _tokens(config, seq=10):
    return torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))


def test_off_runs_free_routing_and_reports_nothing(ws1):
    config, model = tiny_moe()
    passes = _passes(model, config)
    assert passes.driver is None
    batch = RoutedMicroBatch([10], 10, [None])
    tokens = _tokens(config)
    with torch.no_grad(), passes.behaviour((0, 0), batch):
        _, before = chosen_experts(model, lambda: logits_of(model, tokens))
    perturb_routers(model)
    with torch.no_grad(), passes.update((0, 0), batch):
        _, after = chosen_experts(model, lambda: logits_of(model, tokens))
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert passes.metrics() == {}
    passes.end_step()
    passes.close()


@pytest.mark.slow
def test_r2_records_in_the_behaviour_pass_and_replays_in_updates(ws1):
    config, model = tiny_moe()
    passes = _passes(model, config, mode="r2")
    batch = RoutedMicroBatch([10], 10, [None])  # R2 needs no engine routes
    tokens = _tokens(config)
    with torch.no_grad(), passes.behaviour(("mb", 0), batch):
        _, recorded = chosen_experts(model, lambda: logits_of(model, tokens))
    perturb_routers(model)
    with passes.update(("mb", 0), batch):
        logits, replayed = chosen_experts(model, lambda: logits_of(model, tokens))
        logits.float().pow(2).mean().backward()
    for got, want in zip(replayed, recorded, strict=True):
        assert torch.equal(got, want)
    assert passes.metrics()["routing/state_bytes"] > 0
    passes.end_step()
    with pytest.raises(RuntimeError, match="no routes"), passes.update(("mb", 0), batch):
        pass
    passes.close()


def test_r3_replays_the_engine_routes_in_both_passes(ws1):
    config, model = tiny_moe()
    seq = 10
    tokens = _tokens(config, seq)
    codec = RoutingCodec(config.num_experts, config.num_experts_per_tok)
    # the "engine" routes: what the unperturbed router picks for positions 0..seq-2
    with torch.no_grad():
        _, engine = chosen_experts(model, lambda: logits_of(model, tokens))
    routes_TLK = torch.stack(engine, dim=1)[: seq - 1]
    batch = RoutedMicroBatch([seq], seq, [codec.encode(routes_TLK)])
    perturb_routers(model)
    passes = _passes(model, config, mode="r3")
    for context in (passes.behaviour, passes.update):
        with torch.no_grad(), context((0, 0), batch):
            _, replayed = chosen_experts(model, lambda: logits_of(model, tokens))
        for layer, got in enumerate(replayed):
            assert torch.equal(got[: seq - 1], engine[layer][: seq - 1])
            assert torch.equal(got[seq - 1], engine[layer][seq - 2])  # last token: previous route
    passes.close()


def test_r3_without_engine_routes_is_a_runtime_error(ws1):
    config, model = tiny_moe()
    passes = _passes(model, config, mode="r3")
    with pytest.raises(RuntimeError, match="engine's routes"):
        passes.behaviour((0, 0), RoutedMicroBatch([10], 10, [None]))
    passes.close()


def test_a_driver_goes_with_every_mode_but_off():
    with pytest.raises(ValueError, match="mode='r2'"):
        ReplayPasses(None, mode="r2")
    with pytest.raises(ValueError, match="tp_rank=2"):
        TokenLayout(tp_size=2, tp_rank=2)


@pytest.mark.slow
def test_r3_agreement_is_reported_per_phase_and_sample_routes_count_as_bytes(ws1):
    config, model = tiny_moe()
    seq = 10
    tokens = _tokens(config, seq)
    codec = RoutingCodec(config.num_experts, config.num_experts_per_tok)
    with torch.no_grad():
        _, engine = chosen_experts(model, lambda: logits_of(model, tokens))
    blob = codec.encode(torch.stack(engine, dim=1)[: seq - 1])
    batch = RoutedMicroBatch([seq], seq, [blob])
    passes = _passes(model, config, mode="r3", record_only=True)
    with torch.no_grad(), passes.behaviour((0, 0), batch):  # same weights as the "engine"
        logits_of(model, tokens)
    perturb_routers(model)  # the update passes see a policy that moved
    with torch.no_grad(), passes.update((0, 0), batch):
        logits_of(model, tokens)
    metrics = passes.metrics()
    assert metrics["routing/agreement/behaviour"] == 1.0  # the final token is not counted
    assert metrics["routing/agreement/update"] < 0.5
    assert {f"routing/agreement/behaviour/layer_{n}" for n in moe_layer_numbers(config)} <= set(
        metrics
    )
    assert metrics["routing/state_bytes"] == 0  # R3 keeps no recordings in the driver...
    assert metrics["routing/bytes_per_rank"] == blob.nbytes  # ...the samples hold the routes
    passes.end_step()
    assert passes.metrics()["routing/bytes_per_rank"] == 0
    passes.close()
