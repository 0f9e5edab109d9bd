"""`megatron_stage_layers` splits (and refuses) the decoder layers over pipeline stages as
megatron-core does."""

from __future__ import annotations

import re

import pytest
import torch

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


@pytest.mark.parametrize(
    ("layers", "pp", "vp", "first", "last"),
    [
        (4, 2, 2, None, None),
        (8, 2, 4, None, None),
        (16, 4, 2, None, None),
        (12, 2, 2, 4, None),
        (14, 4, 2, 2, 4),
        (62, 4, 2, 14, 16),
    ],
)
def test_virtual_chunk_layers_are_megatrons_offsets_and_counts(layers, pp, vp, first, last):
    """Against megatron-core's own ``get_transformer_layer_offset`` / ``get_num_layers_to_build``
    for every (pipeline rank, chunk)."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_rl.model.stages import virtual_chunk_layers

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=8,
        num_attention_heads=2,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        pipeline_dtype=torch.float32,
    )
    split = virtual_chunk_layers(layers, pp, vp, first, last)
    for rank in range(pp):
        for chunk in range(vp):
            offset = get_transformer_layer_offset(config, vp_stage=chunk, pp_rank=rank)
            count = get_num_layers_to_build(config, vp_stage=chunk, pp_rank=rank)
            assert split[rank][chunk] == (offset, count), (rank, chunk)
    assert sorted(o + i for row in split for o, n in row for i in range(n)) == list(range(layers))


def test_virtual_chunk_layers_refuse_a_stage_that_does_not_divide():
    from megatron_rl.model.stages import virtual_chunk_layers

    with pytest.raises(ValueError, match="pipeline stage 0 holds 3 layers, not divisible by"):
        virtual_chunk_layers(8, 2, 2, first=3)


@pytest.mark.parametrize(
    ("kwargs", "size"),
    [
        (dict(virtual_stages=2), 2),
        (dict(virtual_stages=1), None),
        (dict(), None),
        (dict(layers_per_virtual_stage=3), 2),  # 12 layers / PP 2 / 3
    ],
)
def test_virtual_stage_size_follows_megatron_lms_two_flags(kwargs, size):
    from megatron_rl.model.stages import virtual_stage_size

    assert virtual_stage_size(12, 2, **kwargs) == size


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(pipeline_parallel=1, virtual_stages=2), "needs --pipeline-model-parallel-size > 1"),
        (dict(virtual_stages=2, layers_per_virtual_stage=3), "both given"),
        (dict(layers_per_virtual_stage=3, uneven=True), "Megatron-LM refuses it"),
        (dict(layers_per_virtual_stage=4), "do not split into chunks of that size"),
    ],
)
def test_virtual_stage_size_refuses_what_megatron_lm_refuses(kwargs, message):
    from megatron_rl.model.stages import virtual_stage_size

    kwargs.setdefault("pipeline_parallel", 2)
    with pytest.raises(ValueError, match=message):
        virtual_stage_size(12, **kwargs)


@pytest.mark.parametrize(
    ("count", "pp", "group"), [(4, 2, 2), (3, 2, 3), (5, 2, 3), (6, 4, 6), (8, 4, 4), (9, 4, 5)]
)
def test_interleaved_group_size_is_the_smallest_megatron_accepts(count, pp, group):
    """Megatron refuses N outside [PP, M] and a last group of 0 < M % N < PP micro-batches."""
    from megatron_rl.model.stages import interleaved_group_size

    n = interleaved_group_size(count, pp)
    assert n == group
    assert pp <= n <= count and (count % n == 0 or count % n >= pp)
