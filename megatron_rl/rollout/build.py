"""Which rollout engine the trainer drives, from configuration only."""

from __future__ import annotations

import logging
import os

import torch

from megatron_rl.rollout.engine_config import ENGINES, WEIGHT_SYNC_TRANSPORTS, EngineConfig

__all__ = ["ENGINES", "WEIGHT_SYNC_TRANSPORTS", "EngineConfig", "build_engine", "ready_engine"]

logger = logging.getLogger(__name__)


def ready_engine(config: EngineConfig, hf_config, pad_token_id: int, seed: int):
    """`build_engine`, returned once its servers answer (SGLang listens only once its model is
    loaded: the first weight sync must wait for that)."""
    engine = build_engine(config, hf_config, pad_token_id, seed)
    waited = engine.wait_until_ready()
    if waited > 1.0:
        logger.info("rollout servers ready after %.0f s", waited)
    return engine


def build_engine(config: EngineConfig, hf_config, pad_token_id: int, seed: int):
    """The in-process engine (embedded default) or the SGLang client (clusters)."""
    if config.kind == "local":
        from megatron_rl.rollout import InProcessEngine, InProcessEngineConfig

        # --partial-rollout: an update parks running generations at a token boundary and lets
        # them go on under the new weights (in_place keeps their KV cache, retract recomputes it)
        pause_mode = None
        if config.partial_rollout:
            pause_mode = "in_place" if config.sglang_pause_mode == "in_place" else "retract"
        engine_config = InProcessEngineConfig(
            dtype=config.rollout_dtype,
            routing_codec=config.routing_dtype,
            pad_token_id=pad_token_id,
            pause_mode=pause_mode,
            router_noise=config.rollout_router_noise,
            router_noise_seed=seed,
            bf16_matmul=config.rollout_bf16_matmul,
        )
        return InProcessEngine.from_hf_config(hf_config, engine_config, seed=seed)
    from megatron_rl.rollout.http_pool import HttpPoolConfig
    from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig
    from megatron_rl.rollout.weight_sync import ReprobeConfig, WeightSyncConfig

    sync = WeightSyncConfig(
        transport=config.weight_sync_transport,
        disk_dir=config.weight_sync_dir,
        backend="nccl" if torch.cuda.is_available() else "gloo",
        master_address=os.environ.get("MASTER_ADDR", "127.0.0.1"),  # trainer rank 0's node
        engine_ranks=config.sglang_engine_ranks,
        failure_timeout_s=config.weight_sync_failure_timeout,
        pause_mode=config.sglang_pause_mode,
        fp8_blocks=config.weight_sync_fp8_blocks,
    )
    engine_config = SGLangEngineConfig.from_hf_config(
        hf_config,
        http=HttpPoolConfig(
            urls=config.sglang_url,
            request_timeout_s=config.sglang_request_timeout,
            health_timeout_s=config.sglang_health_timeout,
            liveness_interval_s=config.sglang_liveness_interval,
        ),
        routing_codec=config.routing_dtype,
        sync=sync,
        router_url=config.sglang_router_url,
        min_servers=config.sglang_min_servers,
        colocated=config.colocate,
        startup_timeout_s=config.sglang_startup_timeout,
        reprobe=ReprobeConfig(
            interval_s=config.sglang_reprobe_interval,
            max_interval_s=config.sglang_reprobe_max_interval,
        ),
    )
    return SGLangEngine(engine_config)
