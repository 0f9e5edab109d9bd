"""PromptSampler: epochs are permutations, batches cross epochs, resuming reproduces the run."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_rl.data import PromptSampler


def test_each_epoch_is_a_permutation_and_epochs_differ():
    sampler = PromptSampler(10, seed=3)
    first, second = sampler.next_batch(10), sampler.next_batch(10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second
    assert sampler.state_dict()["epoch"] == 2


def test_batch_crosses_the_epoch_boundary():
    reference = PromptSampler(5, seed=1)
    epochs = reference.next_batch(5) + reference.next_batch(5)
    sampler = PromptSampler(5, seed=1)
    assert sampler.next_batch(3) + sampler.next_batch(4) + sampler.next_batch(3) == epochs


def test_same_seed_same_order_other_seed_other_order_no_shuffle_in_order():
    assert PromptSampler(20, seed=0).next_batch(20) == PromptSampler(20, seed=0).next_batch(20)
    assert PromptSampler(20, seed=0).next_batch(20) != PromptSampler(20, seed=1).next_batch(20)
    assert PromptSampler(4, seed=0, shuffle=False).next_batch(6) == [0, 1, 2, 3, 0, 1]


@settings(max_examples=30, deadline=None)
@given(
    num_records=st.integers(1, 12),
    sizes=st.lists(st.integers(1, 15), min_size=2, max_size=8),
    stop=st.integers(0, 7),
)
def test_resume_from_state_dict_matches_uninterrupted_run(num_records, sizes, stop):
    stop = min(stop, len(sizes))
    uninterrupted = PromptSampler(num_records, seed=7)
    expected = [uninterrupted.next_batch(s) for s in sizes]
    first = PromptSampler(num_records, seed=7)
    got = [first.next_batch(s) for s in sizes[:stop]]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = PromptSampler(num_records, seed=7)
    resumed.load_state_dict(state)
    got += [resumed.next_batch(s) for s in sizes[stop:]]
    assert got == expected


def test_load_state_dict_refuses_another_seed_or_dataset_size():
    state = PromptSampler(10, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1 but this sampler has seed=2"):
        PromptSampler(10, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_records=10 but this sampler has num_records=9"):
        PromptSampler(9, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="lacks 'position'"):
        PromptSampler(10, seed=1).load_state_dict({"epoch": 0, "seed": 1})


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_sizes_raise(bad):
    with pytest.raises(ValueError, match="num_records"):
        PromptSampler(bad, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        PromptSampler(3, seed=0).next_batch(bad)
