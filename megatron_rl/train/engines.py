"""Which rollout engine the trainer drives, from configuration only."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

ENGINES = ("local", "sglang")
WEIGHT_SYNC_TRANSPORTS = ("distributed", "tensor", "disk")


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """The rollout engine (built by `TrainConfig.engine_config`)."""

    kind: str = "local"  # "local": the in-process engine; "sglang": SGLang servers over HTTP
    rollout_dtype: str = "float32"  # the in-process engine's compute dtype
    routing_dtype: str = "auto"  # codec of the routes the engine returns (R3)
    sglang_url: tuple[str, ...] = ()
    weight_sync_transport: str = "distributed"
    weight_sync_dir: str = "runs/latest/weight_sync"  # the disk transport's folder
    sglang_engine_ranks: int = 1  # GPUs (TP ranks) of each SGLang server
    sglang_request_timeout: float | None = None  # read timeout of one request; None: none
    sglang_router_url: str | None = None  # generation through sglang-router (workers: control)
    sglang_min_servers: int = 1  # fewer live servers than this stops the run
    sglang_startup_timeout: float = 3600.0  # waiting for the servers' /health at start

    def __post_init__(self) -> None:
        if self.kind not in ENGINES:
            raise ValueError(f"EngineConfig.kind={self.kind!r}: choose one of {ENGINES}")
        if self.weight_sync_transport not in WEIGHT_SYNC_TRANSPORTS:
            raise ValueError(
                f"EngineConfig.weight_sync_transport={self.weight_sync_transport!r}: choose one "
                f"of {WEIGHT_SYNC_TRANSPORTS}"
            )
        if self.kind == "sglang" and not self.sglang_url:
            raise ValueError("EngineConfig: kind='sglang' needs at least one sglang_url")


def build_engine(config: EngineConfig, hf_config, pad_token_id: int, seed: int):
    """The in-process engine (embedded default) or the SGLang client (clusters)."""
    if config.kind == "local":
        from megatron_rl.rollout import InProcessEngine, InProcessEngineConfig

        engine_config = InProcessEngineConfig(
            dtype=config.rollout_dtype,
            routing_codec=config.routing_dtype,
            pad_token_id=pad_token_id,
        )
        return InProcessEngine.from_hf_config(hf_config, engine_config, seed=seed)
    from megatron_rl.rollout.http_pool import HttpPoolConfig
    from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig
    from megatron_rl.rollout.weight_sync import WeightSyncConfig

    sync = WeightSyncConfig(
        transport=config.weight_sync_transport,
        disk_dir=config.weight_sync_dir,
        backend="nccl" if torch.cuda.is_available() else "gloo",
        master_address=os.environ.get("MASTER_ADDR", "127.0.0.1"),  # trainer rank 0's node
        engine_ranks=config.sglang_engine_ranks,
    )
    engine_config = SGLangEngineConfig.from_hf_config(
        hf_config,
        http=HttpPoolConfig(
            urls=config.sglang_url, request_timeout_s=config.sglang_request_timeout
        ),
        routing_codec=config.routing_dtype,
        sync=sync,
        router_url=config.sglang_router_url,
        min_servers=config.sglang_min_servers,
        startup_timeout_s=config.sglang_startup_timeout,
    )
    return SGLangEngine(engine_config)
