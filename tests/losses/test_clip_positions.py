"""Position-wise clipping metrics: relative-position bins, per-bin fractions, the position CV,
the profile recomputed from micro-batch counts, and every clipping loss's ``clipped_BT``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loss_batches import make_batch

from megatron_rl.losses import available_losses, compute_policy_loss, get_loss_spec, registry
from megatron_rl.losses.clip_positions import (
    DEFAULT_NUM_BINS,
    clip_position_counts,
    clip_position_metrics,
    clip_profile_from_counts,
    position_profile,
    relative_position_bins,
)
from megatron_rl.losses.layout import prepare_inputs
from megatron_rl.losses.registry import LossSpec, LossTerms

NO_HARD_CLIP = ("sapo", "vespo")  # smooth weights: no clipped set to report
CLIPPING_LOSSES = tuple(name for name in available_losses() if name not in NO_HARD_CLIP)


def _hand_example():
    """Rows: n = 10; n = 3; empty; n = 3 with gaps (positions 1, 2, 4). K = 4."""
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[0] = True
    mask[1, :3] = True
    mask[3, [1, 2, 4]] = True
    clipped = torch.zeros(4, 10, dtype=torch.bool)
    clipped[0, [0, 3, 4, 9]] = True  # bins 0, 1, 1, 3
    clipped[1, 2] = True  # bin 2
    clipped[2, 5] = True  # outside the mask: ignored
    clipped[3, [0, 4]] = True  # position 0 is outside the mask; position 4 is bin 2
    return clipped, mask


def test_relative_position_bins_are_floor_of_t_minus_one_times_k_over_n():
    _, mask = _hand_example()
    bins = relative_position_bins(mask, num_bins=4)
    # n = 10: floor((t - 1) * 4 / 10) for t = 1..10
    assert bins[0].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    # n = 3: floor(0), floor(4/3), floor(8/3); bin 3 stays empty for a 3-token response
    assert bins[1].tolist() == [0, 1, 2] + [-1] * 7
    assert bins[2].tolist() == [-1] * 10
    assert bins[3].tolist() == [-1, 0, 1, -1, 2] + [-1] * 5


def test_counts_and_fractions_match_the_hand_computed_example():
    clipped, mask = _hand_example()
    clipped_K, tokens_K = clip_position_counts(clipped, mask, num_bins=4)
    assert tokens_K.tolist() == [5.0, 4.0, 5.0, 2.0]  # 3+1+1, 2+1+1, 3+1+1, 2
    assert clipped_K.tolist() == [1.0, 2.0, 2.0, 1.0]
    metrics = clip_position_metrics(clipped, mask, num_bins=4)
    fracs = [metrics[f"clip_frac_pos_{k}"].item() for k in range(4)]
    assert fracs == pytest.approx([1 / 5, 2 / 4, 2 / 5, 1 / 2], rel=1e-15)
    expected_cv = np.std(fracs) / np.mean(fracs)
    assert metrics["clip_position_cv"].item() == pytest.approx(expected_cv, rel=1e-12)
    assert sorted(metrics) == sorted(
        [f"clip_pos_tokens_{k}" for k in range(4)]
        + [f"clip_pos_clipped_{k}" for k in range(4)]
        + [f"clip_frac_pos_{k}" for k in range(4)]
        + ["clip_position_cv"]
    )


@pytest.mark.parametrize("seed", range(5))
def test_cv_is_the_population_cv_over_the_bins_holding_tokens(seed):
    gen = np.random.default_rng(seed)
    tokens = gen.integers(0, 50, size=DEFAULT_NUM_BINS).astype(float)
    tokens[gen.integers(0, DEFAULT_NUM_BINS)] = 0.0  # at least one empty bin, left out
    clipped = np.floor(tokens * gen.random(DEFAULT_NUM_BINS))
    frac_K, cv = position_profile(torch.tensor(clipped), torch.tensor(tokens))
    held = tokens > 0
    expected = clipped[held] / tokens[held]
    np.testing.assert_allclose(frac_K.numpy()[held], expected, rtol=1e-15)
    assert (frac_K.numpy()[~held] == 0).all()
    assert cv.item() == pytest.approx(np.std(expected, ddof=0) / np.mean(expected), rel=1e-12)


def test_cv_is_zero_without_clipping_and_without_tokens():
    mask = torch.ones(3, 20, dtype=torch.bool)
    none = clip_position_metrics(torch.zeros_like(mask), mask)
    assert none["clip_position_cv"].item() == 0.0
    empty = clip_position_metrics(torch.ones_like(mask), torch.zeros_like(mask))
    assert empty["clip_position_cv"].item() == 0.0
    assert all(empty[f"clip_pos_tokens_{k}"].item() == 0.0 for k in range(DEFAULT_NUM_BINS))
    even = clip_position_metrics(mask, mask)  # everything clipped: flat profile
    assert even["clip_position_cv"].item() == 0.0
    assert even["clip_frac_pos_0"].item() == 1.0


def _micro_batch(seed: int, num_seqs: int, max_len: int):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (num_seqs,), generator=gen)
    mask = torch.arange(max_len)[None] < lengths[:, None]
    # clipping more likely late in the response, so the profile is not flat
    rel = torch.arange(max_len)[None] / lengths[:, None]
    clipped = torch.rand(num_seqs, max_len, generator=gen) < 0.1 + 0.5 * rel
    return clipped, mask


def _pad(x: torch.Tensor, length: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, length - x.shape[1]))


def test_profile_from_summed_or_averaged_counts_is_the_concatenated_batch_profile():
    (c1, m1), (c2, m2) = _micro_batch(0, 5, 23), _micro_batch(1, 7, 41)
    whole = clip_position_metrics(torch.cat([_pad(c1, 41), c2]), torch.cat([_pad(m1, 41), m2]))
    parts = [clip_position_metrics(c, m) for c, m in ((c1, m1), (c2, m2))]
    # the trainer averages every metric over micro-batches (and ranks) with equal weights
    averaged = {f"policy/{k}": sum(float(p[k]) for p in parts) / 2 for k in parts[0]}
    summed = {f"policy/{k}": sum(float(p[k]) for p in parts) for k in parts[0]}
    for counts in (averaged, summed):
        profile = clip_profile_from_counts(counts)
        assert sorted(profile) == sorted(
            [f"policy/clip_frac_pos_{k}" for k in range(DEFAULT_NUM_BINS)]
            + ["policy/clip_position_cv"]
        )
        for key, value in profile.items():
            assert value == pytest.approx(whole[key.removeprefix("policy/")].item(), rel=1e-12)
    # while the average of the micro-batch CVs is not the step's CV
    mean_cv = sum(p["clip_position_cv"].item() for p in parts) / 2
    assert abs(mean_cv - whole["clip_position_cv"].item()) > 1e-3


def test_profile_from_counts_reads_only_its_prefix_and_rejects_incomplete_counts():
    assert clip_profile_from_counts({"policy/loss": 1.0}) == {}
    counts = {"x/clip_pos_tokens_0": 4.0, "x/clip_pos_clipped_0": 1.0, "policy/loss": 3.0}
    assert clip_profile_from_counts(counts, prefix="x/") == {
        "x/clip_frac_pos_0": 0.25,
        "x/clip_position_cv": 0.0,
    }
    with pytest.raises(ValueError, match="x/clip_pos_clipped_1"):
        clip_profile_from_counts(counts | {"x/clip_pos_tokens_1": 2.0}, prefix="x/")
    with pytest.raises(ValueError, match=r"without gaps, got bins \[0, 2\]"):
        clip_profile_from_counts(counts | {"x/clip_pos_tokens_2": 2.0}, prefix="x/")


def _position_keys(metrics: dict) -> list[str]:
    return [k for k in metrics if k.startswith(("policy/clip_pos", "policy/clip_frac_pos_"))]


def _kwargs(seed: int, drift: float) -> dict:
    b = make_batch(num_seqs=8, max_len=12, seed=seed, drift=drift)
    return b.kwargs()


def _terms(name: str, kwargs: dict, **hyperparameters) -> tuple[LossTerms, torch.Tensor]:
    spec = get_loss_spec(name)
    inputs, _ = prepare_inputs(
        kwargs["logprobs"], kwargs["old_logprobs"], kwargs["advantages"], kwargs["loss_mask"],
        None, True,
    )  # fmt: skip
    return spec.fn(inputs, spec.make_config(hyperparameters)), inputs.mask_BT


def test_the_clipping_losses_are_all_but_the_smooth_ones():
    assert {"grpo", "dapo", "gspo", "gspo_token", "epic", "cispo", "topr"} <= set(CLIPPING_LOSSES)
    assert set(NO_HARD_CLIP) <= set(available_losses())


@pytest.mark.parametrize("name", CLIPPING_LOSSES)
def test_every_clipping_loss_reports_the_position_metrics(name):
    kwargs = _kwargs(seed=1, drift=0.4)
    out = compute_policy_loss(name, **kwargs)
    mask = kwargs["loss_mask"]
    tokens = [out.metrics[f"policy/clip_pos_tokens_{k}"].item() for k in range(DEFAULT_NUM_BINS)]
    clipped = [out.metrics[f"policy/clip_pos_clipped_{k}"].item() for k in range(DEFAULT_NUM_BINS)]
    assert sum(tokens) == int(mask.sum())
    assert sum(clipped) > 0, f"{name}: the batch must clip something"
    for k in range(DEFAULT_NUM_BINS):
        frac = out.metrics[f"policy/clip_frac_pos_{k}"].item()
        assert 0.0 <= frac <= 1.0
        assert frac == pytest.approx(clipped[k] / tokens[k] if tokens[k] else 0.0)
    assert np.isfinite(out.metrics["policy/clip_position_cv"].item())
    terms, mask_BT = _terms(name, kwargs)
    assert terms.clipped_BT.dtype == torch.bool and terms.clipped_BT.shape == mask_BT.shape
    assert not bool((terms.clipped_BT & ~mask_BT).any())


@pytest.mark.parametrize("name", NO_HARD_CLIP)
def test_smooth_losses_report_no_position_metrics(name):
    out = compute_policy_loss(name, **_kwargs(seed=1, drift=0.4))
    assert _position_keys(out.metrics) == []


CLIP_CASES = [(name, {}) for name in CLIPPING_LOSSES if name != "topr"] + [
    ("grpo", {"clip_ratio_c": 1.5}),
    ("epic", {"variant": "plain"}),
    ("epic", {"variant": "raw-prob"}),
    ("epic", {"variant": "cumulative-ratio"}),
    ("cispo", {"clip_low": 0.2}),
]


@pytest.mark.parametrize(("name", "hyperparameters"), CLIP_CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_clipped_map_is_the_union_of_the_loss_clip_fractions(name, hyperparameters, seed):
    """``clip_frac_high + clip_frac_low (+ dual_clip_frac)`` = mean of ``clipped_BT`` over the
    mask, through ``compute_policy_loss`` (the counts) and on the loss's own map."""
    kwargs = _kwargs(seed=seed, drift=0.6)
    out = compute_policy_loss(name, **kwargs, **hyperparameters)
    own = {k.removeprefix(f"{name}/"): v.item() for k, v in out.metrics.items()}
    assert "clip_frac_high" in own and "clip_frac_low" in own
    expected = own["clip_frac_high"] + own["clip_frac_low"] + own.get("dual_clip_frac", 0.0)
    bins = range(DEFAULT_NUM_BINS)
    clipped = sum(out.metrics[f"policy/clip_pos_clipped_{k}"].item() for k in bins)
    tokens = sum(out.metrics[f"policy/clip_pos_tokens_{k}"].item() for k in bins)
    assert clipped / tokens == pytest.approx(expected, abs=1e-12)
    assert clipped > 0
    terms, mask_BT = _terms(name, kwargs, **hyperparameters)
    assert terms.clipped_BT[mask_BT].double().mean().item() == pytest.approx(expected, abs=1e-12)


def test_grpo_dual_clip_tokens_are_in_the_map():
    kwargs = _kwargs(seed=0, drift=0.6)
    out = compute_policy_loss("grpo", clip_ratio_c=1.5, **kwargs)
    assert out.metrics["grpo/dual_clip_frac"].item() > 0  # the case above covers the dual clip


def test_topr_marks_every_token_of_a_truncated_sequence():
    kwargs = _kwargs(seed=2, drift=0.6)
    out = compute_policy_loss("topr", **kwargs)
    terms, mask_BT = _terms("topr", kwargs)
    seq_truncated = terms.clipped_BT.any(dim=-1)
    assert bool(seq_truncated.any()) and not bool(seq_truncated.all())
    # whole sequences: every masked token of a truncated sequence, none of the others
    assert torch.equal(terms.clipped_BT, seq_truncated[:, None] & mask_BT)
    # clip_frac_high is the fraction of sequences
    frac = seq_truncated.double().mean().item()
    assert out.metrics["topr/clip_frac_high"].item() == pytest.approx(frac)
    log_w = (kwargs["logprobs"].detach() - kwargs["old_logprobs"]).where(mask_BT, 0.0).sum(-1)
    assert torch.equal(seq_truncated, (kwargs["advantages"] < 0) & (log_w > 0))


def test_packed_and_padded_inputs_give_the_same_position_metrics():
    b = make_batch(num_seqs=5, max_len=11, seed=3, drift=0.4)
    padded = compute_policy_loss("grpo", **b.kwargs())
    rows = [slice(0, n) for n in b.lengths]
    cat = [torch.cat([t[i, r] for i, r in enumerate(rows)]) for t in (b.logprobs, b.old_logprobs)]
    cu = torch.tensor([0, *np.cumsum(b.lengths).tolist()])
    packed = compute_policy_loss(
        "grpo",
        logprobs=cat[0],
        old_logprobs=cat[1],
        advantages=b.advantages,
        loss_mask=torch.ones(int(cu[-1]), dtype=torch.bool),
        cu_seqlens=cu,
    )
    keys = _position_keys(padded.metrics)
    assert len(keys) == 3 * DEFAULT_NUM_BINS + 1
    for key in keys:
        assert packed.metrics[key].item() == padded.metrics[key].item()


@pytest.mark.parametrize(
    "bad",
    [torch.zeros(2, 3), torch.zeros(2, 4, dtype=torch.bool), [[False] * 3] * 2],
    ids=["float", "shape", "list"],
)
def test_a_malformed_clipped_map_is_an_error_naming_the_loss(monkeypatch, bad):
    def loss(inputs, config):
        return LossTerms(inputs.logprobs_BT * 0, {}, bad)

    spec = get_loss_spec("topr")
    monkeypatch.setitem(
        registry._REGISTRY,
        "bad_clip",
        LossSpec("bad_clip", loss, spec.config_cls, "token-mean", False),
    )
    b = make_batch(num_seqs=2, max_len=3)
    with pytest.raises(ValueError, match=r"loss 'bad_clip': clipped_BT must be .*bool"):
        compute_policy_loss("bad_clip", **b.kwargs())
