"""`build_weight_publisher`: each rank's part in a weight sync is chosen once, from the config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch


def _engine_config(**overrides):
    base = dict(
        remote=False, colocate=False, per_stage_senders=True,
        weight_sync_transport="distributed", sglang_url=(),
    )  # fmt: skip
    return SimpleNamespace(**{**base, **overrides})


class _RecordingEngine:
    def __init__(self):
        self.pushed = []

    def update_weights(self, named_tensors, *, version):
        self.pushed.append((version, {name: t.clone() for name, t in named_tensors}))


@pytest.fixture
def shard(ws1):
    from megatron_rl.model import build_model, preset_config
    from megatron_rl.train.weight_publisher import PolicyShard

    cfg = preset_config("tiny")
    return PolicyShard(build_model(cfg), cfg)


def test_the_engine_owner_pushes_every_tensor_and_the_others_only_gather(shard):
    from megatron_rl.model.conversion import iter_hf_tensors
    from megatron_rl.train.weight_publisher import EnginePush, GatherOnly, build_weight_publisher

    engine = _RecordingEngine()
    owner = build_weight_publisher(_engine_config(), shard, engine, owns_engine=True)
    other = build_weight_publisher(_engine_config(), shard, engine, owns_engine=False)
    assert isinstance(owner, EnginePush) and isinstance(other, GatherOnly)
    owner.publish(3)
    other.publish(4)  # takes part in the gathers, pushes nothing
    assert [version for version, _ in engine.pushed] == [3]
    want = dict(iter_hf_tensors(shard.module, shard.hf_config))
    got = engine.pushed[0][1]
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    names = list(got)  # experts come last, as every transport expects
    first_expert = next(i for i, n in enumerate(names) if ".experts." in n)
    assert all(".experts." in n for n in names[first_expert:])


def test_colocated_and_per_stage_publishers_refuse_an_engine_that_is_not_sglang(shard):
    from megatron_rl.train.weight_publisher import _stage_publisher, build_weight_publisher

    colocated = _engine_config(remote=True, colocate=True, sglang_url=("http://a:1",))
    with pytest.raises(RuntimeError, match="needs the SGLang engine, got _RecordingEngine"):
        build_weight_publisher(colocated, shard, _RecordingEngine(), owns_engine=True)
    group = torch.distributed.new_group([0])
    with pytest.raises(RuntimeError, match="per-stage senders needs the SGLang engine"):
        _stage_publisher(shard, _RecordingEngine(), group)
