"""`sglang_payload.decode_generate` on all-layer routed experts: what it rejects, and why."""

from __future__ import annotations

import base64

import pytest
import torch

from megatron_rl.rollout.sglang_payload import decode_generate
from megatron_rl.routing import RoutingCodec

PATTERN = (0, 1, 0, 1)  # dense, MoE, dense, MoE


def _body(all_TLK: torch.Tensor | object, num_out: int = 2) -> dict:
    encoded = (
        base64.b64encode(all_TLK.to(torch.int32).numpy().tobytes()).decode()
        if isinstance(all_TLK, torch.Tensor)
        else all_TLK
    )
    return {
        "output_ids": list(range(10, 10 + num_out)),
        "meta_info": {
            "finish_reason": {"type": "length"},
            "weight_version": "0",
            "output_token_logprobs": [[-1.0, 10 + k, None] for k in range(num_out)],
            "routed_experts": encoded,
        },
    }


def _routes(positions: int = 4) -> torch.Tensor:
    all_TLK = torch.zeros(positions, len(PATTERN), 2, dtype=torch.int32)
    all_TLK[:, 1] = torch.tensor([0, 3])
    all_TLK[:, 3] = torch.tensor([5, 1])
    return all_TLK


def _decode(body):
    return decode_generate(body, prompt=[1, 2, 3], prompt_index=0, sample_index=2,
                           codec=RoutingCodec(8, 2), layer_pattern=PATTERN)  # fmt: skip


def test_moe_layers_are_kept_and_dense_layers_dropped():
    sample = _decode(_body(_routes()))
    assert sample.routes.num_layers == 2
    assert RoutingCodec(8, 2).decode(sample.routes)[0].tolist() == [[0, 3], [5, 1]]


def test_routes_in_a_dense_layer_mean_another_layer_layout():
    routes = _routes()
    routes[2, 2] = torch.tensor([4, 6])
    with pytest.raises(RuntimeError, match=r"sample 2.*position 2 of layer 2, a dense layer"):
        _decode(_body(routes))


def test_uncaptured_all_zero_rows_fail_the_sample():
    routes = _routes()
    routes[:2, 3] = 0  # e.g. prefix-cache slots SGLang never captured
    with pytest.raises(RuntimeError, match=r"2 position\(s\) \(first \[0, 1\]\).*all zeros"):
        _decode(_body(routes))


def test_moe_layer_count_instead_of_all_layers_is_a_row_count_error():
    with pytest.raises(RuntimeError, match=r"expected 4 rows"):
        _decode(_body(_routes()[:, [1, 3]]))


@pytest.mark.parametrize(
    "value,match", [(None, "routed_experts missing"), ([[0, 1]], "list, not a base64 string")]
)
def test_missing_or_unencoded_routes_name_the_sglang_version(value, match):
    with pytest.raises(RuntimeError, match=match):
        _decode(_body(value))


def test_engine_config_takes_the_hf_layer_pattern():
    from rollout_testing import tiny_config

    from megatron_rl.rollout.http_pool import HttpPoolConfig
    from megatron_rl.rollout.sglang_client import SGLangEngineConfig

    config = SGLangEngineConfig.from_hf_config(
        tiny_config(num_hidden_layers=4, mlp_only_layers=[0, 2]),
        http=HttpPoolConfig(urls=("http://127.0.0.1:1",)),
    )
    assert config.layer_pattern == PATTERN and config.num_moe_layers == 2
    with pytest.raises(ValueError, match="layer_pattern"):
        SGLangEngineConfig(http=config.http, num_experts=8, topk=2, layer_pattern=(0, 0))


def test_a_sample_spanning_an_update_keeps_its_segments_and_oldest_version():
    """SGLang >= 0.5.19 reports ``weight_versions`` spans (``srt/utils/weight_versions.py``)
    and overwrites ``weight_version`` with the last one; the sample's version is the oldest."""
    body = _body(_routes(), num_out=2)
    body["meta_info"]["weight_version"] = "4"
    body["meta_info"]["weight_versions"] = [
        {"version": "3", "start": 0, "end": 1},
        {"version": "4", "start": 1, "end": 2},
    ]
    sample = _decode(body)
    assert sample.weight_version == 3 and sample.weight_versions == ((3, 0, 1), (4, 1, 2))
    body["meta_info"]["weight_versions"] = [{"version": "3", "start": 0, "end": 1}]
    with pytest.raises(RuntimeError, match="do not cover its 2 response tokens"):
        _decode(body)
    del body["meta_info"]["weight_versions"]
    assert _decode(body).weight_versions == ()
