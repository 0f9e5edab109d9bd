"""Weight sync Megatron -> engine over the three transports, with log-prob parity and checksums.

The trainer is a real megatron-core model (world size 1, gloo) loaded from a random HF
checkpoint and then perturbed (a stand-in for a training step); the engine starts on the
checkpoint's weights. After a sync the engine must compute the trainer's log-probs of a fixed
sequence. The distributed transport runs a real gloo process group between the trainer and the
loopback server's receiving thread (the NCCL path is the same code with ``backend="nccl"``).
"""

from __future__ import annotations

import re

import pytest
import torch
from rollout_testing import PROMPTS, make_engine, random_hf_model, tiny_config

from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.http_pool import HttpPoolConfig
from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig
from megatron_rl.rollout.weight_sync import WeightSyncConfig, WeightSyncError

SEQUENCE = [3, 141, 59, 26, 5, 358, 97, 93, 238, 46]
PARITY_ATOL = 1e-5


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.model import build_model
    from megatron_rl.model.conversion import load_checkpoint

    folder = tmp_path_factory.mktemp("trainer")
    init_distributed(ParallelConfig(), init_method=f"file://{folder}/rdzv", device="cpu")
    config = tiny_config()
    random_hf_model(config, seed=0).save_pretrained(folder / "hf")
    model = build_model(config)
    load_checkpoint(model, folder / "hf", config)
    model.eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    yield model, config
    destroy_distributed()


def megatron_logprobs(model, token_ids) -> torch.Tensor:
    from megatron_rl.model import causal_lm_logits

    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = causal_lm_logits(model, ids)[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(-1, ids[0, 1:, None]).squeeze(-1)


def hf_stream(trainer):
    from megatron_rl.model.conversion import iter_hf_tensors

    model, config = trainer
    return iter_hf_tensors(model, config)


def client_for(server, config, **sync) -> SGLangEngine:
    sync = {"bucket_bytes": 64 * 1024, **sync}
    engine_config = SGLangEngineConfig.from_hf_config(
        config,
        http=HttpPoolConfig(urls=(server.url,), request_timeout_s=60.0, backoff_s=0.01),
        sync=WeightSyncConfig(**sync),
    )
    return SGLangEngine(engine_config, hf_config=config)


def test_in_process_update_from_megatron_matches_megatron_logprobs(trainer):
    engine = make_engine(seed=0)
    want = megatron_logprobs(trainer[0], SEQUENCE)
    before = (engine.score(SEQUENCE) - want).abs().max().item()
    engine.update_weights(hf_stream(trainer), version=1)
    gap = (engine.score(SEQUENCE) - want).abs().max().item()
    print(f"fp32 in-process: max |logprob gap| before sync {before:.3e}, after {gap:.3e}")
    assert before > 1e-2, "the perturbation must be visible before the sync"
    assert gap < PARITY_ATOL
    assert engine.generate(PROMPTS, SamplingParams(max_new_tokens=2))[0].weight_version == 1


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["disk", "tensor", "distributed"])
def test_transport_syncs_versions_and_matches_megatron(trainer, servers, tmp_path, transport):
    engine = make_engine(seed=0)
    (server,) = servers(1, engine=engine)
    want = megatron_logprobs(trainer[0], SEQUENCE)
    with client_for(server, trainer[1], transport=transport, disk_dir=str(tmp_path),
                    checksum=True) as client:  # fmt: skip
        for version in (1, 2):
            client.update_weights(hf_stream(trainer), version=version)
            report = client.last_sync
            assert client.weight_version == version == engine.weight_version
            assert client.health().weight_version == version
        samples = client.generate(PROMPTS, SamplingParams(max_new_tokens=2, seed=1))
        assert {s.weight_version for s in samples} == {2}
        gap = (client.score(SEQUENCE) - want).abs().max().item()
    print(f"{transport}: {report.num_tensors} tensors in {report.num_buckets} buckets, "
          f"{report.mb_per_s:.1f} MB/s, max |logprob gap| {gap:.3e}")  # fmt: skip
    assert report.num_buckets > 1 and report.checksums_compared == report.num_tensors
    assert gap < PARITY_ATOL
    assert "/pause_generation" in server.requests and "/continue_generation" in server.requests


def test_bf16_engine_gap_after_sync(trainer, servers):
    engine = make_engine(seed=0, dtype="bfloat16")
    (server,) = servers(1, engine=engine)
    with client_for(server, trainer[1], transport="tensor") as client:
        client.update_weights(hf_stream(trainer), version=1)
        gap = (client.score(SEQUENCE) - megatron_logprobs(trainer[0], SEQUENCE)).abs()
    print(f"bf16 rollout engine vs fp32 Megatron: max |logprob gap| {gap.max():.3e}, "
          f"mean {gap.mean():.3e}")  # fmt: skip
    assert 1e-5 < gap.max().item() < 0.5


def test_failed_sync_keeps_the_old_version_and_resumes_generation(trainer, servers):
    engine = make_engine(seed=0)
    (server,) = servers(1, engine=engine)
    seen = []

    def fail_second_bucket(path, payload):
        if path == "/update_weights_from_tensor":
            seen.append(path)
            return "503" if len(seen) == 2 else None
        return None

    server.before_request = fail_second_bucket
    with client_for(server, trainer[1], transport="tensor") as client:
        with pytest.raises(WeightSyncError, match=r"version 1 over 'tensor' failed"):
            client.update_weights(hf_stream(trainer), version=1)
        assert engine.weight_version == 0 and client.health().weight_version == 0
        assert client.weight_version == 0
        samples = client.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
        assert samples[0].weight_version == 0


def test_a_bad_tensor_fails_the_sync_on_disk(trainer, servers, tmp_path):
    engine = make_engine(seed=0)
    (server,) = servers(1, engine=engine)
    bad = "model.layers.0.mlp.gate.weight"
    stream = [(n, torch.zeros(3, 3) if n == bad else t) for n, t in hf_stream(trainer)]
    with (
        client_for(server, trainer[1], transport="disk", disk_dir=str(tmp_path)) as client,
        pytest.raises(WeightSyncError, match="shape"),
    ):
        client.update_weights(iter(stream), version=1)
    assert engine.weight_version == 0


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["disk", "tensor", "distributed"])
def test_nan_is_refused_by_the_sender_before_it_reaches_a_server(
    trainer, servers, tmp_path, transport
):
    """Servers do not check (SGLang does not); the sender's one check per bucket names the
    tensor, and no bucket holding it is sent."""
    engine = make_engine(seed=0)
    (server,) = servers(1, engine=engine)
    bad = "model.layers.1.self_attn.o_proj.weight"
    stream = [(n, t.clone().fill_(float("nan")) if n == bad else t) for n, t in hf_stream(trainer)]
    with (
        client_for(server, trainer[1], transport=transport, disk_dir=str(tmp_path)) as client,
        pytest.raises(WeightSyncError, match=rf"{re.escape(bad)}.*NaN or Inf"),
    ):
        client.update_weights(iter(stream), version=1)
    assert engine.weight_version == 0
    params = dict(engine.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    assert not list(tmp_path.glob("weights-v1*"))


def test_disk_keeps_the_serving_version_and_the_new_one_only(trainer, servers, tmp_path):
    engine = make_engine(seed=0)
    (server,) = servers(1, engine=engine)
    with client_for(server, trainer[1], transport="disk", disk_dir=str(tmp_path)) as client:
        for version in (1, 2, 3):
            client.update_weights(hf_stream(trainer), version=version)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights-v2", "weights-v3"]
    assert engine.weight_version == 3


def test_checksum_mismatch_is_detected(trainer, servers):
    engine = make_engine(seed=0)
    (server,) = servers(1, engine=engine)
    original = server.handle

    def corrupt(path, payload):
        status, body = original(path, payload)
        if path == "/weights_checksum":
            body["model.norm.weight"] += 1.0
        return status, body

    server.handle = corrupt
    with (
        client_for(server, trainer[1], transport="tensor", checksum=True) as client,
        pytest.raises(WeightSyncError, match=r"checksum of 'model\.norm\.weight'"),
    ):
        client.update_weights(hf_stream(trainer), version=1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"transport": "nfs"}, "transport"),
        ({"transport": "disk"}, "disk_dir"),
        ({"bucket_bytes": 0}, "bucket_bytes"),
        ({"failure_timeout_s": 0}, "failure_timeout_s"),
    ],
)
def test_bad_sync_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WeightSyncConfig(**kwargs)


def test_experts_last_sends_every_tensor_once_with_the_experts_after_the_rest(trainer):
    """``experts_last`` (what weight sync streams): the same tensors as one pass, every
    non-expert tensor before the first expert tensor, so no bucket mixes the two."""
    from megatron_rl.model.conversion import iter_hf_tensors

    model, config = trainer
    one_pass = {name: t.clone() for name, t in iter_hf_tensors(model, config)}
    names = []
    for name, tensor in iter_hf_tensors(model, config, experts_last=True):
        assert torch.equal(tensor, one_pass[name]), name
        names.append(name)
    assert sorted(names) == sorted(one_pass)
    is_expert = [".mlp.experts." in n for n in names]
    assert any(is_expert) and is_expert == sorted(is_expert)  # False..., then True...
