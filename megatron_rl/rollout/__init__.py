"""Rollout bridge: engine protocol, in-process engine, SGLang HTTP client, weight sync.

Names are imported on first use, so that light modules of this package (``launch``, ``serve``,
``http_pool``) start without loading torch or transformers.
"""

from __future__ import annotations

from megatron_rl.lazy_exports import lazy_getattr

_HOMES = {
    "EngineHealth": "megatron_rl.rollout.types",
    "InProcessEngine": "megatron_rl.rollout.inprocess",
    "InProcessEngineConfig": "megatron_rl.rollout.inprocess",
    "RolloutEngine": "megatron_rl.rollout.protocol",
    "RolloutSample": "megatron_rl.rollout.types",
    "SamplingParams": "megatron_rl.rollout.types",
}

__all__ = sorted(_HOMES)


__getattr__ = lazy_getattr("megatron_rl.rollout", _HOMES, globals())
