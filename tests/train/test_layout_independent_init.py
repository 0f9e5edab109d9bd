"""A seeded run from random weights is one run at every parallel layout, through the real CLI.

megatron-core draws each rank's initial weights from whatever generator state that rank reaches,
so before `init_from_seed` a PP = 2 run trained another model than PP = 1 (first-step grad norm
1.0004 against 0.9029 on the same batch). The CLI runs below start from random weights (no
``--model``): world 1, then PP 2, TP 2 x PP 2 and TP 2 x EP 2 under torchrun, two steps each,
saved as torch_dist checkpoints. The grad norms of both steps and every parameter and Adam moment
after step 2 (read from the checkpoints under megatron's global keys) must equal world 1's to
float tolerance (the layouts sum their reductions in other orders).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_tensors import checkpoint_tensors
from ports import torchrun

ROOT = Path(__file__).resolve().parents[2]
LR = 3e-3  # one Adam step moves a weight by about this much
BATCH = (
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "4",
    "--global-batch-size", "16", "--max-response-length", "4", "--lr", str(LR),
)  # fmt: skip
PP2 = ("--pipeline-model-parallel-size", "2")
TP2_SP = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
LAYOUTS = {
    "pp2": (2, PP2),
    "tp2-pp2-sp": (4, (*PP2, *TP2_SP)),
    # EP across the TP ranks (expert TP 1): data parallel stays 1, so the same samples are drawn
    # (each data-parallel rank samples its share of the prompts with its own seed)
    "tp2-ep2-sp": (2, ("--expert-model-parallel-size", "2", *TP2_SP)),
}


def _train(tmp: Path, name: str, nproc: int, flags: tuple[str, ...]) -> dict:
    """Two CLI steps from random weights; the metric rows and the step-2 checkpoint's tensors."""
    run_dir, save = tmp / name, tmp / f"{name}-ckpt"
    launcher = [sys.executable, "-m", "megatron_rl.train"]
    if nproc > 1:
        launcher = [*torchrun(nproc), "-m", "megatron_rl.train"]
    command = [
        *launcher, "--run-dir", str(run_dir), "--device", "cpu", "--no-progress",
        "--train-iters", "2", "--torch-threads", "1", "--save", str(save),
        "--ckpt-format", "torch_dist", *BATCH, *flags,
    ]  # fmt: skip
    log = tmp / f"{name}.log"
    with log.open("w") as out:  # a file, not a pipe (see tests/rollout/torchrun_cli.py)
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=out).returncode
    assert code == 0, log.read_text()[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return {"rows": rows, "tensors": checkpoint_tensors(save / "step_00000002", tmp / name)}


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("init"), "world1", 1, ())


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("layout_independent_init")  # one worker: the world-1 run is made once
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_trains_the_world1_model_from_the_same_seed(world1, tmp_path, layout):
    nproc, flags = LAYOUTS[layout]
    staged = _train(tmp_path, layout, nproc, flags)
    assert [r["step"] for r in staged["rows"]] == [r["step"] for r in world1["rows"]] == [1, 2]
    for got, want in zip(staged["rows"], world1["rows"], strict=True):
        assert want["grad_norm"] > 0
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), got["step"]
        assert got["reward/mean"] == want["reward/mean"]  # the same samples were drawn
    want_tensors, got_tensors = world1["tensors"], staged["tensors"]
    assert set(got_tensors) == set(want_tensors)
    weights = [k for k in want_tensors if not k.startswith("optimizer.")]
    assert len(weights) > 20 and any("experts" in k for k in weights)
    for key, want in want_tensors.items():
        got = got_tensors[key]
        if key.startswith("optimizer."):  # Adam moments: float noise of the reordered sums
            scale = want.abs().max().item()
            assert (got - want).abs().max().item() <= 1e-4 * scale, key
        else:  # m / sqrt(v) enlarges that noise where gradients are tiny: 1% of one step
            torch.testing.assert_close(got, want, rtol=0, atol=0.01 * LR, msg=key)
