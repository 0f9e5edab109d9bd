"""``--tensorboard-dir``: every metrics.jsonl row is also a set of TensorBoard scalars under the
same names at the same step, with a "timeline" chart of the ``time/*`` phases; flushed per step,
continued on resume; a bad folder is one error naming the flag before the model is built; and a
run without the flag never imports tensorboard."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer_testing import small_config

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

import megatron_rl.train.run as run_module
from megatron_rl.train.run_logger import RunLogger, RunLoggerConfig, read_metrics
from megatron_rl.train.tensorboard_writer import TensorBoardWriter

ROOT = Path(__file__).resolve().parents[2]


def _events(folder) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def _points(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def _timeline_regexes(events: EventAccumulator) -> dict[str, list[str]]:
    """``{chart title: tag regexes}`` of the custom-scalars layout's "timeline" category."""
    (config,) = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(config.tensor_proto.string_val[0])
    (timeline,) = [c for c in layout.category if c.title == "timeline"]
    return {chart.title: list(chart.multiline.tag) for chart in timeline.chart}


@pytest.mark.slow
def test_cli_run_writes_each_jsonl_metric_as_a_scalar_with_the_same_name_step_and_value(
    tmp_path,
):
    run_dir, board = tmp_path / "run", tmp_path / "board"
    command = [
        sys.executable, "-m", "megatron_rl.train", "--run-dir", str(run_dir), "--device", "cpu",
        "--train-iters", "2", "--torch-threads", "1", "--no-progress",
        "--tensorboard-dir", str(board),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-6000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    names = {name for row in rows for name in row} - {"step"}
    events = _events(board)
    assert set(events.Tags()["scalars"]) == names
    for name in names:
        expected = [(row["step"], row[name]) for row in rows if row.get(name) is not None]
        points = _points(events, name)
        assert [step for step, _ in points] == [step for step, _ in expected], name
        for (_, value), (_, want) in zip(points, expected, strict=True):
            assert value == pytest.approx(want, rel=1e-6, abs=1e-30), name  # stored as float32
    phases = sorted(name for name in names if name.startswith("time/"))
    assert {"time/rollout", "time/old_logprob", "time/update", "time/sync"} <= set(phases)
    regexes = _timeline_regexes(events)
    assert len(regexes) == 1  # one chart holds every phase of the step
    (patterns,) = regexes.values()
    tags = events.Tags()["scalars"]
    charted = sorted(tag for tag in tags if any(re.match(p, tag) for p in patterns))
    assert charted == phases
    (text,) = events.Tensors("run_config/text_summary")
    assert b'"train_iters": 2' in text.tensor_proto.string_val[0]


class _Built(Exception):
    """Raised where the trainer would be built: the start-up checks have passed."""


@pytest.mark.parametrize("kind", ["a file", "a folder under a file"])
def test_a_tensorboard_dir_that_is_a_file_or_unwritable_is_one_error_before_the_model(
    tmp_path, monkeypatch, capsys, kind
):
    from megatron_rl.train.__main__ import main

    def build(*args, **kwargs):
        raise _Built  # the check did not stop the run before the trainer

    monkeypatch.setattr(run_module, "Trainer", build)
    (tmp_path / "file").write_text("")  # a folder under a regular file: fails for root too
    board = tmp_path / "file" if kind == "a file" else tmp_path / "file" / "tb"
    argv = ["--run-dir", str(tmp_path / "run"), "--device", "cpu", "--train-iters", "1"]
    assert main([*argv, "--no-progress", "--tensorboard-dir", str(board)]) == 2
    err = capsys.readouterr().err
    why = "is a file, not a folder" if kind == "a file" else "is not writable: Not a directory"
    assert f"error: --tensorboard-dir {board} {why}" in err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_empty_tensorboard_dir_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--tensorboard-dir='': give a folder"):
        RunLoggerConfig(run_dir="unused", tensorboard_dir="")
    with pytest.raises(ValueError, match=r"--tensorboard-dir='': give a folder"):
        small_config(Path("unused"), tensorboard_dir="")


def test_each_step_is_on_disk_when_log_returns_and_survives_an_error(tmp_path, monkeypatch):
    config = RunLoggerConfig(
        run_dir=str(tmp_path / "run"), tensorboard_dir=str(tmp_path / "tb"), show_progress=False
    )
    write = RecordWriter.write

    def slow_write(self, data):  # a slow disk: the writer's thread lags behind `add_scalar`
        time.sleep(0.3)
        write(self, data)

    with pytest.raises(RuntimeError, match="boom"), RunLogger(config) as run:
        monkeypatch.setattr(RecordWriter, "write", slow_write)
        run.log(1, {"policy/loss": 0.5, "time/step": 2.0})
        assert _points(_events(tmp_path / "tb"), "policy/loss") == [(1, 0.5)]  # flushed
        monkeypatch.setattr(RecordWriter, "write", write)
        run.log(2, {"policy/loss": 0.25, "time/step": float("nan")})
        raise RuntimeError("boom")
    events = _events(tmp_path / "tb")
    assert _points(events, "policy/loss") == [(1, 0.5), (2, 0.25)]
    (step, value), (last_step, last) = _points(events, "time/step")
    assert (step, value, last_step) == (1, 2.0, 2) and math.isnan(last)  # JSONL holds null
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1]) == {
        "step": 2,
        "policy/loss": 0.25,
        "time/step": None,
    }


def test_a_resumed_run_continues_the_curves_and_a_fresh_one_hides_the_old_points(tmp_path):
    board = str(tmp_path / "tb")
    first = TensorBoardWriter(board)
    for step in (1, 2, 3):
        first.log(step, {"accuracy": step / 4})  # exact in float32
    first.close()
    resumed = TensorBoardWriter(board, initial_step=1)  # the checkpoint of step 1 was loaded
    for step in (2, 3):
        resumed.log(step, {"accuracy": step})
    resumed.close()
    assert _points(_events(board), "accuracy") == [(1, 0.25), (2, 2.0), (3, 3.0)]
    fresh = TensorBoardWriter(board)
    fresh.log(1, {"accuracy": 7.0})
    fresh.close()
    assert _points(_events(board), "accuracy") == [(1, 7.0)]
    assert len(os.listdir(board)) == 3  # nothing deleted: the old points are only hidden


def test_only_the_main_rank_writes_events(tmp_path):
    config = RunLoggerConfig(run_dir=str(tmp_path / "run"), tensorboard_dir=str(tmp_path / "tb"))
    with RunLogger(config, is_main=False) as run:
        run.log(1, {"accuracy": 0.5})
    assert not (tmp_path / "tb").exists()


@pytest.mark.slow
def test_tensorboard_is_imported_only_with_the_flag(tmp_path):
    code = (
        "import json, sys\n"
        "from megatron_rl.train.run_logger import RunLogger, RunLoggerConfig, claim_run_dir\n"
        "seen = {}\n"
        "for name, board in (('off', None), ('on', sys.argv[2])):\n"
        "    config = RunLoggerConfig(run_dir=sys.argv[1] + name, tensorboard_dir=board,\n"
        "                             show_progress=False)\n"
        "    claim_run_dir(config, resumed=False)\n"
        "    with RunLogger(config) as run:\n"
        "        run.log(1, {'time/step': 1.0})\n"
        "    seen[name] = sorted(m for m in sys.modules if m.startswith(\n"
        "        ('tensorboard', 'torch.utils.tensorboard')))\n"
        "print(json.dumps(seen))\n"
    )
    argv = [
        sys.executable,
        "-W",
        "ignore",
        "-c",
        code,
        str(tmp_path / "run-"),
        str(tmp_path / "tb"),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["off"] == []
    assert "torch.utils.tensorboard" in seen["on"]  # the check can fail
