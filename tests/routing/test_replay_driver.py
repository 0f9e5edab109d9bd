"""R2 on a real megatron-core MoE model (world size 1, gloo): record, perturb, replay."""

from __future__ import annotations

import pytest
import torch
from replay_testing import chosen_experts, logits_of, make_driver, perturb_routers, tiny_moe

from megatron_rl.routing.replay import ReplayConfig


@pytest.fixture
def ws1_seed() -> int:
    return 3


def _tokens(config, batch=2, seq=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, seq), generator=gen)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [False, True])
def test_r2_replay_reproduces_recorded_routing_after_heavy_router_perturbation(ws1, recompute):
    config, model = tiny_moe(recompute=recompute)
    driver = make_driver(model, config, mode="r2")
    tokens = _tokens(config)
    with torch.no_grad(), driver.record("mb0"):
        _, recorded = chosen_experts(model, lambda: logits_of(model, tokens))

    perturb_routers(model)
    with torch.no_grad():
        _, free = chosen_experts(model, lambda: logits_of(model, tokens))
    changed = [
        (f != r).any(dim=-1).float().mean().item() for f, r in zip(free, recorded, strict=True)
    ]
    assert min(changed) > 0.5, f"perturbation must change most routes without replay: {changed}"

    model.zero_grad()
    with driver.replay(key="mb0"):
        logits, replayed = chosen_experts(model, lambda: logits_of(model, tokens))
        logits.float().pow(2).mean().backward()
    for layer, (got, want) in enumerate(zip(replayed, recorded, strict=True)):
        assert torch.equal(got, want), f"layer {layer} did not replay"
    router_grads = [m.weight.grad for m in driver.routers]
    assert all(g is not None and g.abs().sum() > 0 for g in router_grads), "router lost gradient"
    metrics = driver.metrics()
    assert metrics["routing/agreement/update"] < 0.5  # perturbed: disagrees with the replay
    assert metrics["routing/state_bytes"] == driver.codec.nbytes(2 * 12, 2)
    driver.end_step()
    assert driver.state_bytes() == 0
    driver.close()


def test_replay_with_wrong_row_count_is_a_runtime_error_naming_the_layer(ws1):
    config, model = tiny_moe()
    driver = make_driver(model, config, mode="r2")
    tokens = _tokens(config)
    with torch.no_grad(), driver.record("mb0"):
        logits_of(model, tokens)
    with (
        pytest.raises(
            RuntimeError, match=r"MoE layer 1: the forward routes 36 local tokens but 24"
        ),
        torch.no_grad(),
        driver.replay(key="mb0"),
    ):
        logits_of(model, _tokens(config, batch=3))
    driver.close()


def test_replayed_routes_must_be_consumed(ws1):
    config, model = tiny_moe()
    driver = make_driver(model, config, mode="r2")
    tokens = _tokens(config)
    with torch.no_grad(), driver.record("mb0"):
        logits_of(model, tokens)
    with pytest.raises(RuntimeError, match="consumed 0 time"), driver.replay(key="mb0"):
        pass  # no forward: the routes are left over
    with (
        pytest.raises(RuntimeError, match="no routes were recorded under key 'mb1'"),
        driver.replay(key="mb1"),
    ):
        pass
    driver.close()


@pytest.mark.slow
def test_record_only_measures_agreement_without_changing_routing(ws1):
    config, model = tiny_moe()
    driver = make_driver(model, config, mode="r2", record_only=True)
    tokens = _tokens(config)
    with torch.no_grad(), driver.record("mb0"):
        logits_of(model, tokens)
    with torch.no_grad(), driver.replay(key="mb0"):
        before = logits_of(model, tokens)
    assert driver.metrics()["routing/agreement/update"] == 1.0
    perturb_routers(model)
    with torch.no_grad():
        _, free = chosen_experts(model, lambda: logits_of(model, tokens))
    with torch.no_grad(), driver.replay(key="mb0"):
        _, observed = chosen_experts(model, lambda: logits_of(model, tokens))
    assert all(torch.equal(a, b) for a, b in zip(free, observed, strict=True))
    assert driver.metrics()["routing/agreement/update"] < 1.0
    assert before.shape[0] == 2
    driver.close()


def test_driver_needs_a_model_built_with_routing_replay(ws1):
    from replay_testing import moe_layer_numbers

    from megatron_rl.model import build_model, preset_config
    from megatron_rl.routing.replay import RoutingReplay

    config = preset_config("tiny")
    model = build_model(config)
    with pytest.raises(ValueError, match="routing_replay=True"):
        RoutingReplay(
            model,
            ReplayConfig(mode="r2"),
            num_experts=8,
            topk=2,
            moe_layer_numbers=moe_layer_numbers(config),
        )
    with pytest.raises(ValueError, match="--routing-record-only needs --routing-replay r2 or r3"):
        ReplayConfig(record_only=True)


def test_dense_layers_are_skipped_and_stage_local_layers_are_kept(ws1):
    from megatron_rl.model import ModelOptions, build_model, preset_config
    from megatron_rl.routing import RoutingCodec

    config = preset_config("tiny-dense-tied")  # layer 1 dense, layer 2 MoE
    model = build_model(config, ModelOptions(routing_replay=True))
    driver = make_driver(model, config, mode="r3")
    assert driver.layer_numbers == [2] and driver.layer_columns == [0]
    # a blob covering more MoE layers than this rank holds keeps only this rank's columns
    codec = RoutingCodec(8, 2, "uint8")
    routes = torch.stack([torch.randperm(8)[:2] for _ in range(5 * 3)]).reshape(5, 3, 2)
    driver.layer_columns = [2]  # as a later pipeline stage would hold
    kept = driver.keep_local_layers(codec.encode(routes))
    assert kept.num_layers == 1 and torch.equal(codec.decode(kept)[:, 0], routes[:, 2])
    driver.close()
