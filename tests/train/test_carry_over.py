"""--carry-over-groups: a step trains on the first finished groups of a pool of B + M, the others
go on at the next rollout. Every drawn group is trained once, oldest first; a continued sample's
log-probs are the engine's for the whole sequence; the carried groups survive a checkpoint."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from rollout.rollout_testing import direct_logprobs, direct_routes, make_engine
from trainer_testing import StepRecorder, killed_after, rendezvous, small_config

from megatron_rl.data.sampler import PromptSampler
from megatron_rl.rollout import SamplingParams
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.rollouts.carry_over import CarryOver
from megatron_rl.train.trainer import Trainer

PROMPTS = {0: [5, 17, 33, 2], 1: [101, 7], 2: [9, 9, 250, 301, 44, 12], 3: [3, 8], 4: [77, 1, 9]}
PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=(0,), seed=11)


def _pool(engine, **overrides) -> CarryOver:
    values = dict(
        prompt_ids=PROMPTS.__getitem__,
        batch_groups=2,
        carry_groups=1,
        group_size=2,
        round_tokens=3,
        max_response_length=12,
    )
    values.update(overrides)
    return CarryOver(engine, **values)


def test_a_sample_continued_over_rounds_has_the_engines_logprobs_of_its_whole_sequence():
    """Rounds of 3 tokens: each round conditions on prompt + response so far, so the log-probs
    of every token equal one unpadded forward of the final sequence (same weights)."""
    engine = make_engine(seed=3)
    pool = _pool(engine)
    prompts, samples, metrics = pool.generate([0, 1, 2], 0, PARAMS)
    assert len(prompts) == 2 and len(samples) == 4 and len(pool.carried) == 1
    assert metrics["carry_over/rounds"] >= 2  # 12 tokens take 4 rounds of 3 unless stopped
    continued = [s for s in samples if s.response_ids_R.numel() > 3]
    assert continued, "no sample ran past one round"
    for s in samples:
        want = direct_logprobs(engine.model, s.prompt_ids_P.tolist(), s.response_ids_R.tolist())
        torch.testing.assert_close(s.logprobs_R, want, atol=2e-4, rtol=0)
        assert s.finish_reason == "stop" or s.response_ids_R.numel() == 12


def test_groups_are_taken_oldest_first_and_each_exactly_once():
    engine = make_engine(seed=5)
    pool = _pool(engine, round_tokens=1)
    seen: list[int] = []
    drawn = iter(range(100))
    prompts = [next(drawn) % 5 for _ in range(3)]
    for index in range(6):
        taken, samples, metrics = pool.generate(prompts, index, PARAMS)
        assert len(taken) == 2 and len(samples) == 4
        assert metrics["carry_over/carried_groups"] == 1.0
        seen.extend(taken)
        prompts = [next(drawn) % 5 for _ in range(2)]
    # every group drawn in rollouts 0..5 is taken once, but the one still carried
    carried = [g.prompt for g in pool.carried]
    all_drawn = [i % 5 for i in range(3 + 5 * 2)]
    assert sorted(seen + carried) == sorted(all_drawn)


def test_the_carried_state_survives_json_and_continues_identically():
    """A pool restored from its JSON state (what a checkpoint keeps) produces the same next
    rollout as the pool it was taken from."""
    a = _pool(make_engine(seed=7), round_tokens=2)
    b = _pool(make_engine(seed=7), round_tokens=2)
    a.generate([0, 1, 2], 0, PARAMS)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())), 0)
    assert b.state_after(0) == a.state_after(0)
    out_a = a.generate([3, 4], 1, PARAMS)
    out_b = b.generate([3, 4], 1, PARAMS)
    assert out_a[0] == out_b[0] and out_a[2] == out_b[2]
    for x, y in zip(out_a[1], out_b[1], strict=True):
        assert torch.equal(x.response_ids_R, y.response_ids_R)
        assert torch.equal(x.logprobs_R, y.logprobs_R)


def test_sampling_supports_of_every_round_are_kept_and_survive_json():
    """--logprobs-on-sampling-support across rounds: each token keeps the support it was drawn
    from, so a continued sample has one support row per response token, its token inside."""
    params = SamplingParams(
        max_new_tokens=12, top_k=4, stop_token_ids=(0,), seed=11, return_sampling_support=True
    )
    a = _pool(make_engine(seed=3), round_tokens=3)
    b = _pool(make_engine(seed=3), round_tokens=3)
    _, samples, _ = a.generate([0, 1, 2], 0, params)
    assert any(s.response_ids_R.numel() > 3 for s in samples)
    for s in samples:
        s.check()  # one row per token, each token in its row
        assert s.support_RK.shape[0] == s.response_ids_R.numel() and s.support_RK.shape[1] <= 4
    b.load_state_dict(json.loads(json.dumps(a.state_dict())), 0)
    for x, y in zip(
        a.generate([3, 4], 1, params)[1], b.generate([3, 4], 1, params)[1], strict=True
    ):
        assert torch.equal(x.support_RK, y.support_RK)


def test_r3_keeps_the_route_of_each_token_from_the_round_that_fed_it_first():
    """Routes of a continued sample: the rows of earlier rounds, then the rows of the new one
    from the first position it fed; with unchanged weights that equals one forward's routes."""
    engine = make_engine(seed=9)
    pool = _pool(engine, codec=engine.codec, round_tokens=2)
    _, samples, _ = pool.generate([0, 1, 2], 0, PARAMS)
    for s in samples:
        ids = s.prompt_ids_P.tolist() + s.response_ids_R.tolist()
        routes = engine.codec.decode(s.routes)
        assert routes.shape[0] == len(ids) - 1
        want = direct_routes(engine.model, ids)[: len(ids) - 1]
        agree = (routes.sort(-1).values == want.sort(-1).values).float().mean()
        assert agree > 0.97, agree  # batched vs unpadded forwards may flip near-ties


def test_config_refusals():
    with pytest.raises(ValueError, match="--carry-over-groups: a sample spanning"):
        TrainConfig.from_flags(carry_over_groups=2)
    with pytest.raises(ValueError, match="--dynamic-sampling"):
        TrainConfig.from_flags(
            carry_over_groups=2, dynamic_sampling=True, behavior_logprobs="rollout"
        )
    with pytest.raises(ValueError, match="needs --carry-over-groups"):
        TrainConfig.from_flags(carry_over_round_tokens=2)
    config = TrainConfig.from_flags(
        carry_over_groups=2, behavior_logprobs="rollout", mask_stale_tokens=True, max_staleness=2
    )
    assert config.rollout.round_tokens == max(1, config.rollout.max_response_length // 4)


def _carry_config(tmp_path, **overrides) -> TrainConfig:
    values = dict(
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        global_batch_size=4,
        micro_batch_size=4,
        max_response_length=4,
        carry_over_groups=2,
        carry_over_round_tokens=1,
        behavior_logprobs="rollout",
    )
    values.update(overrides)
    return small_config(tmp_path, **values)


@pytest.mark.parametrize("async_rollout", [False, True])
def test_the_trainer_trains_every_drawn_group_once_and_carries_the_rest(
    tmp_path, monkeypatch, async_rollout
):
    """8 steps of B = 2 groups from a pool of 4 (M = 2), one token per round: every prompt the
    sampler drew (4, then 2 a rollout) is trained once or is among the 2 still carried; some
    batches hold groups carried from an earlier step, and some samples span weight versions."""
    recorder = StepRecorder(monkeypatch)
    flags = {"async_rollout": True, "max_staleness": 2} if async_rollout else {}
    trainer = Trainer(_carry_config(tmp_path, train_iters=8, **flags), **rendezvous(tmp_path))
    try:
        sampler = trainer.rollouts.sampler
        fresh = PromptSampler(sampler.num_records, seed=sampler.seed)
        drawn = fresh.next_batch(4) + [p for _ in range(7) for p in fresh.next_batch(2)]
        rows = [trainer.step() for _ in range(8)]  # nothing is drawn beyond --train-iters
        carried = [g.prompt for g in trainer.rollouts.carry_over.carried]
    finally:
        trainer.close()
    trained = [p for step in recorder.steps for p in step["prompts"]]
    assert all(len(step["prompts"]) == 2 for step in recorder.steps)
    for step in recorder.steps:  # every sample belongs to a prompt its step claims
        assert sorted(step["sample_prompts"]) == sorted(p for p in step["prompts"] for _ in "ab")
    assert sorted(trained + carried) == sorted(drawn)  # none lost, none twice
    assert sum(r["carry_over/taken_from_earlier"] for r in rows) > 0
    assert sum(r["carry_over/spanning_samples"] for r in rows) > 0
    spanning = [sp for step in recorder.steps for sp in step["spans"] if sp]
    for spans in spanning:  # contiguous segments, increasing versions
        assert spans[0][1] == 0 and all(a[2] == b[1] for a, b in itertools.pairwise(spans))
        assert [v for v, _, _ in spans] == sorted({v for v, _, _ in spans})
    assert max(r["carry_over/max_age"] for r in rows) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("async_rollout", [False, True])
def test_a_resume_goes_on_with_the_carried_groups_of_the_checkpoint(
    tmp_path, monkeypatch, async_rollout
):
    """Killed after step 3 with a checkpoint at step 2: the resumed run trains the same groups
    (and, synchronously, the same samples) from step 3 on as the uninterrupted run; async with
    K = 2 and partial rollouts (the sync parks the running generation) too."""
    from megatron_rl.train.run import run

    recorder = StepRecorder(monkeypatch)
    flags = {"async_rollout": True, "max_staleness": 2, "partial_rollout": True}
    flags = flags if async_rollout else {}
    straight = _carry_config(tmp_path / "a", train_iters=6, **flags)
    run(straight, **rendezvous(tmp_path, "rdzv_a"))
    uninterrupted = list(recorder.steps)
    recorder.steps.clear()
    first = _carry_config(
        tmp_path / "b", train_iters=6, save=str(tmp_path / "b" / "ckpt"), save_interval=2, **flags
    )
    with killed_after(3):
        run(first, **rendezvous(tmp_path, "rdzv_b1"))
    state = json.loads((tmp_path / "b" / "ckpt" / "step_00000002" / "rl_state.json").read_text())
    assert len(state["carry_over"]) == 1 and len(state["carry_over"][0]["groups"]) == 2
    run(first.with_flags(load=first.checkpoint.save), **rendezvous(tmp_path, "rdzv_b2"))
    resumed = recorder.steps[3:]
    assert [s["prompts"] for s in resumed] == [s["prompts"] for s in uninterrupted[2:]]
    if not async_rollout:  # deterministic: the same weights, seeds and carried tokens
        assert [s["responses"] for s in resumed] == [s["responses"] for s in uninterrupted[2:]]
