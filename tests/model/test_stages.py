"""`megatron_stage_layers` splits (and refuses) the decoder layers over pipeline stages as
megatron-core does."""

from __future__ import annotations

import re

import pytest

from megatron_rl.memory_plan import load_model_config
from megatron_rl.model.stages import megatron_stage_layers


@pytest.mark.parametrize(
    ("pp", "first", "last", "stages"),
    [
        (1, None, None, (94,)),
        (2, None, None, (47, 47)),
        (4, 23, 23, (23, 24, 24, 23)),
        (4, None, 22, (24, 24, 24, 22)),
        (4, 22, None, (22, 24, 24, 24)),
        (2, 40, 54, (40, 54)),
    ],
)
def test_megatron_stage_layers_split_like_megatron(pp, first, last, stages):
    assert megatron_stage_layers(94, pp, first, last) == stages


@pytest.mark.parametrize(
    ("pp", "first", "last", "message"),
    [
        (4, 22, 23, "49 layers left after the first/last stages do not split evenly over the 2"),
        (4, None, None, "94 layers left"),
        (1, 23, None, "need pipeline parallel size > 1"),
        (2, 40, 50, "first 40 + last 50 layers != num_hidden_layers=94"),
        (4, 0, 23, "first stage layers=0: must be >= 1"),
    ],
)
def test_megatron_stage_layers_refuses_what_megatron_refuses(pp, first, last, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        megatron_stage_layers(94, pp, first, last)


def test_megatron_stage_layers_agree_with_megatrons_transformer_config(monkeypatch):
    """The split megatron-core's own `TransformerConfig` makes (and refuses) from the trainer's
    --decoder-first/last-pipeline-num-layers."""
    from megatron.core import parallel_state

    from megatron_rl.model.config import ModelOptions, to_transformer_config

    sizes = {"tensor_model_parallel": 4, "pipeline_model_parallel": 4, "context_parallel": 1}
    sizes |= {"expert_model_parallel": 8, "expert_tensor_parallel": 1}
    for name, size in sizes.items():
        monkeypatch.setattr(parallel_state, f"get_{name}_world_size", lambda size=size: size)
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    config = load_model_config("qwen3-235b-a22b")

    def megatron_split(first, last):
        options = ModelOptions(dtype="bfloat16", first_stage_layers=first, last_stage_layers=last)
        megatron = to_transformer_config(config, options, use_te=False)
        return tuple(get_num_layers_to_build(megatron, pp_rank=rank) for rank in range(4))

    for first, last in ((23, 23), (22, None), (None, 22)):
        assert megatron_stage_layers(94, 4, first, last) == megatron_split(first, last)
    for first, last in ((22, 23), (None, 26), (None, None)):  # both refuse the same splits
        with pytest.raises((ValueError, AssertionError)):
            megatron_split(first, last)
        with pytest.raises(ValueError):
            megatron_stage_layers(94, 4, first, last)
