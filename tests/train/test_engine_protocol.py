"""`RolloutEngine` is exactly what the trainer calls: both engines satisfy it (methods and
signatures), and a trainer run with either engine uses every protocol method and nothing else."""

from __future__ import annotations

import inspect

import pytest
from trainer_testing import rendezvous, small_config

import megatron_rl.rollout.build as build_module
from megatron_rl.rollout import InProcessEngine, RolloutEngine
from megatron_rl.rollout.build import EngineConfig
from megatron_rl.rollout.sglang_client import SGLangEngine
from megatron_rl.train.task import TaskConfig, build_task
from megatron_rl.train.trainer import Trainer

PROTOCOL = {
    name
    for name, value in vars(RolloutEngine).items()
    if not name.startswith("_") and callable(value)
}


def _fits(method, declared) -> list[str]:
    """What keeps ``method`` from accepting every call ``declared`` accepts (empty: nothing)."""
    have = inspect.signature(method).parameters
    want = inspect.signature(declared).parameters
    problems = []
    for name, parameter in want.items():
        other = have.get(name)
        if other is None or other.kind != parameter.kind or other.default != parameter.default:
            problems.append(f"{name}: {other} for {parameter}")
    extra = [p for n, p in have.items() if n not in want and p.default is inspect.Parameter.empty]
    problems += [f"{p.name}: required, not in the protocol" for p in extra]
    return problems


@pytest.mark.parametrize("engine_class", [InProcessEngine, SGLangEngine])
def test_each_engine_implements_every_protocol_method_with_its_signature(engine_class):
    for name in sorted(PROTOCOL):
        assert callable(getattr(engine_class, name, None)), f"{engine_class.__name__}.{name}"
        problems = _fits(getattr(engine_class, name), getattr(RolloutEngine, name))
        assert not problems, f"{engine_class.__name__}.{name}: {problems}"


def test_engine_instances_are_rollout_engines():
    from megatron_rl.rollout.http_pool import HttpPoolConfig
    from megatron_rl.rollout.sglang_client import SGLangEngineConfig

    hf_config = build_task(TaskConfig()).hf_config
    local = InProcessEngine.from_hf_config(hf_config)
    assert isinstance(local, RolloutEngine)
    assert local.membership_metrics() == {} and local.close() is None
    config = SGLangEngineConfig.from_hf_config(
        hf_config, http=HttpPoolConfig(urls=("http://127.0.0.1:9",))
    )
    with SGLangEngine(config) as remote:
        assert isinstance(remote, RolloutEngine)


def test_only_remote_engines_push_from_rank_zero():
    assert not EngineConfig(kind="local").remote
    assert EngineConfig(kind="sglang", sglang_url=("http://127.0.0.1:9",)).remote


class _Recording:
    """Forwards to ``engine`` and records the name of every attribute the trainer reads."""

    def __init__(self, engine, used: set[str]) -> None:
        self._engine, self._used = engine, used

    def __getattr__(self, name: str):
        self._used.add(name)
        return getattr(self._engine, name)


def _train_recording(config, dist_kwargs: dict, monkeypatch) -> set[str]:
    """Two steps of a trainer whose engine records what is read of it; the names read."""
    used: set[str] = set()
    real = build_module.build_engine  # the trainer builds through `rollout.build.ready_engine`
    monkeypatch.setattr(
        build_module, "build_engine", lambda *a, **k: _Recording(real(*a, **k), used)
    )
    trainer = Trainer(config, **dist_kwargs)
    try:
        trainer.step()
        trainer.step()
    finally:
        trainer.close()
        monkeypatch.setattr(build_module, "build_engine", real)
    return used


@pytest.mark.slow
def test_the_trainer_uses_exactly_the_protocol(tmp_path, monkeypatch):
    """Sync and async steps with the in-process engine, then async steps against the SGLang
    client (the loopback server stands in for SGLang): the engine attributes the trainer reads
    are the protocol's methods, so the protocol declares nothing the trainer does not call."""
    from megatron_rl.testing.loopback_server import LoopbackServer

    config = small_config(tmp_path, train_iters=2)
    local = _train_recording(config, rendezvous(tmp_path, "a"), monkeypatch)
    async_config = config.with_flags(async_rollout=True)
    local_async = _train_recording(async_config, rendezvous(tmp_path, "b"), monkeypatch)
    hf_config = build_task(config.task).hf_config
    server = LoopbackServer(InProcessEngine.from_hf_config(hf_config, seed=99)).start()
    try:
        remote = async_config.with_flags(
            rollout_engine="sglang",
            sglang_url=(server.url,),
            weight_sync_transport="disk",
        )
        sglang = _train_recording(remote, rendezvous(tmp_path, "c"), monkeypatch)
    finally:
        server.stop()
    assert local == local_async == PROTOCOL - {"membership_metrics"}  # remote servers only
    assert sglang == PROTOCOL
