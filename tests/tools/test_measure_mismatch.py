"""tools/measure_mismatch.py: its agreement, gap, tail and bucket functions on exact small inputs,
the teacher-forced comparison on the real in-process engine, and one end-to-end run on it (fp32,
no noise: the trainer's twin; noise: less agreement)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "measure_mismatch", ROOT / "tools" / "measure_mismatch.py"
)
mm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mm)


def test_agreement_compares_sets_not_orders():
    engine_TLK = torch.tensor([[[3, 1], [0, 2]], [[5, 4], [7, 6]]])  # [T=2, L=2, K=2]
    trainer_TLK = torch.tensor([[[1, 3], [2, 1]], [[4, 5], [6, 7]]])
    agree_TL = mm.route_agreement(engine_TLK, trainer_TLK)
    assert agree_TL.tolist() == [[True, False], [True, True]]
    with pytest.raises(RuntimeError, match="routes"):
        mm.route_agreement(engine_TLK, trainer_TLK[:1])


def test_gap_and_k3_match_the_trainers_formulas():
    trainer_R = torch.tensor([-1.0, -2.0, -30.0])
    engine_R = torch.tensor([-1.5, -1.0, -1.0])
    stats = mm.gap_stats(trainer_R, engine_R)
    d = [0.5, -1.0, -20.0]  # pi - mu, the last clamped to -20
    assert stats["tokens"] == 3
    assert stats["gap"] == pytest.approx(sum(abs(x) for x in d) / 3)
    assert stats["k3"] == pytest.approx(sum(math.expm1(-x) + x for x in d) / 3)


def test_the_tail_is_the_interpolated_99th_and_999th_percentile_of_the_absolute_gap():
    d = torch.arange(1001, dtype=torch.float64) / 1000  # |d| = 0, 0.001, ..., 1
    stats = mm.gap_stats(-d, torch.zeros(1001))
    assert stats["q99"] == pytest.approx(0.99) and stats["q999"] == pytest.approx(0.999)
    assert math.isnan(mm.gap_stats(torch.zeros(0), torch.zeros(0))["q999"])


def test_across_draws_gives_each_metrics_mean_min_and_max_and_every_draws_tokens():
    def arm(gap, q999, tokens):
        return {"gap": gap, "k3": 0.0, "q99": 0.0, "q999": q999, "agreement": 1.0,
                "tokens": tokens}  # fmt: skip

    draws = [{"a": arm(0.1, 1.0, 10)}, {"a": arm(0.3, 2.0, 20)}, {"a": arm(0.2, 4.0, 30)}]
    out = mm.across_draws(draws)["a"]
    assert out["gap"] == {"mean": pytest.approx(0.2), "min": 0.1, "max": 0.3}
    assert out["q999"] == {"mean": pytest.approx(7 / 3), "min": 1.0, "max": 4.0}
    assert out["tokens"] == 60


@pytest.mark.slow
def test_teacher_forcing_scores_the_other_engines_very_tokens(tmp_path):
    """The fp32 in-process engine's samples (tokens and log-probs mu) stand as "the real
    engine's"; the same engine teacher-forced on them gives back mu on exactly the response
    tokens (gap ~ 0), and a noisy engine on the same tokens does not. Real engines, no stub."""
    from real_sglang import servers

    from megatron_rl.data.addition_trace import AdditionTraceConfig, addition_trace_heldout
    from megatron_rl.rollout import InProcessEngine, InProcessEngineConfig, SamplingParams

    model = servers.write_tiny_checkpoint(tmp_path / "model")
    prompts = [list(r.prompt_ids) for r in addition_trace_heldout(AdditionTraceConfig())][:4]
    twin = InProcessEngine.from_pretrained(str(model), InProcessEngineConfig(dtype="float32"))
    samples = twin.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=1))
    # "trainer" scores: the sampled mu itself behind the prompt (only the response slice counts)
    scores = [
        (torch.cat([torch.zeros(s.prompt_ids_P.numel() - 1), s.logprobs_R]), None) for s in samples
    ]
    clean = mm.compare_teacher_forced(samples, scores, twin)
    assert clean["tokens"] == sum(s.response_ids_R.numel() for s in samples) > 0
    assert clean["gap"] < 1e-4 and clean["q999"] < 1e-3, clean
    noisy_config = InProcessEngineConfig(dtype="float32", router_noise=0.5)
    noisy = mm.compare_teacher_forced(
        samples, scores, InProcessEngine.from_pretrained(str(model), noisy_config)
    )
    assert noisy["gap"] > 100 * max(clean["gap"], 1e-6), noisy


def test_buckets_split_response_positions_at_their_edges():
    positions_R = torch.tensor([0, 15, 16, 70, 127])
    trainer_R = torch.tensor([-0.1, -0.3, -1.0, -2.0, -4.0])
    engine_R = torch.zeros(5)
    buckets = mm.bucket_stats(trainer_R, engine_R, positions_R)
    assert list(buckets) == ["0-15", "16-31", "32-63", "64-127"]
    first = {k: buckets["0-15"][k] for k in ("gap", "k3", "tokens")}
    assert first == {
        "gap": pytest.approx(0.2),
        "k3": pytest.approx((math.expm1(0.1) - 0.1 + math.expm1(0.3) - 0.3) / 2),
        "tokens": 2,
    }
    assert buckets["16-31"]["tokens"] == 1 and buckets["16-31"]["gap"] == pytest.approx(1.0)
    assert buckets["32-63"]["tokens"] == 0 and math.isnan(buckets["32-63"]["gap"])
    assert buckets["64-127"]["tokens"] == 2 and buckets["64-127"]["gap"] == pytest.approx(3.0)


def test_summary_reports_agreement_per_layer():
    agree_TL = torch.tensor([[True, False], [True, True], [False, True], [True, True]])
    zeros = torch.zeros(3)
    summary = mm.summarize(agree_TL, zeros, zeros, torch.arange(3))
    assert summary["agreement"] == pytest.approx(6 / 8)
    assert summary["agreement_per_layer"] == pytest.approx([0.75, 0.75])
    assert summary["token_layers"] == 8 and summary["tokens"] == 3 and summary["gap"] == 0


def test_closest_arm_weighs_agreement_and_gap_and_checks_the_band():
    real = {"agreement": 0.90, "gap": 0.02}
    arms = {
        "a": {"agreement": 0.99, "gap": 0.02},  # 9 bands off in agreement
        "b": {"agreement": 0.905, "gap": 0.025},  # within both bands
        "c": {"agreement": 0.90, "gap": 0.2},  # gap 10x off
    }
    assert mm.closest_arm(real, arms, 0.01, 1.5) == ("b", True)
    assert mm.closest_arm(real, {"a": arms["a"], "c": arms["c"]}, 0.01, 1.5)[1] is False


@pytest.mark.slow
def test_the_fp32_engine_without_noise_is_the_trainers_twin_and_noise_lowers_agreement(
    tmp_path,
):
    from real_sglang import servers

    model = servers.write_tiny_checkpoint(tmp_path / "model")
    out = tmp_path / "report.json"
    command = [
        sys.executable, "tools/measure_mismatch.py", "--model", str(model), "--seed", "3",
        "--samples", "2", "--max-new-tokens", "16", "--dtype", "float32",
        "--router-noise", "0", "0.5", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    arms = json.loads(out.read_text())["arms"]
    clean, noisy = arms["inprocess float32 sigma=0"], arms["inprocess float32 sigma=0.5"]
    assert clean["agreement"] == 1.0 and clean["gap"] < 1e-5, clean
    assert clean["tokens"] > 24 * 2 and clean["token_layers"] > clean["tokens"]
    assert noisy["agreement"] < 0.95, noisy
    assert "| inprocess float32 sigma=0.5 |" in result.stdout
    assert (tmp_path / "report.md").read_text() == result.stdout
