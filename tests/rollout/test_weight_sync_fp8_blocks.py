"""``fp8_blocks``: what a sync sends is block-FP8, through the real transports' code paths
(the servers' calls recorded), and loads through SGLang's flattened-bucket loader and
``block_quant_dequant`` (compiled from the pinned source) to within e4m3 of the weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_sglang_contract_block_fp8 import sglang_dequant
from test_sglang_contract_flat_bucket import _load_like_sglang
from test_sglang_contract_payload import _RecordingPool

from megatron_rl.rollout.engine_config import EngineConfig
from megatron_rl.rollout.weight_sync import WeightSync, WeightSyncConfig

Q = "model.layers.0.self_attn.q_proj.weight"
NORM = "model.layers.0.input_layernorm.weight"


def stream():
    generator = torch.Generator().manual_seed(3)
    return [(Q, torch.randn(200, 136, generator=generator)), (NORM, torch.ones(136))]


def check(named: dict[str, torch.Tensor]) -> None:
    weights = dict(stream())
    assert named[Q].dtype == torch.float8_e4m3fn and named[Q + "_scale_inv"].shape == (2, 2)
    assert torch.equal(named[NORM], weights[NORM])
    deq = sglang_dequant()(named[Q], named[Q + "_scale_inv"], [128, 128], torch.float32)
    assert float((deq - weights[Q]).abs().max()) <= float(weights[Q].abs().max()) / 16


def test_the_tensor_transport_sends_block_fp8_that_sglang_loads():
    entries = []
    pool = _RecordingPool(
        ["http://a:1"],
        lambda url, path, payload: (
            path == "/update_weights_from_tensor"
            and entries.extend(_load_like_sglang(payload["serialized_named_tensors"][0]))
        ),
    )
    sync = WeightSync(pool, WeightSyncConfig(transport="tensor", fp8_blocks=True))
    pool.version = "1"
    sync.sync(iter(stream()), 1)
    sync.close()
    check(dict(entries))


def test_the_disk_transport_writes_block_fp8_and_its_quantization_config(tmp_path):
    from transformers import Qwen3MoeConfig

    pool = _RecordingPool(["http://a:1"])
    config = WeightSyncConfig(transport="disk", disk_dir=str(tmp_path), fp8_blocks=True)
    sync = WeightSync(pool, config, Qwen3MoeConfig(num_hidden_layers=1))
    pool.version = "1"
    sync.sync(iter(stream()), 1)
    sync.close()
    folder = tmp_path / "weights-v1"
    named = {}
    for shard in folder.glob("*.safetensors"):
        named.update(load_file(shard))
    check(named)
    quant = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert quant == {"quant_method": "fp8", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128]}  # fmt: skip


def test_a_nan_weight_fails_the_sync_naming_it():
    from megatron_rl.rollout.weight_sync import WeightSyncError

    pool = _RecordingPool(["http://a:1"])
    sync = WeightSync(pool, WeightSyncConfig(transport="tensor", fp8_blocks=True))
    bad = [(Q, torch.full((4, 4), float("nan")))]
    with pytest.raises(WeightSyncError, match="q_proj"):
        sync.sync(iter(bad), 1)
    sync.close()


def test_fp8_blocks_is_refused_with_the_in_process_engine():
    with pytest.raises(ValueError, match="weight_sync_fp8_blocks"):
        EngineConfig(weight_sync_fp8_blocks=True)
    assert EngineConfig(kind="sglang", sglang_url=("http://a:1",), weight_sync_fp8_blocks=True)
