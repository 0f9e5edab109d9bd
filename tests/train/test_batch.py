"""Micro-batch layout: tokens padded to [b, s], per-token fields on predicted positions [b, s - 1].

The log-prob of response token j (absolute position P + j) is predicted at position P + j - 1, so
``loss_mask`` is true exactly on [P - 1, P + R - 1) of each row and the rollout log-probs sit there.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.train.batch import MicroBatch, TrainSample, make_micro_batch, split

PAD = 99


def _sample(prompt, response, logprobs, advantage=0.0, in_loss=True, reward=0.0) -> TrainSample:
    return TrainSample(
        prompt_ids=torch.tensor(prompt, dtype=torch.int64),
        response_ids=torch.tensor(response, dtype=torch.int64),
        rollout_logprobs=torch.tensor(logprobs, dtype=torch.float32),
        advantage=advantage,
        reward=reward,
        in_loss=in_loss,
    )


def _two_samples() -> list[TrainSample]:
    return [
        # P = 3, R = 2: length 5, mask on predicted positions [2, 4)
        _sample([11, 12, 13], [21, 22], [-0.5, -1.5], advantage=0.75),
        # P = 2, R = 4: length 6, mask on predicted positions [1, 5)
        _sample([31, 32], [41, 42, 43, 44], [-0.1, -0.2, -0.3, -0.4], advantage=-1.25),
    ]


def test_sample_length_is_prompt_plus_response():
    assert _two_samples()[0].length == 5 and _two_samples()[1].length == 6


def test_tokens_are_prompt_then_response_then_pad():
    mb = make_micro_batch(_two_samples(), pad_id=PAD)
    assert isinstance(mb, MicroBatch)
    assert mb.tokens_BS.dtype == torch.int64
    assert mb.tokens_BS.tolist() == [
        [11, 12, 13, 21, 22, PAD],
        [31, 32, 41, 42, 43, 44],
    ]
    assert mb.lengths == [5, 6]


def test_loss_mask_and_rollout_logprobs_sit_on_predicted_positions():
    mb = make_micro_batch(_two_samples(), pad_id=PAD)
    assert mb.loss_mask_BT.shape == mb.rollout_logprobs_BT.shape == (2, 5)
    assert mb.loss_mask_BT.dtype == torch.bool
    assert mb.rollout_logprobs_BT.dtype == torch.float32
    assert mb.loss_mask_BT.tolist() == [
        [False, False, True, True, False],
        [False, True, True, True, True],
    ]
    expected = torch.tensor(
        [
            [0.0, 0.0, -0.5, -1.5, 0.0],
            [0.0, -0.1, -0.2, -0.3, -0.4],
        ]
    )
    assert torch.equal(mb.rollout_logprobs_BT, expected)


def test_masked_positions_predict_exactly_the_response_tokens():
    # Position t predicts tokens[t + 1]: under the mask those targets are the response, in order.
    samples = _two_samples()
    mb = make_micro_batch(samples, pad_id=PAD)
    targets = mb.tokens_BS[:, 1:]
    for i, sample in enumerate(samples):
        assert torch.equal(targets[i][mb.loss_mask_BT[i]], sample.response_ids)
        assert torch.equal(mb.rollout_logprobs_BT[i][mb.loss_mask_BT[i]], sample.rollout_logprobs)
        # The position just before the mask predicts the first response token (P + 0 - 1).
        p = sample.prompt_ids.numel()
        assert int(targets[i, p - 1]) == int(sample.response_ids[0])


def test_rows_of_very_different_lengths_pad_with_pad_id():
    samples = [
        _sample([5], [6], [-2.0]),  # length 2
        _sample([1, 2, 3, 4, 5, 6], [7, 8, 9], [-0.1, -0.2, -0.3]),  # length 9
        _sample([8, 8], [9, 9, 9], [-1.0, -2.0, -3.0]),  # length 5
    ]
    mb = make_micro_batch(samples, pad_id=0)
    assert mb.tokens_BS.shape == (3, 9)
    assert mb.tokens_BS[0].tolist() == [5, 6] + [0] * 7
    assert mb.tokens_BS[2].tolist() == [8, 8, 9, 9, 9, 0, 0, 0, 0]
    assert mb.loss_mask_BT[0].tolist() == [True] + [False] * 7
    assert mb.loss_mask_BT[1].tolist() == [False] * 5 + [True] * 3
    assert mb.loss_mask_BT[2].tolist() == [False, True, True, True] + [False] * 4
    assert mb.rollout_logprobs_BT[0].tolist() == [-2.0] + [0.0] * 7
    assert mb.lengths == [2, 9, 5]


@pytest.mark.parametrize(
    ("multiple_of", "seq"),
    [(1, 6), (2, 6), (4, 8), (5, 10), (7, 7)],
)
def test_sequence_is_padded_to_a_multiple_of_the_tp_size(multiple_of, seq):
    plain = make_micro_batch(_two_samples(), pad_id=PAD)
    mb = make_micro_batch(_two_samples(), pad_id=PAD, multiple_of=multiple_of)
    assert mb.tokens_BS.shape == (2, seq)
    assert mb.loss_mask_BT.shape == mb.rollout_logprobs_BT.shape == (2, seq - 1)
    # The extra columns are padding; nothing else moves.
    assert torch.equal(mb.tokens_BS[:, :6], plain.tokens_BS)
    assert (mb.tokens_BS[:, 6:] == PAD).all()
    assert torch.equal(mb.loss_mask_BT[:, :5], plain.loss_mask_BT)
    assert not mb.loss_mask_BT[:, 5:].any()
    assert torch.equal(mb.rollout_logprobs_BT[:, :5], plain.rollout_logprobs_BT)
    assert not mb.rollout_logprobs_BT[:, 5:].any()
    assert mb.lengths == [5, 6]
    assert mb.num_tokens == plain.num_tokens == 6


@pytest.mark.parametrize(("multiple_of", "seq"), [(2, 6), (4, 8)])
def test_odd_longest_row_is_rounded_up(multiple_of, seq):
    samples = [_sample([1, 2], [3, 4, 5], [-1.0, -2.0, -3.0])]  # length 5
    mb = make_micro_batch(samples, pad_id=PAD, multiple_of=multiple_of)
    assert mb.tokens_BS.tolist() == [[1, 2, 3, 4, 5] + [PAD] * (seq - 5)]
    assert mb.loss_mask_BT.tolist() == [[False, True, True, True] + [False] * (seq - 5)]
    assert mb.rollout_logprobs_BT.tolist() == [[0.0, -1.0, -2.0, -3.0] + [0.0] * (seq - 5)]


def test_sample_out_of_the_loss_has_an_empty_mask_but_keeps_its_logprobs():
    samples = _two_samples()
    samples[0].in_loss = False
    mb = make_micro_batch(samples, pad_id=PAD)
    assert not mb.loss_mask_BT[0].any()
    assert mb.loss_mask_BT[1].tolist() == [False, True, True, True, True]
    assert mb.rollout_logprobs_BT[0].tolist() == [0.0, 0.0, -0.5, -1.5, 0.0]
    assert mb.tokens_BS[0].tolist() == [11, 12, 13, 21, 22, PAD]
    assert mb.num_tokens == 4
    assert mb.num_seqs == 1


def test_counts_of_tokens_and_sequences():
    mb = make_micro_batch(_two_samples(), pad_id=PAD)
    assert mb.num_tokens == 2 + 4
    assert mb.num_seqs == 2
    assert isinstance(mb.num_tokens, int) and isinstance(mb.num_seqs, int)
    samples = _two_samples()
    for sample in samples:
        sample.in_loss = False
    empty = make_micro_batch(samples, pad_id=PAD)
    assert empty.num_tokens == 0 and empty.num_seqs == 0


def test_advantages_are_one_float32_per_row_in_order():
    samples = [*_two_samples(), _sample([1], [2, 3], [-1.0, -1.0], advantage=3.5)]
    mb = make_micro_batch(samples, pad_id=PAD)
    assert mb.advantages_B.dtype == torch.float32
    assert mb.advantages_B.tolist() == [0.75, -1.25, 3.5]


def test_samples_are_kept_in_order_as_a_list():
    samples = _two_samples()
    mb = make_micro_batch(tuple(samples), pad_id=PAD)
    assert isinstance(mb.samples, list)
    assert [id(s) for s in mb.samples] == [id(s) for s in samples]


def test_single_row_micro_batch():
    mb = make_micro_batch([_sample([7, 8], [9], [-0.25])], pad_id=PAD)
    assert mb.tokens_BS.tolist() == [[7, 8, 9]]
    assert mb.loss_mask_BT.tolist() == [[False, True]]
    assert mb.rollout_logprobs_BT.tolist() == [[0.0, -0.25]]
    assert mb.num_tokens == 1 and mb.num_seqs == 1


def test_empty_micro_batch_is_rejected():
    with pytest.raises(ValueError, match="at least one sample"):
        make_micro_batch([], pad_id=PAD)


def test_split_into_chunks_with_a_short_last_one():
    assert split(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert split(list(range(6)), 3) == [[0, 1, 2], [3, 4, 5]]
    assert split(list(range(3)), 5) == [[0, 1, 2]]
    assert split(["a", "b"], 1) == [["a"], ["b"]]
    assert split((1, 2, 3), 2) == [[1, 2], [3]]
    assert split([], 4) == []


def test_split_keeps_every_item_once_in_order():
    items = [object() for _ in range(11)]
    chunks = split(items, 4)
    assert [len(c) for c in chunks] == [4, 4, 3]
    assert all(isinstance(c, list) for c in chunks)
    assert [x for chunk in chunks for x in chunk] == items


@pytest.mark.parametrize(
    "samples, match",
    [
        ([_sample([], [7], [-0.1])], "empty prompt"),
        ([_sample([1, 2], [7, 8], [-0.1])], "one log-prob per response token"),
    ],
    ids=["empty_prompt", "logprobs_length"],
)
def test_malformed_samples_are_named(samples, match):
    with pytest.raises(ValueError, match=match):
        make_micro_batch(samples, pad_id=0)


def test_bad_chunk_sizes_are_refused():
    with pytest.raises(ValueError, match="multiple_of=0"):
        make_micro_batch(_two_samples(), pad_id=0, multiple_of=0)
    with pytest.raises(ValueError, match="size=0"):
        split([1, 2], 0)


def test_to_moves_every_tensor_and_keeps_the_samples():
    batch = make_micro_batch(_two_samples(), pad_id=0)
    moved = batch.to("meta")
    for name in ("tokens_BS", "loss_mask_BT", "rollout_logprobs_BT", "advantages_B"):
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(moved, name).shape == getattr(batch, name).shape
    assert moved.samples is batch.samples and moved.lengths == batch.lengths
    routed = batch.routed()
    assert list(routed.lengths) == batch.lengths and routed.seq_len == batch.tokens_BS.shape[1]


def _row_by_row(samples, pad_id, multiple_of):
    """The micro-batch written one row at a time (the layout the module docstring defines)."""
    from megatron_rl.train.token_versions import NO_VERSION, token_versions

    seq = max(s.length for s in samples)
    seq += (-seq) % multiple_of
    tokens = torch.full((len(samples), seq), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(samples), seq - 1, dtype=torch.bool)
    rollout = torch.zeros(len(samples), seq - 1)
    versions = torch.full((len(samples), seq - 1), NO_VERSION, dtype=torch.int64)
    for i, s in enumerate(samples):
        p, r = s.prompt_ids.numel(), s.response_ids.numel()
        tokens[i, : p + r] = torch.cat([s.prompt_ids, s.response_ids])
        if s.in_loss:
            mask[i, p - 1 : p + r - 1] = True if s.response_mask is None else s.response_mask
        rollout[i, p - 1 : p + r - 1] = s.rollout_logprobs
        versions[i, p - 1 : p + r - 1] = token_versions(s)
    return tokens, mask, rollout, versions


@pytest.mark.parametrize("seed", range(4))
def test_ragged_samples_land_where_a_row_by_row_construction_puts_them(seed):
    """Random prompt and response lengths, samples out of the loss, tool-token masks, spans of
    weight versions and samples without a version: every field equals the row-by-row layout."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(int(torch.randint(1, 12, (1,), generator=g))):
        p, r = (int(torch.randint(1, 9, (1,), generator=g)) for _ in range(2))
        s = _sample(
            torch.randint(0, 50, (p,), generator=g).tolist(),
            torch.randint(0, 50, (r,), generator=g).tolist(),
            (-torch.rand(r, generator=g)).tolist(),
            in_loss=bool(torch.rand(1, generator=g) < 0.8),
        )
        kind = int(torch.randint(0, 5, (1,), generator=g))
        if kind == 1:
            s.weight_version = 3
        elif kind == 2 and r >= 2:
            s.weight_version, s.weight_versions = 2, ((2, 0, 1), (4, 1, r))
        elif kind == 3:
            s.response_mask = torch.rand(r, generator=g) < 0.5
        elif kind == 4:  # one span: what the in-process engine reports for a one-version sample
            s.weight_version, s.weight_versions = 5, ((5, 0, r),)
        samples.append(s)
    multiple_of = 1 + seed % 3
    mb = make_micro_batch(samples, pad_id=7, multiple_of=multiple_of)
    tokens, mask, rollout, versions = _row_by_row(samples, 7, multiple_of)
    assert torch.equal(mb.tokens_BS, tokens)
    assert torch.equal(mb.loss_mask_BT, mask)
    assert torch.equal(mb.rollout_logprobs_BT, rollout)
    assert torch.equal(mb.token_versions_BT, versions)


def test_a_one_span_sample_whose_version_disagrees_is_named():
    samples = _two_samples()
    samples[1].weight_version = 2
    samples[1].weight_versions = ((5, 0, samples[1].response_ids.numel()),)
    with pytest.raises(ValueError, match="sample 1: weight_version 2 is not the oldest"):
        make_micro_batch(samples, pad_id=0)


def test_a_bad_weight_version_is_named_with_its_sample():
    samples = _two_samples()
    samples[1].weight_version = -2
    with pytest.raises(ValueError, match="sample 1: weight_version -2"):
        make_micro_batch(samples, pad_id=0)
