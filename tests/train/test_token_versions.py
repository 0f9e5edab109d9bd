"""Per-token weight versions (partial rollouts) and the stale-token mask.

A sample generated across weight syncs carries spans ``(version, start, end)`` over its response
tokens; each token's version sits at its predicted position in the micro-batch, like its
rollout log-prob, and ``--mask-stale-tokens`` drops tokens more than ``--max-staleness`` versions
behind the trainer from the loss.
"""

from __future__ import annotations

import re

import pytest
import torch
from trainer_testing import rendezvous, small_config

from megatron_rl.rollout.types import RolloutSample
from megatron_rl.train.batch import TrainSample, make_micro_batch
from megatron_rl.train.config import parse_args
from megatron_rl.train.rollouts.config import RolloutConfig
from megatron_rl.train.rollouts.phase import run_rollout
from megatron_rl.train.token_versions import (
    NO_VERSION,
    check_version_spans,
    fresh_token_mask,
    token_staleness_metrics,
    token_versions,
)
from megatron_rl.train.trainer import Trainer

PAD = 0


def _sample(
    prompt=(1, 2, 3),
    response=(4, 5, 6),
    *,
    version=None,
    spans=(),
    in_loss=True,
    advantage=1.0,
) -> TrainSample:
    return TrainSample(
        prompt_ids=torch.tensor(prompt, dtype=torch.int64),
        response_ids=torch.tensor(response, dtype=torch.int64),
        rollout_logprobs=torch.full((len(response),), -1.0),
        advantage=advantage,
        reward=0.0,
        in_loss=in_loss,
        weight_version=version,
        weight_versions=spans,
    )


# ------------------------------------------------------------------ spans -> per-token versions
def test_one_version_fills_every_token_and_spans_give_each_token_its_segments_version():
    assert token_versions(_sample(version=4)).tolist() == [4, 4, 4]
    spanning = _sample(response=(4, 5, 6, 7, 8), version=2, spans=((2, 0, 2), (3, 2, 5)))
    versions = token_versions(spanning)
    assert versions.dtype == torch.int64
    assert versions.tolist() == [2, 2, 3, 3, 3]
    # three segments, one of them empty (a sync with no token generated in between)
    three = _sample(version=1, spans=((1, 0, 1), (2, 1, 1), (3, 1, 3)))
    assert token_versions(three).tolist() == [1, 3, 3]


def test_a_sample_without_any_version_has_unknown_versions():
    assert token_versions(_sample()).tolist() == [NO_VERSION] * 3
    # spans alone are enough (weight_version is their oldest, but may be left out)
    assert token_versions(_sample(spans=((5, 0, 1), (6, 1, 3)))).tolist() == [5, 6, 6]


@pytest.mark.parametrize(
    "spans, match",
    [
        (((1, 0, 2),), "cover response tokens [0, 2), not its 3 response tokens"),
        (((1, 0, 2), (2, 2, 4)), "cover response tokens [0, 4), not its 3"),
        (((1, 1, 3),), "span (1, 1, 3) starts at 1, expected 0"),
        (((1, 0, 1), (2, 2, 3)), "span (2, 2, 3) starts at 2, expected 1"),
        (((1, 0, 2), (2, 1, 3)), "span (2, 1, 3) starts at 1, expected 2"),
        (((1, 0, 3), (2, 3, 2)), "span (2, 3, 2) starts at 3, expected 3, and must not end"),
        ((("3", 0, 3),), "weight version '3' is a string; versions are ints (parse SGLang's"),
        (((True, 0, 3),), "version True must be an int >= 0"),
        (((-1, 0, 3),), "version -1 must be an int >= 0"),
        (((1.0, 0, 3),), "version 1.0 must be an int >= 0"),
        (((1, 0),), "span (1, 0) must be (version, start, end)"),
        ((1, 0, 3), "span 1 must be (version, start, end)"),
    ],
)
def test_bad_spans_are_refused_naming_the_sample(spans, match):
    with pytest.raises(ValueError, match=re.escape(match)) as err:
        token_versions(_sample(spans=spans), "sample 7")
    assert str(err.value).startswith("sample 7: ")


def test_weight_version_must_be_the_oldest_span_and_an_int():
    with pytest.raises(ValueError, match=re.escape("weight_version 3 is not the oldest version 2")):
        token_versions(_sample(version=3, spans=((2, 0, 1), (3, 1, 3))), "sample 0")
    with pytest.raises(ValueError, match=re.escape("weight_version '1' must be an int >= 0")):
        token_versions(_sample(version="1"), "sample 0")


def test_the_sglang_payloads_parsed_spans_pass_unchanged():
    from megatron_rl.rollout.sglang_payload import parse_version_spans

    raw = [
        {"version": "default", "start": 0, "end": 1},
        {"version": "2", "start": 1, "end": 3},
    ]
    spans = parse_version_spans(raw, "sample (prompt 0, sample 0)", 3)
    assert check_version_spans(spans, 3, "s") == ((0, 0, 1), (2, 1, 3))
    assert token_versions(_sample(version=0, spans=spans)).tolist() == [0, 2, 2]


# ------------------------------------------------------------------ micro-batch alignment
def test_each_tokens_version_sits_at_its_predicted_position_like_its_rollout_logprob():
    samples = [
        _sample((1, 2, 3), (4, 5), version=7),  # P = 3, R = 2: predicted positions [2, 4)
        _sample((1, 2), (4, 5, 6, 7), version=5, spans=((5, 0, 1), (6, 1, 3), (7, 3, 4))),
        _sample((9,), (4,), version=6, in_loss=False),  # out of the loss: versions still there
    ]
    mb = make_micro_batch(samples, pad_id=PAD, multiple_of=4)  # s = 8: padding at the end
    assert mb.token_versions_BT.dtype == torch.int64
    assert mb.token_versions_BT.shape == mb.rollout_logprobs_BT.shape == (3, 7)
    assert mb.token_versions_BT.tolist() == [
        [-1, -1, 7, 7, -1, -1, -1],
        [-1, 5, 6, 6, 7, -1, -1],
        [6, -1, -1, -1, -1, -1, -1],
    ]
    response_BT = mb.token_versions_BT >= 0
    for i in range(2):  # in-loss rows: the response positions are exactly the loss mask
        assert torch.equal(response_BT[i], mb.loss_mask_BT[i])
        assert torch.equal(mb.token_versions_BT[i][mb.loss_mask_BT[i]], token_versions(samples[i]))
    assert torch.equal(mb.to("cpu").token_versions_BT, mb.token_versions_BT)


def test_make_micro_batch_names_the_sample_with_bad_spans():
    samples = [_sample(version=1), _sample(version=1, spans=((1, 0, 2),))]
    with pytest.raises(ValueError, match=re.escape("sample 1: weight_versions [(1, 0, 2)]")):
        make_micro_batch(samples, pad_id=PAD)


# ------------------------------------------------------------------ the mask and its metrics
def test_fresh_tokens_are_at_most_k_versions_behind_the_trainer():
    versions = torch.tensor([[-1, 2, 3, 4, 5]])
    assert fresh_token_mask(versions, 5, 2).tolist() == [[False, False, True, True, True]]
    assert fresh_token_mask(versions, 5, 1).tolist() == [[False, False, False, True, True]]


def _metric_keys(k: int) -> set[str]:
    hist = {f"staleness/token_hist/{d}" for d in range(k + 1)} | {f"staleness/token_hist/>{k}"}
    rest = {"masked_token_frac", "multi_version_sample_frac", "token_mean"}
    return hist | {f"staleness/{name}" for name in rest}


def test_staleness_metrics_count_loss_tokens_by_versions_behind_with_fixed_keys():
    versions = torch.tensor([[-1, 5, 5, 3], [-1, 1, 4, -1], [0, 0, -1, -1]])
    mask = torch.tensor(
        [[False, True, True, True], [False, True, True, False], [False, False, False, False]]
    )
    out = token_staleness_metrics([versions], [mask], 5, 2, mask_stale=True)
    assert set(out) == _metric_keys(2)
    # loss tokens are 0, 0, 2, 4, 1 versions behind (row 2 is out of the loss)
    assert out["staleness/token_mean"] == pytest.approx(7 / 5)
    assert out["staleness/token_hist/0"] == pytest.approx(2 / 5)
    assert out["staleness/token_hist/1"] == pytest.approx(1 / 5)
    assert out["staleness/token_hist/2"] == pytest.approx(1 / 5)
    assert out["staleness/token_hist/>2"] == pytest.approx(1 / 5)
    assert out["staleness/masked_token_frac"] == pytest.approx(1 / 5)
    assert out["staleness/multi_version_sample_frac"] == pytest.approx(2 / 3)
    unmasked = token_staleness_metrics([versions], [mask], 5, 2, mask_stale=False)
    assert unmasked["staleness/masked_token_frac"] == 0.0
    assert unmasked["staleness/token_hist/>2"] == out["staleness/token_hist/>2"]
    nothing = token_staleness_metrics([], [], 5, 2, mask_stale=True)
    assert set(nothing) == _metric_keys(2) and all(v == 0.0 for v in nothing.values())


def test_unknown_versions_are_refused_by_the_mask_and_future_versions_always():
    unknown = torch.tensor([[-1, -1, -1]])
    mask = torch.tensor([[False, True, True]])
    out = token_staleness_metrics([unknown], [mask], 3, 1, mask_stale=False)
    assert set(out) == _metric_keys(1) and all(v == 0.0 for v in out.values())
    with pytest.raises(ValueError, match="--mask-stale-tokens: a sample in the loss has no"):
        token_staleness_metrics([unknown], [mask], 3, 1, mask_stale=True)
    ahead = torch.tensor([[-1, 3, 4]])
    with pytest.raises(ValueError, match="weight version 4 is newer than the trainer's version 3"):
        token_staleness_metrics([ahead], [mask], 3, 1, mask_stale=False)


# ------------------------------------------------------------------ in the trainer
TRAINER_VERSION = 5


def _spanning_samples() -> list[TrainSample]:
    """8 samples of 3 response tokens, at trainer version 5 and K = 2: in-loss tokens 0 (x10),
    1 (x4), 2 (x3) and > 2 (x4) versions behind; 2 of 8 samples span versions."""
    return [
        _sample(version=5, advantage=1.0),
        _sample(version=4, advantage=-1.0),
        _sample(version=2, spans=((2, 0, 1), (3, 1, 2), (5, 2, 3)), advantage=1.0),  # 3, 2, 0
        _sample(version=1, advantage=-1.0),  # 4 behind: out with the mask
        _sample(version=3, spans=((3, 0, 2), (4, 2, 3)), advantage=1.0),  # 2, 2, 1
        _sample(version=5, advantage=-1.0),
        _sample(version=0, in_loss=False, advantage=0.0),  # out of the loss anyway
        _sample(version=5, advantage=1.0),
    ]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("token_versions")
    config = small_config(tmp_path, async_rollout=True, max_staleness=2)
    trainer = Trainer(config, **rendezvous(tmp_path))
    yield trainer
    trainer.close()


def _train_on(trainer, samples, *, mask: bool) -> dict[str, float]:
    trainer.config = trainer.config.with_flags(mask_stale_tokens=mask)
    trainer.weight_version = TRAINER_VERSION
    return trainer.train_on(samples)


def test_tokens_more_than_k_versions_behind_leave_the_loss(trainer):
    kept = _train_on(trainer, _spanning_samples(), mask=False)
    masked = _train_on(trainer, _spanning_samples(), mask=True)
    # the same micro-batches, averaged the same way: the ratio is fresh / all loss tokens
    assert masked["policy/num_tokens"] / kept["policy/num_tokens"] == pytest.approx(17 / 21)
    assert kept["staleness/masked_token_frac"] == 0.0
    assert masked["staleness/masked_token_frac"] == pytest.approx(4 / 21)
    for out in (kept, masked):
        assert {k for k in out if k.startswith("staleness/")} == _metric_keys(2)
        assert out["staleness/token_mean"] == pytest.approx(25 / 21)
        assert out["staleness/token_hist/0"] == pytest.approx(10 / 21)
        assert out["staleness/token_hist/1"] == pytest.approx(4 / 21)
        assert out["staleness/token_hist/2"] == pytest.approx(3 / 21)
        assert out["staleness/token_hist/>2"] == pytest.approx(4 / 21)
        assert out["staleness/multi_version_sample_frac"] == pytest.approx(2 / 8)


def test_a_batch_with_nothing_stale_trains_every_token_under_the_mask(trainer):
    fresh = [_sample(version=TRAINER_VERSION - d % 3, advantage=(-1.0) ** d) for d in range(8)]
    kept = _train_on(trainer, fresh, mask=False)
    masked = _train_on(trainer, fresh, mask=True)
    assert masked["policy/num_tokens"] == kept["policy/num_tokens"] > 0
    assert masked["staleness/masked_token_frac"] == 0.0


def test_samples_without_versions_keep_the_metric_keys_and_are_refused_by_the_mask(trainer):
    unknown = [_sample(advantage=(-1.0) ** i) for i in range(8)]
    out = _train_on(trainer, unknown, mask=False)
    assert {k for k in out if k.startswith("staleness/")} == _metric_keys(2)
    with pytest.raises(ValueError, match="--mask-stale-tokens: a sample in the loss has no"):
        _train_on(trainer, unknown, mask=True)


def _checkpoint_worker(rank, world_size, init_method, tmp_dir) -> None:
    from pathlib import Path

    from pipeline_testing import write_four_layer_checkpoint

    write_four_layer_checkpoint(Path(tmp_dir), init_method)


def _pipeline_worker(rank, world_size, init_method, tmp_dir, hf_dir) -> None:
    """PP = 2 on a 4-layer checkpoint: the spanning samples with the mask off, then on."""
    from pathlib import Path

    config = small_config(
        Path(tmp_dir), model=hf_dir, async_rollout=True, max_staleness=2,
        pipeline_model_parallel_size=2,
    )  # fmt: skip
    trainer = Trainer(config, rank=rank, world_size=world_size, init_method=init_method)
    try:
        result = {
            mask: _train_on(trainer, _spanning_samples(), mask=mask) for mask in (False, True)
        }
        torch.save(result, Path(tmp_dir) / f"result{rank}.pt")
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.distributed
def test_the_mask_and_its_metrics_hold_across_pipeline_stages(tmp_path):
    from qwen3_moe_testing import spawn_ranks

    (tmp_path / "hf").mkdir()
    (tmp_path / "pp2").mkdir()
    spawn_ranks(_checkpoint_worker, tmp_path / "hf", 1)
    spawn_ranks(_pipeline_worker, tmp_path / "pp2", 2, str(tmp_path / "hf" / "hf"))
    first, last = (
        torch.load(tmp_path / "pp2" / f"result{r}.pt", weights_only=False) for r in (0, 1)
    )
    for mask in (False, True):
        assert first[mask] == last[mask]  # the last stage's metrics on every stage
    kept, masked = first[False], first[True]
    assert masked["policy/num_tokens"] / kept["policy/num_tokens"] == pytest.approx(17 / 21)
    assert masked["staleness/masked_token_frac"] == pytest.approx(4 / 21)
    assert kept["staleness/token_hist/>2"] == pytest.approx(4 / 21)
    assert {k for k in masked if k.startswith("staleness/")} == _metric_keys(2)


# ------------------------------------------------------------------ rollout phase and config
class _SpanningEngine:
    """Answers every prompt with one sample whose 3 tokens come from versions 2, 3 and 3."""

    def generate(self, prompts, params, n, return_routed_experts=False):
        return [
            RolloutSample(
                prompt_index=p,
                sample_index=j,
                prompt_ids_P=torch.tensor(prompt),
                response_ids_R=torch.tensor([4, 5, 6]),
                logprobs_R=torch.tensor([-1.0, -0.5, -0.25]),
                finish_reason="length",
                weight_version=2,
                weight_versions=((2, 0, 1), (3, 1, 3)),
            )
            for p, prompt in enumerate(prompts)
            for j in range(n)
        ]

    def take_aborted(self) -> int:
        return 0


def test_run_rollout_carries_the_engines_version_spans_into_train_samples():
    from types import SimpleNamespace

    tokenizer = SimpleNamespace(eos_token_id=1, vocab_size=16, decode=lambda ids: str(ids))
    records = [SimpleNamespace(prompt_ids=[7, 8], answer="x")]
    result = run_rollout(
        _SpanningEngine(),
        records,
        tokenizer,
        lambda response, answer: 0.0,
        RolloutConfig(n_samples_per_prompt=2, max_response_length=3),
        seed=0,
        return_routes=False,
    )
    for sample in result.samples:
        assert sample.weight_version == 2
        assert sample.weight_versions == ((2, 0, 1), (3, 1, 3))
        assert token_versions(sample).tolist() == [2, 3, 3]


PARTIAL = ["--partial-rollout", "--async-rollout", "--behavior-logprobs", "rollout"]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--partial-rollout"], "--partial-rollout needs --async-rollout"),
        (["--mask-stale-tokens"], "--mask-stale-tokens needs --async-rollout"),
        (
            ["--partial-rollout", "--async-rollout"],
            "--partial-rollout: a sample spanning weight updates has no single trainer-side "
            "behaviour policy; the engine's per-token log-probs are it. Pass "
            "--behavior-logprobs rollout, or a --rollout-correction",
        ),
        (
            [*PARTIAL, "--rollout-engine", "sglang", "--sglang-url", "http://h:1"],
            "--partial-rollout with --rollout-engine sglang needs the servers to keep their "
            "requests across a weight sync: pass --sglang-pause-mode retract",
        ),
    ],
)
def test_partial_rollout_and_the_mask_need_async_and_an_engine_behaviour_policy(argv, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        parse_args(argv)


def test_partial_rollout_parses_with_rollout_logprobs_or_a_correction_and_the_mask_with_async():
    base = ["--partial-rollout", "--async-rollout"]
    config = parse_args([*base, "--behavior-logprobs", "rollout"])
    assert config.rollout.partial_rollout and not config.rollout.mask_stale_tokens
    assert parse_args([*base, "--rollout-correction", "tis-token"]).rollout.partial_rollout
    masked = parse_args(["--mask-stale-tokens", "--async-rollout", "--max-staleness", "2"])
    assert masked.rollout.mask_stale_tokens and masked.rollout.max_staleness == 2
    assert not parse_args([]).rollout.partial_rollout
    sglang = [*PARTIAL, "--rollout-engine", "sglang", "--sglang-url", "http://h:1"]
    for mode in ("retract", "in_place"):
        assert parse_args([*sglang, "--sglang-pause-mode", mode]).rollout.partial_rollout
