"""How this rank takes part in a weight sync, chosen once at start-up (`build_weight_publisher`).

Every rank holds a shard of the policy; a sync turns the shards into one stream of HF-named
tensors and delivers it to the engine. Which part a rank plays depends on the engine and the
layout, and never changes during a run:

=====================  ==========================================================================
publisher              the rank and the layout
=====================  ==========================================================================
`EnginePush`           the rank that owns the engine (rank 0 for servers; each generator rank
                       for its in-process engine): gathers every stage's tensors and pushes them
`GatherOnly`           the other ranks: take part in the gathers (collectives), keep nothing
`StagePush`            rank 0, SGLang over the distributed transport with PP > 1 and per-stage
                       senders: sends stage 0's tensors and drives the other stages' senders
`StageServe`           the first rank of a later stage: broadcasts its stage's own tensors
`StageGatherOnly`      the other ranks of that layout
`ColocatedPush`        rank 0, ``--colocate``: every rank hands the servers its own GPU's copy
`ColocatedServe`       the other ranks, ``--colocate``: serve their copies' handles
`AdapterPush`          rank 0, ``--lora-sync adapter``: gathers the LoRA adapters (PEFT names)
                       and loads them on the servers as the version's SGLang adapter
`AdapterGatherOnly`    the other ranks, ``--lora-sync adapter``: take part in the gathers
=====================  ==========================================================================

The generic `RolloutEngine.update_weights(stream, version=)` is all `EnginePush` needs; the
per-stage and colocated publishers need the SGLang client's transports (``stages=``,
``peers=``), so they hold an `SGLangEngine` by type: a configuration that reaches them with any
other engine is refused when the publisher is built.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from megatron_rl.model.conversion import iter_hf_tensors, iter_hf_tensors_every_stage
from megatron_rl.rollout.protocol import RolloutEngine


class WeightPublisher(Protocol):
    def publish(self, version: int) -> None:
        """Take this rank's part in syncing the current weights as ``version`` (a collective)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class PolicyShard:
    """The local model (megatron's module, unwrapped) and its HF config: the stream's source."""

    module: torch.nn.Module
    hf_config: object

    def every_stage(self, wanted: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """Every stage's tensors, gathered (to this rank when ``wanted``; a collective)."""
        return iter_hf_tensors_every_stage(
            self.module, self.hf_config, wanted=wanted, experts_last=True
        )

    def own_stage(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This stage's tensors (gathered over its tensor/expert shards; a collective)."""
        return iter_hf_tensors(self.module, self.hf_config, experts_last=True)


@dataclass
class EnginePush:
    shard: PolicyShard
    engine: RolloutEngine

    def publish(self, version: int) -> None:
        self.engine.update_weights(self.shard.every_stage(wanted=True), version=version)

    def close(self) -> None:
        pass


@dataclass
class GatherOnly:
    shard: PolicyShard

    def publish(self, version: int) -> None:
        for _ in self.shard.every_stage(wanted=False):  # the gathers are collectives
            pass

    def close(self) -> None:
        pass


@dataclass
class StagePush:
    shard: PolicyShard
    engine: object  # SGLangEngine
    stages: list  # weight_sync.stages.RemoteStage, one per later stage

    def publish(self, version: int) -> None:
        self.engine.update_weights(self.shard.own_stage(), version=version, stages=self.stages)

    def close(self) -> None:
        for stage in self.stages:
            stage.close()


@dataclass
class StageServe:
    shard: PolicyShard
    sender: object  # weight_sync.stages.StageSender

    def publish(self, version: int) -> None:
        self.sender.serve(self.shard.own_stage(), version)

    def close(self) -> None:
        self.sender.close()


@dataclass
class StageGatherOnly:
    shard: PolicyShard

    def publish(self, version: int) -> None:
        for _ in self.shard.own_stage():  # the stage's gathers are collectives
            pass

    def close(self) -> None:
        pass


@dataclass
class ColocatedPush:
    shard: PolicyShard
    engine: object  # SGLangEngine
    link: object  # weight_sync.rank_handles.HandleLink

    def publish(self, version: int) -> None:
        stream = self.shard.every_stage(wanted=True)
        self.engine.update_weights(stream, version=version, peers=self.link)

    def close(self) -> None:
        pass


@dataclass
class ColocatedServe:
    shard: PolicyShard
    link: object  # weight_sync.rank_handles.HandleLink

    def publish(self, version: int) -> None:
        from megatron_rl.rollout.weight_sync.rank_handles import serve_handles
        from megatron_rl.rollout.weight_sync.tensor import bucket_object, serializer

        stream = self.shard.every_stage(wanted=True)
        serve_handles(self.link, stream, version, serializer(), bucket_object)

    def close(self) -> None:
        pass


@dataclass
class AdapterPush:
    shard: PolicyShard
    engine: object  # SGLangEngine

    def publish(self, version: int) -> None:
        from megatron_rl.lora.peft_export import peft_adapter

        tensors, config = peft_adapter(
            self.shard.module, self.shard.hf_config, experts_unfused=True
        )
        self.engine.update_weights(tensors.items(), version=version, adapter_config=config)

    def close(self) -> None:
        pass


@dataclass
class AdapterGatherOnly:
    shard: PolicyShard

    def publish(self, version: int) -> None:
        from megatron_rl.lora.peft_export import peft_adapter

        peft_adapter(self.shard.module, self.shard.hf_config, experts_unfused=True)  # collectives

    def close(self) -> None:
        pass


def build_weight_publisher(
    engine_config, shard: PolicyShard, engine: RolloutEngine | None, *, owns_engine: bool,
    pipeline_group=None, timeout_s: float | None = None, adapter_sync: bool = False,
) -> WeightPublisher:  # fmt: skip
    """This rank's publisher (a collective with per-stage senders: their gloo group is made).

    ``engine_config``: the trainer's `EngineConfig` (``remote``, ``colocate``,
    ``per_stage_senders``, ``weight_sync_transport``, ``sglang_url``); ``owns_engine``: this
    rank pushes to ``engine`` (rank 0 for servers, a generator rank for its in-process engine);
    ``pipeline_group``: given when PP > 1; ``timeout_s``: the sync's own timeout, the longest a
    later stage waits for its turn (without it, torch's 30-minute group default);
    ``adapter_sync``: ``--lora-sync adapter`` (the LoRA adapters alone, from rank 0).
    """
    if adapter_sync:  # --lora-sync adapter: SGLang servers, neither colocated nor per stage
        if owns_engine:
            return AdapterPush(shard, _sglang(engine, "--lora-sync adapter"))
        return AdapterGatherOnly(shard)
    if engine_config.colocate:
        from megatron_rl.rollout.weight_sync.rank_handles import HandleLink

        link = HandleLink(_sync_config(engine), len(engine_config.sglang_url))
        return ColocatedPush(shard, engine, link) if owns_engine else ColocatedServe(shard, link)
    staged = (
        engine_config.remote
        and pipeline_group is not None
        and engine_config.per_stage_senders
        and engine_config.weight_sync_transport == "distributed"
    )
    if staged:
        return _stage_publisher(shard, engine, pipeline_group, timeout_s)
    if owns_engine:
        return EnginePush(shard, engine)
    return GatherOnly(shard)


def _stage_publisher(
    shard: PolicyShard, engine, pipeline_group, timeout_s: float | None = None
) -> WeightPublisher:
    """Rank 0: `StagePush`; a later stage's first rank: `StageServe`; others: gather only.
    Collective over the world (the stages' gloo group is made)."""
    from megatron_rl.rollout.weight_sync.stages import RemoteStage, StageLink, StageSender

    link = StageLink.of_pipeline(pipeline_group, timeout_s)
    stage = link.stage_of(dist.get_rank())
    if stage == 0:
        engine = _sglang(engine, "per-stage senders")
        return StagePush(shard, engine, [RemoteStage(link, s) for s in range(1, len(link.ranks))])
    if stage is not None:
        return StageServe(shard, StageSender(link, stage, _sync_config(engine)))
    return StageGatherOnly(shard)


def _sglang(engine, what: str):
    """``engine`` when it is the SGLang client; RuntimeError otherwise (a config that let
    ``what`` reach another engine is a bug: the CLI refuses it at parse time)."""
    from megatron_rl.rollout.sglang_client import SGLangEngine

    if not isinstance(engine, SGLangEngine):
        raise RuntimeError(f"{what} needs the SGLang engine, got {type(engine).__name__}")
    return engine


def _sync_config(engine):
    """The weight-sync settings every rank of a remote engine holds (its client's)."""
    return _sglang(engine, "a remote weight sync").config.sync
