"""The in-process engine: seeded sampling, log-probs, captured routes, weight updates."""

from __future__ import annotations

import pytest
import torch
from rollout_testing import (
    PROMPTS,
    checkpoint_tensors,
    direct_logprobs,
    direct_routes,
    make_engine,
    random_hf_model,
    tiny_config,
)

from megatron_rl.rollout import RolloutEngine, SamplingParams
from megatron_rl.rollout.sampling import filter_top_k_top_p
from megatron_rl.routing import RoutingCodec

PARAMS = SamplingParams(max_new_tokens=6, seed=11)


@pytest.fixture(scope="module")
def engine():
    return make_engine()


def _ids(samples):
    return [s.response_ids_R.tolist() for s in samples]


def test_satisfies_protocol_and_orders_prompt_major(engine):
    assert isinstance(engine, RolloutEngine)
    samples = engine.generate(PROMPTS, PARAMS, n=2)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (i, j) for i in range(len(PROMPTS)) for j in range(2)
    ]
    for sample in samples:
        assert sample.prompt_ids_P.tolist() == PROMPTS[sample.prompt_index]
        assert sample.response_ids_R.numel() == 6 and sample.finish_reason == "length"
        assert sample.weight_version == 0


def test_same_seed_same_samples_other_seed_other_samples(engine):
    first = engine.generate(PROMPTS, PARAMS, n=2)
    again = engine.generate(PROMPTS, PARAMS, n=2)
    other = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, seed=12), n=2)
    assert _ids(first) == _ids(again)
    assert _ids(first) != _ids(other)
    assert _ids(first)[0] != _ids(first)[1], "two samples of one prompt must differ"


def test_a_sample_does_not_depend_on_the_rest_of_the_batch(engine):
    batch = engine.generate(PROMPTS, PARAMS, n=1)
    alone = engine.generate([PROMPTS[1]], PARAMS, n=1)
    # prompt index 1 in the batch vs 0 alone: derive the same generator by re-indexing.
    alone_as_1 = engine.generate([[0], PROMPTS[1]], PARAMS, n=1)[1]
    assert alone_as_1.response_ids_R.tolist() == batch[1].response_ids_R.tolist()
    assert alone[0].response_ids_R.numel() == 6


@pytest.mark.parametrize(
    "params,mode",
    [
        (SamplingParams(max_new_tokens=6, seed=1), "temperature"),
        (SamplingParams(max_new_tokens=6, seed=2, temperature=0.7, top_k=20), "temperature"),
        (SamplingParams(max_new_tokens=6, seed=3, temperature=1.3, top_p=0.9), "original"),
        (SamplingParams(max_new_tokens=6, temperature=0.0), "temperature"),
    ],
)
def test_logprobs_equal_a_direct_forward(params, mode):
    engine = make_engine(logprob_mode=mode)
    temperature = params.temperature if mode == "temperature" else 1.0
    for sample in engine.generate(PROMPTS, params, n=2):
        want = direct_logprobs(
            engine.model,
            sample.prompt_ids_P.tolist(),
            sample.response_ids_R.tolist(),
            temperature,
        )
        torch.testing.assert_close(sample.logprobs_R, want, atol=1e-5, rtol=0)


def test_greedy_follows_the_argmax_of_a_direct_forward(engine):
    sample = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=5, temperature=0))[0]
    ids = PROMPTS[0] + sample.response_ids_R.tolist()
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0]
    assert logits[len(PROMPTS[0]) - 1 : -1].argmax(-1).tolist() == sample.response_ids_R.tolist()


def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_top_k_top_p(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_top_k_top_p(logits, -1, 0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_top_k_top_p(logits, -1, 0.4)).tolist() == [[False, True, True, True]]
    engine = make_engine()
    top1 = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=5, top_k=1))
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0))
    assert _ids(top1) == _ids(greedy)


def test_stop_token_ends_a_sample_and_is_kept(engine):
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6, temperature=0))[0]
    stop = greedy.response_ids_R.tolist()[2]
    params = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=(stop,))
    sample = engine.generate([PROMPTS[0]], params)[0]
    cut = greedy.response_ids_R.tolist().index(stop) + 1
    assert sample.response_ids_R.tolist() == greedy.response_ids_R.tolist()[:cut]
    assert sample.finish_reason == "stop"


@pytest.mark.parametrize("codec", ["auto", "packed"])
def test_routes_cover_every_fed_position_and_match_the_gates(codec):
    engine = make_engine(routing_codec=codec)
    samples = engine.generate(PROMPTS, PARAMS, n=2, return_routed_experts=True)
    decoder = RoutingCodec(8, 2, codec)
    for sample in samples:
        ids = sample.prompt_ids_P.tolist() + sample.response_ids_R.tolist()
        assert sample.routes.num_tokens == len(ids) - 1 == sample.num_routed_positions
        got = decoder.decode(sample.routes).sort(-1).values
        want = direct_routes(engine.model, ids[:-1]).sort(-1).values
        assert got.shape == (len(ids) - 1, 2, 2)
        assert torch.equal(got, want), f"routes differ for sample {sample.prompt_index}"


def test_routes_skip_dense_layers():
    engine = make_engine(model_overrides={"mlp_only_layers": [0]})
    sample = engine.generate([PROMPTS[0]], PARAMS, return_routed_experts=True)[0]
    assert sample.routes.num_layers == 1 and engine.num_moe_layers == 1


def test_weight_update_loads_checkpoint_names_in_place_and_advances_version(tmp_path):
    engine = make_engine(seed=0)
    target = random_hf_model(tiny_config(), seed=7)
    tensors = checkpoint_tensors(target, tmp_path / "ckpt")
    assert any(".mlp.experts.3.up_proj.weight" in name for name, _ in tensors)
    engine.update_weights(tensors, version=5)
    assert engine.weight_version == 5
    for name, value in target.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], value), name
    sample = engine.generate([PROMPTS[0]], PARAMS)[0]
    assert sample.weight_version == 5


def test_bad_weight_stream_leaves_weights_and_version(tmp_path):
    engine = make_engine(seed=0)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    tensors = checkpoint_tensors(random_hf_model(tiny_config(), seed=7), tmp_path / "ckpt")
    bad_shape = [*tensors[:-1], (tensors[-1][0], torch.zeros(3))]
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(bad_shape, version=1)
    with pytest.raises(ValueError, match="not a tensor of this model"):
        engine.update_weights([*tensors, ("model.layers.9.bogus", torch.zeros(1))], version=1)
    nan = [
        (n, torch.full_like(t, float("nan")) if i == 3 else t) for i, (n, t) in enumerate(tensors)
    ]
    with pytest.raises(ValueError, match="non-finite"):
        engine.update_weights(nan, version=1)
    assert engine.weight_version == 0
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_bf16_engine_runs_and_shows_a_small_mismatch():
    fp32 = make_engine(seed=0)
    bf16 = make_engine(seed=0, dtype="bfloat16")
    params = SamplingParams(max_new_tokens=6, temperature=0)
    samples = bf16.generate(PROMPTS, params)
    gaps = []
    for sample in samples:
        want = direct_logprobs(
            fp32.model, sample.prompt_ids_P.tolist(), sample.response_ids_R.tolist()
        )
        gaps.append((sample.logprobs_R - want).abs().max().item())
    print(f"bf16 rollout vs fp32 log-prob gap: max {max(gaps):.3e}")
    assert 0 < max(gaps) < 0.5


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_are_value_errors(engine):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], PARAMS)
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 100000]], PARAMS)
    with pytest.raises(ValueError, match="n=0"):
        engine.generate([[1]], PARAMS, n=0)
