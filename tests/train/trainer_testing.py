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


class StepRecorder:
    """Wraps `Trainer.train_on`: ``steps`` gets one row per step: the trained prompts, the
    prompt each sample really holds, each sample's oldest and newest token's version, its
    spans and response, and the trainer's version. Undone by pytest's ``monkeypatch`` when
    given, else by `close` (a spawned rank's process)."""

    def __init__(self, monkeypatch=None) -> None:
        from megatron_rl.train.trainer import Trainer

        self.steps: list[dict] = []
        self._real = real = Trainer.train_on
        steps = self.steps

        def train_on(trainer, samples, should_stop=None):
            by_tokens = {tuple(r.prompt_ids): r.index for r in trainer.rollouts.records}
            steps.append(
                {
                    "prompts": list(trainer.rollouts.trained_prompts),
                    "sample_prompts": [by_tokens[tuple(s.prompt_ids.tolist())] for s in samples],
                    "versions": [s.weight_version for s in samples],
                    "newest": [
                        max([s.weight_version, *(v for v, _, _ in s.weight_versions)])
                        for s in samples
                    ],
                    "spans": [[list(span) for span in s.weight_versions] for s in samples],
                    "responses": [s.response_ids.tolist() for s in samples],
                    "trainer_version": trainer.weight_version,
                }
            )
            return real(trainer, samples, should_stop)

        if monkeypatch is not None:
            monkeypatch.setattr(Trainer, "train_on", train_on)
        else:
            Trainer.train_on = train_on

    def close(self) -> None:
        from megatron_rl.train.trainer import Trainer

        Trainer.train_on = self._real
