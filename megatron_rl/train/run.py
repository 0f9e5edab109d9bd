"""The training run: steps, logging, checkpoints, preemption, the learning-curve picture."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch.distributed as dist

from megatron_rl.train.checkpoint import load_training_state, save_training_state
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.preemption import PreemptionHandler
from megatron_rl.train.run_logger import RunLogger, plot_learning_curve
from megatron_rl.train.trainer import Trainer

logger = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """Too many consecutive non-finite updates; the last good state was saved."""


def run(config: TrainConfig, **dist_kwargs) -> dict:
    """Train for ``config.train_iters`` steps; returns the last step's metrics."""
    trainer = Trainer(config, **dist_kwargs)
    last: dict = {}
    try:
        if config.load:
            state = load_training_state(
                config.load, model=trainer.model, optimizer=trainer.optimizer
            )
            if state is not None:
                trainer.load_state_dict(state)
                logger.info("resumed from %s at step %d", config.load, trainer.step_index)
        is_main = dist.get_rank() == 0
        log_config = config.logger_config()
        run_config = dataclasses.asdict(config)
        with (
            RunLogger(
                log_config, run_config=run_config, is_main=is_main, initial_step=trainer.step_index
            ) as run_logger,
            PreemptionHandler() as preemption,
        ):
            while trainer.step_index < config.train_iters:
                metrics = trainer.step(should_stop=preemption.agreed)
                if metrics is None:  # stopped after the rollout: the last step is the state
                    logger.warning("stop signal: saving step %d and exiting", trainer.step_index)
                    _save(trainer, config)
                    return last
                last = metrics
                run_logger.log(trainer.step_index, last)
                if trainer.nonfinite.exhausted:
                    _save(trainer, config)
                    raise TrainingStopped(trainer.nonfinite.stop_message(trainer.step_index))
                interval = config.save_interval
                if interval and trainer.step_index % interval == 0:
                    _save(trainer, config)
                if preemption.agreed():
                    logger.warning(
                        "preemption signal: saving at step %d and exiting", trainer.step_index
                    )
                    _save(trainer, config)
                    return last
            if config.save:
                _save(trainer, config)
        if is_main:
            metrics_path = os.path.join(config.run_dir, "metrics.jsonl")
            if os.path.exists(metrics_path):
                plot_learning_curve(
                    metrics_path, os.path.join(config.run_dir, "learning_curve.png")
                )
        return last
    finally:
        trainer.close()


def _save(trainer: Trainer, config: TrainConfig) -> None:
    if not config.save:
        return
    save_training_state(
        config.save,
        trainer.step_index,
        model=trainer.model,
        optimizer=trainer.optimizer,
        rl_state=trainer.state_dict(),
    )
