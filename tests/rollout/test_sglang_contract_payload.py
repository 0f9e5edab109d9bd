"""What the client sends and decodes, checked against the pinned SGLang's own source (no import).

`sglang_source` reads ``sglang/srt`` from the installed package: request fields against
``GenerateReqInput`` / ``SamplingParams`` / the weight-update request classes, and routed experts
built by SGLang's own capture buffer (``BaseDeviceCache``) and encoder
(``DetokenizerManager._b64_encode_per_request``) for a model with dense layers.
"""

from __future__ import annotations

import ast
import base64
import logging
from typing import Optional

import pytest
import torch
from sglang_source import class_node, dataclass_fields, load_class, sglang_path

from megatron_rl.moe_layers import moe_layer_pattern
from megatron_rl.rollout.http_pool import HttpPool, HttpPoolConfig
from megatron_rl.rollout.sglang_payload import decode_generate, generate_request
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.weight_sync import WeightSync, WeightSyncConfig, WeightSyncError
from megatron_rl.rollout.weight_sync import tensor as tensor_transport
from megatron_rl.rollout.weight_sync.distributed import DistributedTransport
from megatron_rl.routing import RoutingCodec

IO_STRUCT = "srt/managers/io_struct.py"


def _sampling_params_args() -> set[str]:
    """``SamplingParams.__init__``'s arguments, or its fields where it is a struct (0.5.23)."""
    node = class_node("srt/sampling/sampling_params.py", "SamplingParams")
    init = next(
        (n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None
    )
    if init is None:
        return set(dataclass_fields("srt/sampling/sampling_params.py", "SamplingParams"))
    return {a.arg for a in [*init.args.args, *init.args.kwonlyargs]} - {"self"}


# ---------------------------------------------------------------------------- /generate
def test_generate_request_fields_are_sglang_fields():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=8, seed=5,
                            stop_token_ids=(2,))  # fmt: skip
    payload = generate_request(
        [1, 2, 3], params, prompt_index=0, sample_index=1, rid="r-0", return_routed_experts=True
    )
    assert set(payload) <= set(dataclass_fields(IO_STRUCT, "GenerateReqInput"))
    assert set(payload["sampling_params"]) <= _sampling_params_args()


# ---------------------------------------------------------------------------- weight updates
class _RecordingPool(HttpPool):
    """The real `HttpPool` (membership included) whose control calls are recorded and answered
    with success instead of going over HTTP."""

    def __init__(self, urls, on_call=None):
        super().__init__(HttpPoolConfig(urls=tuple(urls)))
        self.calls: list[tuple[str, str, object]] = []
        self.on_call = on_call

    def call_on(self, url, method, path, payload, *, timeout_s=None):
        self.calls.append((url, path, payload))
        if self.on_call is not None:
            self.on_call(url, path, payload)
        if path == "/model_info":
            return {"weight_version": self.version}
        return {"success": True, "message": "ok"}

    def flush_cache(self, url, timeout_s=None):
        self.calls.append((url, "/flush_cache", None))

    def probe_all(self, urls=None):
        return list(self.config.urls if urls is None else urls)


REQUEST_CLASS = {
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
}


def _sync(pool, monkeypatch, **config):
    sync = WeightSync(pool, WeightSyncConfig(bucket_bytes=64, **config))
    pool.version = "7"
    if config.get("transport") == "distributed":  # group creation is another test's concern
        group = sync.transport.groups[0]  # stage 0's
        group.local, group.name, group.urls = object(), "group", tuple(pool.members())
        monkeypatch.setattr(DistributedTransport, "_broadcast", lambda self, *args: None)
    tensors = [(f"w{i}", torch.full((4, 4), float(i))) for i in range(3)]
    sync.sync(iter(tensors), 7)
    return sync


@pytest.mark.parametrize(
    "config",
    [
        {"transport": "tensor", "engine_ranks": 2},
        {"transport": "distributed"},
        {"transport": "disk"},
    ],
)
def test_weight_update_bodies_are_sglang_request_fields(config, monkeypatch, tmp_path):
    if config["transport"] == "disk":
        config = {**config, "disk_dir": str(tmp_path)}
    pool = _RecordingPool(["http://a:1", "http://b:2"])
    _sync(pool, monkeypatch, **config).close()
    checked = 0
    for _, path, payload in pool.calls:
        if path in REQUEST_CLASS:
            assert set(payload) <= set(dataclass_fields(IO_STRUCT, REQUEST_CLASS[path])), path
            checked += 1
    assert checked >= 4
    # SGLang 0.5.23 loads tensor and distributed updates only inside a session
    for url in pool.config.urls:
        paths = [path for u, path, _ in pool.calls if u == url]
        updates = [i for i, p in enumerate(paths) if p.startswith("/update_weights_from")]
        if config["transport"] == "disk":
            assert "/begin_weight_update" not in paths
            continue
        begin, end = paths.index("/begin_weight_update"), paths.index("/end_weight_update")
        assert begin < min(updates) and max(updates) < end < paths.index("/update_weight_version")


def test_tensor_transport_serialises_one_entry_per_rank_and_keeps_tensors_alive(monkeypatch):
    """SGLang's producer (``srt/weight_sync/utils.py``) patches torch's reductions, then calls
    ``MultiprocessingSerializer.serialize`` once per TP rank; each rank deserialises its own
    entry (``tp_worker.deserialize_own_rank``). The flat bucket must outlive every HTTP call."""
    serialized: list[dict] = []
    original = tensor_transport._serialize_shared

    def record(obj):
        serialized.append(obj)
        return original(obj)

    monkeypatch.setattr(tensor_transport, "_serialize_shared", record)
    alive_during_call = []

    def on_call(url, path, payload):
        if path == "/update_weights_from_tensor":
            flat = serialized[-1]["flattened_tensor"]
            alive_during_call.append(flat.numel() == 64 and flat.view(torch.float32)[0] >= 0)

    pool = _RecordingPool(["http://a:1", "http://b:2"], on_call)
    _sync(pool, monkeypatch, transport="tensor", engine_ranks=2)
    bodies = [p for _, path, p in pool.calls if path == "/update_weights_from_tensor"]
    assert len(bodies) == 3 * 2  # 3 buckets (64-byte buckets of 64-byte tensors) x 2 servers
    assert all(b["load_format"] == "flattened_bucket" for b in bodies)
    entries = [e for body in bodies for e in body["serialized_named_tensors"]]
    assert all(len(b["serialized_named_tensors"]) == 2 for b in bodies)
    assert len(serialized) == 12  # one serialisation per entry: each carries its own refcount
    assert all(alive_during_call) and len(alive_during_call) == 6
    assert max(len(e) for e in entries) < 2000  # a handle, not the tensor's bytes


def test_sglang_producer_patches_reductions_before_serialising():
    """What `weight_sync.tensor._sglang_serialize` mirrors: SGLang's own producer code."""
    text = sglang_path("srt/weight_sync/utils.py").read_text(encoding="utf-8")
    assert text.index("monkey_patch_torch_reductions()") < text.index(
        "MultiprocessingSerializer.serialize("
    )
    assert "for _ in range(infer_tp_size)" in text
    worker = sglang_path("srt/managers/tp_worker.py").read_text(encoding="utf-8")
    assert "serialized_named_tensors[get_parallel().tp_rank]" in worker


def test_checksum_mode_fails_clearly_against_sglang(servers):
    from megatron_rl.rollout.http_pool import HttpPool, HttpPoolConfig

    (server,) = servers(1)
    original = server.handle
    server.handle = lambda path, payload: (
        (404, {"detail": "Not Found"}) if path == "/weights_checksum" else original(path, payload)
    )
    sync = WeightSync(
        HttpPool(HttpPoolConfig(urls=(server.url,))),
        WeightSyncConfig(transport="tensor", checksum=True),
    )
    embedding = server.engine.model.get_input_embeddings().weight.detach().clone()
    named = [("model.embed_tokens.weight", embedding)]
    with pytest.raises(WeightSyncError, match="no /weights_checksum"):
        sync.sync(iter(named), server.engine.weight_version)
    sync.close()


# ---------------------------------------------------------------------------- routed experts
def _sglang_routed_experts(routes_by_moe_layer: torch.Tensor, pattern: list[int]) -> str:
    """Routes as SGLang 0.5.23 returns them: its device buffer sized by num_hidden_layers,
    written by ``capture`` for MoE layers only, read back ``[:T, :, :topk]``, encoded by the
    detokenizer's own base64 function."""
    capturer = class_node("srt/state_capturer/routed_experts.py", "RoutedExpertsCapturer")
    init = next(n for n in capturer.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert "num_layers = model_config.hf_text_config.num_hidden_layers" in ast.unparse(init)
    device_cache = load_class(
        "srt/state_capturer/base.py",
        "BaseDeviceCache",
        {"torch": torch, "logger": logging.getLogger("sglang"), "_MB": 1 << 20,
         "get_tensor_size_bytes": lambda t: t.numel() * t.element_size()},
    )  # fmt: skip
    tokens, _, topk = routes_by_moe_layer.shape
    cache = device_cache(tokens + 4, len(pattern), topk, "cpu", "routed_experts")
    moe_layers = [i for i, sparse in enumerate(pattern) if sparse]
    for j, layer_id in enumerate(moe_layers):
        cache.capture(layer_id, routes_by_moe_layer[:, j].to(torch.int32))
    rows = cache.buffer[:tokens, :, :topk].clone()
    detok = class_node("srt/managers/detokenizer_manager.py", "DetokenizerManager")
    encode_node = next(
        n
        for n in detok.body
        if isinstance(n, ast.FunctionDef) and n.name == "_b64_encode_per_request"
    )
    encode_node.decorator_list = []
    scope = {"pybase64": base64, "Optional": Optional, "List": list, "torch": torch}
    module = ast.Module(body=[encode_node], type_ignores=[])
    exec(compile(module, "detokenizer_manager.py", "exec"), scope)
    (encoded,) = scope["_b64_encode_per_request"]([rows])
    return encoded


def _hf_config_with_dense_layers():
    from rollout_testing import tiny_config

    return tiny_config(num_hidden_layers=4, mlp_only_layers=[0, 2])


def test_routed_experts_of_all_layers_decode_to_the_moe_layers():
    config = _hf_config_with_dense_layers()
    pattern = moe_layer_pattern(config)
    assert pattern == [0, 1, 0, 1]
    prompt, output = [4, 5, 6], [7, 8]
    positions, topk = len(prompt) + len(output) - 1, config.num_experts_per_tok
    generator = torch.Generator().manual_seed(0)
    want = torch.stack(
        [
            torch.randperm(config.num_experts, generator=generator)[:topk]
            for _ in range(positions * 2)
        ]
    ).view(positions, 2, topk)
    body = {
        "output_ids": output,
        "meta_info": {
            "finish_reason": {"type": "length"},
            "weight_version": "1",
            "output_token_logprobs": [[-0.5, t, None] for t in output],
            "routed_experts": _sglang_routed_experts(want, pattern),
        },
    }
    codec = RoutingCodec(config.num_experts, topk)
    sample = decode_generate(body, prompt=prompt, prompt_index=0, sample_index=0, codec=codec,
                             layer_pattern=pattern)  # fmt: skip
    assert sample.routes.num_layers == 2 and sample.routes.num_tokens == positions
    assert torch.equal(codec.decode(sample.routes), want)


def test_loopback_server_returns_routes_of_all_layers_like_sglang(servers):
    from rollout_testing import make_engine

    from megatron_rl.rollout.http_pool import HttpPool, HttpPoolConfig

    engine = make_engine(model_overrides={"num_hidden_layers": 4, "mlp_only_layers": [0, 2]})
    (server,) = servers(1, engine=engine)
    pool = HttpPool(HttpPoolConfig(urls=(server.url,)))
    prompt = [5, 17, 33]
    payload = generate_request(prompt, SamplingParams(max_new_tokens=3, seed=1), prompt_index=0,
                               sample_index=0, rid="x", return_routed_experts=True)  # fmt: skip
    body = pool.post("/generate", payload)
    extract = _exec_function_with_numpy()
    flat = extract(body)
    positions = len(prompt) + len(body["output_ids"]) - 1
    all_TLK = torch.from_numpy(flat.copy()).view(positions, 4, -1)
    assert not all_TLK[:, [0, 2]].any() and all_TLK[:, [1, 3]].any()
    want = engine.generate_one(prompt, SamplingParams(max_new_tokens=3, seed=1),
                               sample_seed=payload["sampling_params"].get("sampling_seed"),
                               return_routed_experts=True)  # fmt: skip
    assert torch.equal(all_TLK[:, [1, 3]].long(), engine.codec.decode(want.routes))


def _exec_function_with_numpy():
    np = pytest.importorskip("numpy")
    from sglang_source import load_function

    pybase64 = type("pybase64", (), {"b64decode": staticmethod(base64.b64decode)})
    return load_function(
        "srt/state_capturer/routed_experts.py",
        "extract_routed_experts_from_meta_info",
        {"np": np, "pybase64": pybase64},
    )
