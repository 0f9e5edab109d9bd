"""The RL trainer: configuration, the step, the run loop (``python -m megatron_rl.train``)."""

from megatron_rl.train.config import TrainConfig, parse_args

__all__ = ["TrainConfig", "parse_args"]
