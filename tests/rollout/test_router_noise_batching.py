"""Router noise per sample: batching, chunking and padding never change a sample's noise."""

from __future__ import annotations

import pytest
import torch
from rollout_testing import PROMPTS, make_engine

from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.router_noise import RouterNoise, gaussian_table
from megatron_rl.rollout.sampling import row_seed

PARAMS = SamplingParams(max_new_tokens=6, seed=7)


def _key(sample):
    return sample.response_ids_R.tolist(), sample.routes.data.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sample_gets_the_same_tokens_and_routes_alone_and_in_any_chunking(dtype):
    engine = make_engine(router_noise=0.3, dtype=dtype)
    batch = engine.generate(PROMPTS, PARAMS, n=3, return_routed_experts=True)
    engine.config.max_batch_size = 2  # chunks of 2 rows: other batch mates, other padding
    chunked = engine.generate(PROMPTS, PARAMS, n=3, return_routed_experts=True)
    assert [_key(s) for s in chunked] == [_key(s) for s in batch]
    for sample in batch:
        i, j = sample.prompt_index, sample.sample_index
        alone = engine.generate_one(
            PROMPTS[i], PARAMS, sample_seed=row_seed(7, i, j), return_routed_experts=True
        )
        assert _key(alone) == _key(sample)
    clean = make_engine(dtype=dtype).generate(PROMPTS, PARAMS, n=3, return_routed_experts=True)
    assert [s.routes.data.tolist() for s in clean] != [s.routes.data.tolist() for s in batch]


@pytest.mark.slow
def test_noise_seed_changes_the_routes_of_the_same_samples():
    first, other = (
        make_engine(router_noise=0.3, router_noise_seed=seed).generate(
            PROMPTS, PARAMS, n=2, return_routed_experts=True
        )
        for seed in (0, 1)
    )
    assert [s.routes.data.tolist() for s in first] != [s.routes.data.tolist() for s in other]


def test_row_identities_must_match_the_forward_batch():
    engine = make_engine()
    noise = RouterNoise(engine.model, 0.1, seed=0)
    with noise.rows([1, 2]), torch.no_grad(), pytest.raises(RuntimeError, match="3 rows"):
        engine.model(input_ids=torch.ones(3, 4, dtype=torch.long))
    noise.remove()


def test_noise_table_is_standard_normal():
    table = gaussian_table()
    assert table.numel() == 2**16 and torch.equal(table, -table.flip(0))
    assert abs(float(table.double().mean())) < 1e-9
    assert abs(float(table.double().std()) - 1.0) < 1e-3
