"""Rollout bridge: engine protocol, in-process engine, SGLang HTTP client, weight sync."""

from megatron_rl.rollout.inprocess import InProcessEngine, InProcessEngineConfig
from megatron_rl.rollout.protocol import RolloutEngine
from megatron_rl.rollout.types import EngineHealth, RolloutSample, SamplingParams

__all__ = [
    "EngineHealth",
    "InProcessEngine",
    "InProcessEngineConfig",
    "RolloutEngine",
    "RolloutSample",
    "SamplingParams",
]
