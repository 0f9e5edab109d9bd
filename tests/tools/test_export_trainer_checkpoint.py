"""tools/export_trainer_checkpoint.py: a step the real CLI saved comes out as an HF checkpoint
holding exactly the saved weights; anything but a one-rank torch save is refused by name."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "export_trainer_checkpoint", ROOT / "tools" / "export_trainer_checkpoint.py"
)
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


@pytest.mark.slow
def test_a_saved_step_exports_to_hf_with_exactly_its_weights(tmp_path):
    from real_sglang import servers

    from megatron_rl.backend import destroy_distributed, init_distributed
    from megatron_rl.model import build_model, load_hf_config
    from megatron_rl.model.conversion import load_checkpoint
    from megatron_rl.model.options import ModelOptions
    from megatron_rl.parallel import ParallelConfig

    start = servers.write_tiny_checkpoint(tmp_path / "start")
    train = [
        sys.executable, "-m", "megatron_rl.train", "--device", "cpu", "--model", str(start),
        "--train-iters", "1", "--lr", "1e-2", "--save", str(tmp_path / "save"),
        "--run-dir", str(tmp_path / "run"), "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(train, cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    step_dir = tmp_path / "save" / "step_00000001"
    out = tmp_path / "hf"
    result = subprocess.run(
        [sys.executable, "tools/export_trainer_checkpoint.py", "--step-dir", str(step_dir),
         "--config", str(start), "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not (tmp_path / "hf.tmp").exists()
    saved = tool.model_state(step_dir)
    init_distributed(ParallelConfig(), rank=0, world_size=1, device="cpu")
    try:
        hf_config = load_hf_config(str(out))
        exported, initial = build_model(hf_config, ModelOptions()), None
        load_checkpoint(exported, str(out), hf_config)
        initial = build_model(hf_config, ModelOptions())
        load_checkpoint(initial, str(start), hf_config)
        ours, theirs = exported.state_dict(), initial.state_dict()
    finally:
        destroy_distributed()
    weights = [k for k, v in saved.items() if torch.is_tensor(v) and v.is_floating_point()]
    assert weights and all(torch.equal(ours[k], saved[k]) for k in weights)
    assert any(not torch.equal(theirs[k], saved[k]) for k in weights)  # the step moved them


def test_anything_but_a_one_rank_torch_save_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"no checkpoint\.json"):
        tool.model_state(tmp_path)
    (tmp_path / "checkpoint.json").write_text(json.dumps({"format": "torch_dist"}))
    with pytest.raises(ValueError, match="'torch_dist'; only 'torch' saves"):
        tool.model_state(tmp_path)
    (tmp_path / "checkpoint.json").write_text(json.dumps({"format": "torch"}))
    for rank in (0, 1):
        (tmp_path / f"model_rank0000{rank}.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="only a one-rank save"):
        tool.model_state(tmp_path)
