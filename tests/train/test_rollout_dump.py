"""Rollout dumps (`megatron_rl.train.rollouts.dump`): the step files, their refusals, the flags'
refusals, and the real CLI: a --load-rollouts run replays a --save-rollouts run bit for bit, and
--rollout-only generates the live run's first batch without training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.routing import RoutingBlob
from megatron_rl.train.batch import TrainSample
from megatron_rl.train.config import parse_args
from megatron_rl.train.rollouts.dump import (
    RolloutDump,
    dump_header,
    read_step,
    step_path,
    write_step,
)
from megatron_rl.train.rollouts.source import RolloutBatch

ROOT = Path(__file__).resolve().parents[2]


def _hf(**overrides):
    values = dict(
        model_type="qwen3_moe",
        vocab_size=64,
        num_hidden_layers=2,
        hidden_size=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return SimpleNamespace(**{**values, **overrides})


def _header(vocab: int = 60, **hf):
    return dump_header(parse_args([]), _hf(**hf), tokenizer_vocab_size=vocab, dp=1)


def _sample(with_routes: bool) -> TrainSample:
    routes = None
    if with_routes:
        data = torch.randint(0, 4, (5, 2, 2), dtype=torch.uint8)
        routes = RoutingBlob(data=data, codec="uint8", num_tokens=5, num_layers=2)
    return TrainSample(
        prompt_ids=torch.tensor([3, 4, 5]),
        response_ids=torch.tensor([7, 8, 9]),
        rollout_logprobs=torch.tensor([-0.5, -1.25, -2.0]),
        advantage=0.75,
        reward=1.0,
        in_loss=False,
        routes=routes,
        weight_version=2,
        truncated=True,
        weight_versions=((2, 0, 1), (3, 1, 3)),
        prompt_index=11,
    )


def _batch() -> RolloutBatch:
    return RolloutBatch(
        samples=[_sample(True), _sample(False)],
        metrics={"reward/mean": 0.5, "accuracy": 0.25},
        prompts=[11],
        sampler_before={"ignored": 1},
    )


def _same(a: TrainSample, b: TrainSample) -> None:
    for name in ("prompt_ids", "response_ids", "rollout_logprobs"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for name in ("advantage", "reward", "in_loss", "weight_version", "truncated"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.weight_versions == b.weight_versions and a.prompt_index == b.prompt_index
    assert (a.routes is None) == (b.routes is None)
    if a.routes is not None:
        assert torch.equal(a.routes.data, b.routes.data) and a.routes.data.dtype == torch.uint8
        assert (a.routes.codec, a.routes.num_tokens, a.routes.num_layers) == ("uint8", 5, 2)


def _dump(tmp_path, header, load: bool) -> RolloutDump:
    rollout = SimpleNamespace(
        save_rollouts=None if load else str(tmp_path), load_rollouts=str(tmp_path) if load else None
    )
    return RolloutDump(SimpleNamespace(rollout=rollout), header, dp_rank=0, writes=True)


def test_stored_batch_replays_every_sample_field_and_the_metrics(tmp_path):
    header, batch = _header(), _batch()
    _dump(tmp_path, header, load=False).store(0, batch, reward_error="boom")
    assert os.path.isfile(tmp_path / "step_00000001" / "rank_00000.pt")
    assert not [n for n in os.listdir(tmp_path / "step_00000001") if n.startswith(".tmp-")]
    replayed, error = _dump(tmp_path, header, load=True).replay(0, {"position": 7})
    assert error == "boom"
    assert replayed.metrics == batch.metrics and replayed.prompts == [11]
    assert replayed.sampler_before == {"position": 7}  # nothing was drawn
    assert len(replayed.samples) == 2
    for a, b in zip(batch.samples, replayed.samples, strict=True):
        _same(a, b)


def test_header_names_the_model_tokenizer_and_flags():
    header = _header()
    assert header["model"] == {
        "model_type": "qwen3_moe",
        "vocab_size": 64,
        "num_hidden_layers": 2,
        "hidden_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    }
    assert header["tokenizer_vocab_size"] == 60 and header["data_parallel_size"] == 1
    assert header["seed"] == header["flags"]["parallel"]["seed"]
    assert header["flags"]["rollout"]["rollout_batch_size"] == 16


@pytest.mark.parametrize(
    ("mine", "field"),
    [
        (dict(vocab_size=128), "model.vocab_size"),
        (dict(num_hidden_layers=3), "model.num_hidden_layers"),
        (dict(num_experts=8), "model.num_experts"),
        (dict(vocab=61), "tokenizer_vocab_size"),
    ],
)
def test_dump_of_another_model_or_vocabulary_is_refused_naming_the_field(tmp_path, mine, field):
    write_step(step_path(str(tmp_path), 0, 0), _header(), _batch(), None)
    with pytest.raises(ValueError, match=rf"step 1\).*{field}="):
        read_step(step_path(str(tmp_path), 0, 0), _header(**mine), step=1)


def test_missing_step_file_is_an_error_naming_the_step(tmp_path):
    header = _header()
    _dump(tmp_path, header, load=False).store(0, _batch(), None)
    with pytest.raises(ValueError, match="step 2 has no file"):
        _dump(tmp_path, header, load=True).replay(1, {})


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--load-rollouts", "d", "--async-rollout"], "--async-rollout"),
        (["--load-rollouts", "d", "--dynamic-sampling"], "--dynamic-sampling"),
        (
            ["--load-rollouts", "d", "--carry-over-groups", "2", "--behavior-logprobs", "rollout"],
            "--carry-over-groups",
        ),
        (["--load-rollouts", "d", "--rollout-only"], "--rollout-only"),
        (["--load-rollouts", "d", "--save-rollouts", "e"], "--save-rollouts"),
        (["--rollout-only", "--async-rollout"], "--async-rollout"),
    ],
)
def test_incompatible_dump_flags_are_refused_at_parse_time(flags, named):
    with pytest.raises(ValueError, match=named):
        parse_args(flags)


def test_dump_flags_parse_into_the_rollout_section():
    rollout = parse_args(["--save-rollouts", "d", "--rollout-only"]).rollout
    assert (rollout.save_rollouts, rollout.load_rollouts, rollout.rollout_only) == ("d", None, True)


# ---------------------------------------------------------------------- the real CLI
SMALL = (
    "--device", "cpu", "--no-progress", "--torch-threads", "1", "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4", "--global-batch-size", "8", "--micro-batch-size", "4",
    "--max-response-length", "3", "--routing-replay", "r3",
)  # fmt: skip
TIMING = "time/"  # wall-clock keys differ between any two runs


def _cli(tmp_path: Path, name: str, *flags: str) -> list[dict]:
    run_dir = tmp_path / name
    command = [sys.executable, "-m", "megatron_rl.train", "--run-dir", str(run_dir), *SMALL]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([*command, *flags], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    def flat(value, prefix: str):
        if isinstance(value, dict):
            for key, item in value.items():
                yield from flat(item, f"{prefix}/{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                yield from flat(item, f"{prefix}/{i}")
        elif torch.is_tensor(value):
            yield prefix, value

    return dict(flat(torch.load(path, map_location="cpu", weights_only=False), ""))


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """3 steps of the real CLI writing its rollouts (R3: the dump holds routes)."""
    tmp = tmp_path_factory.mktemp("live")
    rows = _cli(
        tmp, "run", "--train-iters", "3", "--save-rollouts", str(tmp / "dump"),
        "--save", str(tmp / "ck"), "--ckpt-format", "torch",
    )  # fmt: skip
    return tmp, rows


@pytest.mark.slow
def test_load_rollouts_replays_the_live_run_bit_identically(live_run, tmp_path):
    live, live_rows = live_run
    payload = torch.load(live / "dump" / "step_00000001" / "rank_00000.pt", weights_only=True)
    assert payload["samples"][0]["routes"] is not None  # the R3 routes travel in the dump
    rows = _cli(
        tmp_path, "replay", "--train-iters", "3", "--load-rollouts", str(live / "dump"),
        "--save", str(tmp_path / "ck"), "--ckpt-format", "torch",
    )  # fmt: skip
    assert len(rows) == len(live_rows) == 3
    for mine, theirs in zip(rows, live_rows, strict=True):
        drop = lambda row: {k: v for k, v in row.items() if not k.startswith(TIMING)}  # noqa: E731
        assert drop(mine) == drop(theirs)
        assert {"policy/loss", "grad_norm", "entropy", "reward/mean"} <= set(drop(mine))
    step = "step_00000003"
    for name in ("model_rank00000.pt", "optim_rank00000.pt"):
        a, b = _tensors(live / "ck" / step / name), _tensors(tmp_path / "ck" / step / name)
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[k], b[k]) for k in a), name
    # no prompt was drawn: the replay's sampler never moved, the live run's did
    live_state = json.loads((live / "ck" / step / "rl_state.json").read_text())["sampler"]
    replay_state = json.loads((tmp_path / "ck" / step / "rl_state.json").read_text())["sampler"]
    assert replay_state != live_state


@pytest.mark.slow
def test_rollout_only_generates_the_live_first_batch_without_training(live_run, tmp_path):
    live, _ = live_run
    rows = _cli(
        tmp_path, "gen", "--train-iters", "2", "--rollout-only",
        "--save-rollouts", str(tmp_path / "dump"),
    )  # fmt: skip
    assert len(rows) == 2
    for row in rows:
        assert "reward/mean" in row and "grad_norm" not in row and "policy/loss" not in row
    # the same initial weights and seed: the first batch is the live run's
    first = "step_00000001/rank_00000.pt"
    mine = torch.load(tmp_path / "dump" / first, weights_only=True)["samples"]
    theirs = torch.load(live / "dump" / first, weights_only=True)["samples"]
    assert len(mine) == len(theirs)
    for a, b in zip(mine, theirs, strict=True):
        assert torch.equal(a["response_ids"], b["response_ids"])
        assert torch.equal(a["rollout_logprobs"], b["rollout_logprobs"])
        assert torch.equal(a["routes"]["data"], b["routes"]["data"])
