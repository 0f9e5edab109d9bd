"""Forward-only passes over merged micro-batches equal one forward per micro-batch.

The grouping is checked against brute force; on the tiny megatron model (world size 1, gloo)
the merged pass must give every micro-batch the log-probs of its own forward (to 1e-6: bitwise
with AVX-512 kernels, not with AVX2 ones, where MKL picks its kernel by the row count) with
routing replay off, R2 (each micro-batch's recording bitwise the one of its own forward, so the
updates replay the same routes) and R3 (the engine's routes replayed, the same agreement
counted), and the KL reference's pass likewise.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from merged_pass_testing import ROWS, TEMPERATURE, behaviour_logprobs, micro_batches, tiny_moe

from megatron_rl.moe_layers import moe_layer_numbers
from megatron_rl.routing.modes import ReplayConfig
from megatron_rl.routing.passes import TokenLayout, build_replay_passes
from megatron_rl.train.batch import merge_micro_batches
from megatron_rl.train.merged_pass import (
    DEFAULT_MAX_FORWARD_TOKENS,
    forward_token_budget,
    plan_forwards,
    split_to_count,
)
from megatron_rl.train.reference import ReferencePolicy


# ------------------------------------------------------------------ grouping (pure)
def _fewest_sorted_runs(shapes, max_tokens, pad_widths) -> int:
    """Brute force: the fewest runs of the width-sorted order that each fit the budget (and
    hold one width unless ``pad_widths``)."""
    order = sorted(range(len(shapes)), key=lambda i: (-shapes[i][1], i))
    best = len(order)
    for cuts in itertools.product([False, True], repeat=len(order) - 1):
        runs, start = [], 0
        for j, cut in enumerate(cuts, start=1):
            if cut:
                runs.append(order[start:j])
                start = j
        runs.append(order[start:])
        fits = all(
            len(r) == 1
            or (
                sum(shapes[i][0] for i in r) * shapes[r[0]][1] <= max_tokens
                and (pad_widths or len({shapes[i][1] for i in r}) == 1)
            )
            for r in runs
        )
        if fits:
            best = min(best, len(runs))
    return best


@pytest.mark.parametrize("pad_widths", [False, True])
def test_plan_forwards_fits_the_budget_with_the_fewest_sorted_runs(pad_widths):
    rng = random.Random(0)
    for _ in range(200):
        shapes = [(rng.randint(1, 4), rng.randint(2, 6)) for _ in range(rng.randint(1, 7))]
        budget = rng.randint(1, 40)
        groups = plan_forwards(shapes, budget, pad_widths=pad_widths)
        assert sorted(i for g in groups for i in g) == list(range(len(shapes)))
        for g in groups:
            padded = sum(shapes[i][0] for i in g) * max(shapes[i][1] for i in g)
            assert len(g) == 1 or padded <= budget, (shapes, budget, groups)
            assert pad_widths or len({shapes[i][1] for i in g}) == 1
        assert len(groups) == _fewest_sorted_runs(shapes, budget, pad_widths)


def test_a_budget_of_zero_runs_one_forward_per_micro_batch():
    assert plan_forwards([(2, 5), (2, 9), (2, 5)], 0, pad_widths=True) == [[1], [0], [2]]
    assert plan_forwards([(2, 5), (2, 9), (2, 5)], 100) == [[1], [0, 2]]
    with pytest.raises(ValueError, match="max_tokens=-1"):
        plan_forwards([(2, 5)], -1)


def test_split_to_count_halves_the_largest_groups_until_the_count_or_singletons():
    assert split_to_count([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert split_to_count([[0, 1, 2], [3, 4]], 3) == [[0, 1], [2], [3, 4]]
    assert split_to_count([[0], [1, 2]], 5) == [[0], [1], [2]]  # no more forwards to make
    assert split_to_count([[0, 1]], 1) == [[0, 1]]


def test_the_forward_budget_is_the_update_budget_or_the_default():
    assert forward_token_budget(None) == DEFAULT_MAX_FORWARD_TOKENS
    assert forward_token_budget(512) == 512


# ------------------------------------------------------------------ micro-batches
def test_merged_micro_batches_hold_every_part_in_its_rows_and_pad_neutrally(ws1):
    config, _ = tiny_moe()
    parts = micro_batches(config)[:3]
    merged = merge_micro_batches(parts, pad_id=7)
    width = max(mb.tokens_BS.shape[1] for mb in parts)
    assert merged.tokens_BS.shape == (3 * ROWS, width)
    assert merged.lengths == [n for mb in parts for n in mb.lengths]
    assert merged.routed().routes == [s.routes for mb in parts for s in mb.samples]
    for p, mb in enumerate(parts):
        rows, s = slice(p * ROWS, (p + 1) * ROWS), mb.tokens_BS.shape[1]
        assert torch.equal(merged.tokens_BS[rows, :s], mb.tokens_BS)
        assert bool((merged.tokens_BS[rows, s:] == 7).all())
        for field in ("loss_mask_BT", "rollout_logprobs_BT", "token_versions_BT"):
            assert torch.equal(getattr(merged, field)[rows, : s - 1], getattr(mb, field))
        assert not merged.loss_mask_BT[rows, s - 1 :].any()
        assert bool((merged.token_versions_BT[rows, s - 1 :] == -1).all())
    assert merged.num_tokens == sum(mb.num_tokens for mb in parts)


# ------------------------------------------------------------------ the tiny model
def _passes(model, config, mode, layout=None):
    replay = ReplayConfig(mode=mode) if mode != "off" else ReplayConfig()
    return build_replay_passes(
        model,
        replay,
        num_experts=config.num_experts,
        topk=config.num_experts_per_tok,
        moe_layer_numbers=moe_layer_numbers(config),
        layout=layout or TokenLayout(),
    )


@pytest.fixture
def threads(request):
    """Intra-op threads for the test (the trainer runs one per process on this machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(getattr(request, "param", 1))
    yield torch.get_num_threads()
    torch.set_num_threads(before)


def _assert_same_logprobs(got, want, mbs, *, bitwise: bool):
    """Equal on every real token's position to 1e-6. ``bitwise`` is where the two forwards
    were bitwise equal on the machines measured (one torch thread, equal widths); it is not
    asserted: with torch's AVX2 kernels MKL picks its GEMM kernel by the row count, so a merged
    forward (more rows) rounds otherwise (docs/testing.md)."""
    for k, mb in enumerate(mbs):
        real = torch.zeros_like(mb.loss_mask_BT)
        for row, n in enumerate(mb.lengths):
            real[row, : n - 1] = True
        torch.testing.assert_close(got[k][real], want[k][real], rtol=0, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("mode", ["off", "r3"])
def test_merged_forwards_give_each_micro_batch_its_own_logprobs(ws1, mode, threads):
    config, model = tiny_moe()
    model.eval()
    mbs = micro_batches(config)
    passes = _passes(model, config, mode)
    want, unmerged = behaviour_logprobs(model, mbs, passes, None)
    want_metrics = passes.metrics()
    passes.end_step()
    got, merged = behaviour_logprobs(model, mbs, passes, 2 * ROWS * 19)
    assert (unmerged, merged) == (5, 3)
    _assert_same_logprobs(got, want, mbs, bitwise=threads == 1)
    assert passes.metrics() == want_metrics  # R3: the same tokens agree, the same route bytes
    got, merged = behaviour_logprobs(model, mbs, passes, 10_000)
    assert merged == 2  # one forward per width
    _assert_same_logprobs(got, want, mbs, bitwise=threads == 1)
    passes.end_step()
    got, merged = behaviour_logprobs(model, mbs, passes, 10_000, pad_widths=True)
    assert merged == 1
    _assert_same_logprobs(got, want, mbs, bitwise=False)
    assert passes.metrics() == want_metrics
    passes.close()


def test_r3_replay_reaches_the_merged_forward(ws1):
    """The merged R3 pass differs from free routing: the engine's routes were replayed."""
    config, model = tiny_moe()
    model.eval()
    mbs = micro_batches(config)
    off = _passes(model, config, "off")
    free, _ = behaviour_logprobs(model, mbs, off, 10_000, pad_widths=True)
    passes = _passes(model, config, "r3")
    replayed, _ = behaviour_logprobs(model, mbs, passes, 10_000, pad_widths=True)
    assert any(not torch.equal(a, b) for a, b in zip(free, replayed, strict=True))
    assert passes.metrics()["routing/agreement/behaviour"] < 0.9
    passes.close()


@pytest.mark.parametrize(("dtype", "pad_widths"), [("auto", False), ("packed", True)])
def test_r2_splits_the_merged_recording_into_each_micro_batchs_own(ws1, dtype, pad_widths, threads):
    """Each micro-batch's recording is bitwise its own forward's, also where it merged with
    wider ones (``pad_widths``: log-probs to 1e-6, the routing the same on this model)."""
    config, model = tiny_moe()
    model.eval()
    mbs = micro_batches(config)
    passes = build_replay_passes(
        model,
        ReplayConfig(mode="r2", dtype=dtype),
        num_experts=config.num_experts,
        topk=config.num_experts_per_tok,
        moe_layer_numbers=moe_layer_numbers(config),
        layout=TokenLayout(),
    )
    driver = passes.driver
    want, _ = behaviour_logprobs(model, mbs, passes, None)
    recorded = dict(driver._recorded)
    want_bytes = passes.metrics()["routing/state_bytes"]
    passes.end_step()
    got, merged = behaviour_logprobs(model, mbs, passes, 10_000, pad_widths=pad_widths)
    assert merged == (1 if pad_widths else 2)
    _assert_same_logprobs(got, want, mbs, bitwise=not pad_widths)
    assert set(driver._recorded) == set(recorded)  # the merged forward's own key is gone
    for key, blob in recorded.items():
        assert torch.equal(driver._recorded[key].data, blob.data), key
        assert driver._recorded[key].num_tokens == blob.num_tokens
    assert passes.metrics()["routing/state_bytes"] == want_bytes
    # an update replays the split recording: its rows fit the micro-batch's own forward
    with torch.no_grad(), passes.update(("mb", 4), mbs[4].routed()):
        model(
            input_ids=mbs[4].tokens_BS,
            position_ids=torch.arange(mbs[4].tokens_BS.shape[1]).expand_as(mbs[4].tokens_BS),
            attention_mask=None,
        )
    passes.close()


def test_r2_under_sequence_parallelism_runs_one_forward_per_micro_batch(ws1):
    config, model = tiny_moe()
    model.eval()
    mbs = micro_batches(config)
    layout = TokenLayout(tp_size=2, tp_rank=0, sequence_parallel=True)
    assert not _passes(model, config, "r2", layout).can_merge_behaviour()
    assert _passes(model, config, "r3", layout).can_merge_behaviour()
    passes = _passes(model, config, "r2", layout)
    _, forwards = behaviour_logprobs(model, mbs, passes, 10_000)
    assert forwards == len(mbs)
    passes.close()


def test_the_reference_pass_merges_to_the_same_logprobs(ws1, threads):
    config, model = tiny_moe()
    mbs = micro_batches(config)
    reference = ReferencePolicy(model, torch.device("cpu"), offload=False)
    want = reference.logprobs(mbs, TEMPERATURE)
    forwards = []
    handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    got = reference.logprobs(mbs, TEMPERATURE, max_tokens=10_000)
    handle.remove()
    assert len(forwards) == 2
    _assert_same_logprobs(got, want, mbs, bitwise=True)


def test_data_parallel_ranks_run_as_many_forwards_as_the_rank_with_most(ws1, monkeypatch):
    config, model = tiny_moe()
    mbs = micro_batches(config)
    passes = build_replay_passes(
        model,
        ReplayConfig(),
        num_experts=config.num_experts,
        topk=config.num_experts_per_tok,
        moe_layer_numbers=moe_layer_numbers(config),
        layout=TokenLayout(),
    )
    peers = []

    def max_over_ranks(values, group):  # a peer needs 4 forwards
        peers.append((list(values), group))
        return [4.0]

    monkeypatch.setattr("megatron_rl.train.merged_pass.max_over_ranks", max_over_ranks)
    got, forwards = behaviour_logprobs(model, mbs, passes, 10_000, group="dp")
    assert peers == [([2], "dp")] and forwards == 4
    want, _ = behaviour_logprobs(model, mbs, passes, None)
    for k in range(len(mbs)):
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
