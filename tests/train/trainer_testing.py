"""Helpers for the trainer tests: small embedded configurations and a file rendezvous."""

from __future__ import annotations

import contextlib

from megatron_rl.train.config import TrainConfig


def small_config(tmp_path, **overrides) -> TrainConfig:
    """The embedded default, shrunk: 4 prompts x 4 samples, N = 2 updates of 8 samples."""
    values = dict(
        model="tiny",
        device="cpu",
        train_iters=2,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        global_batch_size=8,
        micro_batch_size=4,
        max_response_length=3,
        run_dir=str(tmp_path / "run"),
        no_progress=True,
        seed=7,
    )
    values.update(overrides)
    return TrainConfig.from_flags(**values)


def rendezvous(tmp_path, name: str = "rdzv") -> dict:
    return {"rank": 0, "world_size": 1, "init_method": f"file://{tmp_path}/{name}"}


def rank_share(samples: list, rank: int, world_size: int, global_batch: int) -> list:
    """Rank ``rank``'s part of every mini-batch: the trainer splits its samples into
    ``global_batch / world_size`` chunks, so rank r must hold slice r of each global mini-batch."""
    per_rank = global_batch // world_size
    share = []
    for start in range(0, len(samples), global_batch):
        begin = start + rank * per_rank
        share.extend(samples[begin : begin + per_rank])
    return share


class Killed(RuntimeError):
    """The job dies after a step (no stop signal, no final save)."""


@contextlib.contextmanager
def killed_after(step: int):
    """Within the block, `Trainer.step` raises `Killed` once the trainer has done ``step`` steps
    (a kill -9: no stop signal, no final save); the block ends there. AssertionError when the
    block ends without it."""
    from megatron_rl.train.trainer import Trainer

    real = Trainer.step

    def step_until(trainer, should_stop=None):
        metrics = real(trainer, should_stop)
        if trainer.step_index == step:
            raise Killed
        return metrics

    Trainer.step = step_until
    try:
        yield
    except Killed:
        return
    finally:
        Trainer.step = real
    raise AssertionError(f"the run ended before step {step}: nothing was killed")
