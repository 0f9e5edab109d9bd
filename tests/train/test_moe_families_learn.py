"""The main job learns the built-in task with the DeepSeek-V3 and GLM-4.5 tiny presets.

`make main`'s defaults (80 steps of 16 prompts x 8 samples, GRPO) with ``--model``
``tiny-deepseek`` (multi-latent attention, one dense layer, shared experts, group-limited
sigmoid routing with the aux-loss-free bias) or ``tiny-glm``, over several seeds. One run's
outcome is a draw: the CPU's kernels change the last bits, the last bits change the samples,
and the samples change the run (seed 1234's ``tiny-deepseek`` ends at 0.92 with torch's AVX2
kernels and at 0.30 with the AVX-512 ones on the same Intel Xeon). Measured over seeds 1234 and
1-5 with both kernel paths (12 runs each, Intel Xeon): the mean sampled accuracy of the last
10 steps is 0.07-0.92 for ``tiny-deepseek`` (mean 0.47; one run in twelve does not take off in
80 steps) and 0.38-0.95 for ``tiny-glm`` (mean 0.66), from 0.06-0.10 in the first 5 steps
(chance is 1/16). The claim is on the mean over the seeds, whose bar sits well inside that
spread: at least 0.2 and 2.5 times the first 5 steps' mean (4 seeds of ``tiny-deepseek``,
their means 0.41 and 0.45 on the two kernel paths; 3 of ``tiny-glm``, 0.63 and 0.79).
"""

from __future__ import annotations

import json

import pytest
from trainer_testing import rendezvous

from megatron_rl.train.config import TrainConfig
from megatron_rl.train.run import run

SEEDS = {"tiny-deepseek": (1, 2, 3, 4), "tiny-glm": (1, 2, 3)}


def _accuracy(tmp_path, model: str, seed: int) -> list[float]:
    run_dir = tmp_path / f"seed{seed}"
    config = TrainConfig.from_flags(
        model=model, run_dir=str(run_dir), device="cpu", no_progress=True, seed=seed
    )
    run(config, **rendezvous(tmp_path, f"rdzv{seed}"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert len(rows) == config.schedule.train_iters == 80
    return [r["accuracy"] for r in rows]


@pytest.mark.slow
@pytest.mark.hardware_sensitive
@pytest.mark.parametrize("model", list(SEEDS))
def test_the_main_job_learns_with_the_family_preset_over_seeds(tmp_path, model):
    runs = {seed: _accuracy(tmp_path, model, seed) for seed in SEEDS[model]}
    first = sum(sum(a[:5]) / 5 for a in runs.values()) / len(runs)
    last = sum(sum(a[-10:]) / 10 for a in runs.values()) / len(runs)
    summary = {
        seed: (round(sum(a[:5]) / 5, 3), round(sum(a[-10:]) / 10, 3)) for seed, a in runs.items()
    }
    assert first < 0.15, summary
    assert last >= 0.2 and last >= 2.5 * first, summary
