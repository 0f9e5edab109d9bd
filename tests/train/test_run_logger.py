"""Metrics land once per step in metrics.jsonl (flushed), in wandb offline, and in a PNG curve."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
import torch

from megatron_rl.train.run_logger import (
    RunLogger,
    RunLoggerConfig,
    read_metrics,
)


def _config(tmp_path, **overrides) -> RunLoggerConfig:
    fields = dict(run_dir=str(tmp_path / "run"), total_steps=10, show_progress=True)
    return RunLoggerConfig(**{**fields, **overrides})


def _lines(tmp_path) -> list[dict]:
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def test_each_log_call_appends_one_flushed_line_with_converted_values(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="megatron_rl.train.run_logger")
    with RunLogger(_config(tmp_path), run_config={"lr": 1e-6, "loss": "gspo"}) as run:
        run.log(1, {"reward/mean": torch.tensor(0.25), "accuracy": 0.5, "n": np.int64(3)})
        assert _lines(tmp_path) == [{"step": 1, "reward/mean": 0.25, "accuracy": 0.5, "n": 3}]
        run.log(2, {"reward/mean": 0.75, "ok": True})  # read back while the file is open
        assert _lines(tmp_path)[-1] == {"step": 2, "reward/mean": 0.75, "ok": 1}
        with pytest.raises(ValueError, match=r"metric 'v': tensor of shape \(2,\)"):
            run.log(3, {"v": torch.ones(2)})
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["loss"] == "gspo"
    # Not a TTY under pytest: the progress line goes to the log with the headline metrics.
    assert "step 2/10  reward/mean=0.75" in caplog.text


def test_non_finite_values_are_null_and_warned_by_name(tmp_path, caplog):
    with RunLogger(_config(tmp_path)) as run:
        run.log(1, {"loss": float("nan"), "grad_norm": torch.tensor(math.inf), "ok": 1.0})
    assert _lines(tmp_path) == [{"step": 1, "loss": None, "grad_norm": None, "ok": 1.0}]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'loss' is nan" in m for m in warned) and any(
        "'grad_norm' is inf" in m for m in warned
    )


def test_resume_drops_lines_after_the_checkpoint_step(tmp_path):
    with RunLogger(_config(tmp_path)) as run:
        for step in range(1, 6):
            run.log(step, {"accuracy": step / 10})
    with open(tmp_path / "run" / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "accur')  # a line cut off by the crash
    with RunLogger(_config(tmp_path), initial_step=3) as run:  # resumed from the step-3 checkpoint
        run.log(4, {"accuracy": 0.9})
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3, 4]
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[-1] == {"step": 4, "accuracy": 0.9}
    with RunLogger(_config(tmp_path)):  # a fresh run in the same folder starts over
        pass
    assert _lines(tmp_path) == []


def test_non_main_rank_writes_nothing(tmp_path):
    config = _config(tmp_path, wandb_project="p")
    with RunLogger(config, run_config={"a": 1}, is_main=False) as run:
        run.log(1, {"accuracy": 1.0})
    assert not (tmp_path / "run").exists()


def test_config_rejects_unknown_wandb_mode(tmp_path):
    with pytest.raises(ValueError, match="wandb_mode='offlin'"):
        _config(tmp_path, wandb_mode="offlin")


@pytest.mark.slow
def test_wandb_offline_run_is_created_under_run_dir_and_resumed(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
    }.items():
        monkeypatch.setenv(name, value)
    config = _config(tmp_path, wandb_project="megatron_rl_test", wandb_run_name="t")
    with RunLogger(config, run_config={"lr": 1e-6}) as run:
        run.log(1, {"accuracy": 0.5})
    run_id = (tmp_path / "run" / "wandb_run_id").read_text()
    runs = list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
    with RunLogger(config, initial_step=1) as run:
        run.log(2, {"accuracy": 0.6})
    assert (tmp_path / "run" / "wandb_run_id").read_text() == run_id


def test_progress_bar_on_a_terminal_shows_headline_metrics(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich treats the captured stdout as a terminal
    with RunLogger(_config(tmp_path, total_steps=4)) as run:
        for step in range(1, 5):
            run.log(step, {"accuracy": 0.5, "time/step": 0.25, "other": 1.0})
    out = capsys.readouterr().out
    assert "4/4" in out and "accuracy=0.5  time/step=0.25" in out and "other" not in out
