"""Flat buckets and the tensor payload against SGLang's own code (read from the pinned source).

SGLang's ``FlattenedTensorBucket`` (``srt/weight_sync/tensor_bucket.py``, self-contained, loaded
as a module), its ``MultiprocessingSerializer`` + ``SafeUnpickler`` (``srt/utils/common.py``)
and ``WeightUpdater._update_weights_from_flattened_bucket`` (compiled from source and called on a
stand-in runner) are the reference: the trainer's layout must be theirs byte for byte, and the
``tensor`` transport's payload must load through their code in an unrelated process.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import pickle
import subprocess
import sys
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
from sglang_source import class_node, load_class, load_method, load_module

from megatron_rl.rollout import flat_bucket
from megatron_rl.rollout.weight_sync import staging
from megatron_rl.rollout.weight_sync import tensor as tensor_transport

COMMON = "srt/utils/common.py"
UPDATER = "srt/model_executor/model_runner_components/weight_updater.py"


def sglang_bucket_module() -> dict:
    return load_module("srt/weight_sync/tensor_bucket.py", "sglang_tensor_bucket")


def mixed_stream(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
    out = []
    for i in range(40):
        dtype = dtypes[int(torch.randint(0, len(dtypes), (1,), generator=generator))]
        shape = tuple(int(d) for d in torch.randint(1, 6, (int(i % 3) + 1,), generator=generator))
        values = torch.randn(shape, generator=generator) * 50
        out.append((f"t{i}", values.to(dtype)))
    return out


def test_packed_buckets_are_sglangs_flattened_bucket_byte_for_byte():
    """Every bucket `flat_buckets` cuts from a mixed-dtype stream: SGLang's constructor gives the
    same bytes and metadata, and its receive-side ``empty`` (which refuses unaligned starts)
    accepts the layout."""
    bucket_class = sglang_bucket_module()["FlattenedTensorBucket"]
    buckets = list(flat_bucket.flat_buckets(mixed_stream(), bucket_bytes=96))
    assert len(buckets) > 5
    for bucket in buckets:
        slots = flat_bucket.bucket_slots(bucket)
        flat = torch.empty(slots[-1].end, dtype=torch.uint8)
        flat_bucket.pack(bucket, flat)
        theirs = bucket_class(named_tensors=bucket)
        assert torch.equal(theirs.get_flattened_tensor(), flat)
        got = [(m.name, m.start_idx, m.end_idx) for m in theirs.get_metadata()]
        assert got == [(s.name, s.start, s.end) for s in slots]
        empty = bucket_class.empty(
            [s.name for s in slots], [s.dtype for s in slots], [s.shape for s in slots], "cpu"
        )
        assert [(m.name, m.start_idx, m.end_idx) for m in empty.get_metadata()] == got
        for (name, want), (got_name, view) in zip(
            bucket, flat_bucket.unpack(flat, slots), strict=True
        ):
            assert name == got_name and view.dtype == want.dtype and torch.equal(view, want)


def test_an_unaligned_layout_is_refused_like_sglang():
    bucket_class = sglang_bucket_module()["FlattenedTensorBucket"]
    args = (["a", "b"], ["bfloat16", "float32"], [[3], [2]])
    with pytest.raises(ValueError, match="Unaligned"):
        bucket_class.empty(*args, "cpu")
    with pytest.raises(ValueError, match="itemsize"):
        flat_bucket.layout(*args)
    assert [s.start for s in flat_bucket.layout(*args, pad=True)] == [0, 8]


def _sglang_deserialize():
    """SGLang's ``MultiprocessingSerializer.deserialize`` with its ``SafeUnpickler``."""
    shim = type("pybase64", (), {"b64decode": staticmethod(base64.b64decode)})
    unpickler = load_class(COMMON, "SafeUnpickler", {"pickle": pickle})
    serializer = load_class(
        COMMON,
        "MultiprocessingSerializer",
        {"io": io, "pybase64": shim, "ForkingPickler": ForkingPickler, "SafeUnpickler": unpickler},
    )
    return serializer.deserialize


def test_tensor_payload_loads_through_sglangs_deserializer_and_bucket_loader():
    """In this process: SGLang's ``SafeUnpickler`` admits every global the payload names, and
    its flattened-bucket loader hands the model the original tensors."""
    bucket = [(n, t) for n, t in mixed_stream(1) if t.is_floating_point()][:6]
    bucket = next(flat_bucket.flat_buckets(bucket, bucket_bytes=1 << 20))
    loaded = _load_like_sglang(_payload(bucket))
    assert [n for n, _ in loaded] == [n for n, _ in bucket]
    for (_, got), (_, want) in zip(loaded, bucket, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def _payload(bucket) -> str:
    slots = flat_bucket.bucket_slots(bucket)
    with staging.file_system_sharing():
        storage = torch.UntypedStorage._new_shared(slots[-1].end)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    flat_bucket.pack(bucket, flat)
    obj = {"flattened_tensor": flat, "metadata": [tensor_transport._metadata(s) for s in slots]}
    return tensor_transport._serialize_shared(obj)


def _load_like_sglang(entry: str) -> list[tuple[str, torch.Tensor]]:
    module = sglang_bucket_module()
    namespace = {
        "FlattenedTensorMetadata": module["FlattenedTensorMetadata"],
        "FlattenedTensorBucket": module["FlattenedTensorBucket"],
    }
    name = "_update_weights_from_flattened_bucket"
    update = load_method(UPDATER, "WeightUpdater", name, namespace)
    loaded = []
    model = type("Model", (), {"load_weights": lambda self, named: loaded.extend(named)})()
    runner = type("Runner", (), {"get_model": lambda self: model})()
    assert update(runner, _sglang_deserialize()(entry)) == (True, "Success")
    return loaded


@pytest.mark.slow
def test_tensor_payload_is_a_handle_that_an_unrelated_process_maps():
    """A fresh interpreter (no shared multiprocessing authkey, as an SGLang server) decodes the
    payload with SGLang's code and reads the tensors from shared memory; the payload itself is
    a few hundred bytes whatever the bucket size."""
    bucket = [("w.weight", torch.randn(256, 1024)), ("w.bias", torch.randn(1024).bfloat16())]
    entry = _payload(bucket)
    assert len(entry) < 1000 < bucket[0][1].numel()
    script = (
        "import json, sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_sglang_contract_flat_bucket import _load_like_sglang\n"
        "named = _load_like_sglang(sys.stdin.read())\n"
        "print(json.dumps([[n, t.double().sum().item(), str(t.dtype)] for n, t in named]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], input=entry, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    want = [[n, t.double().sum().item(), str(t.dtype)] for n, t in bucket]
    assert got == want


DEEPSEEK_LOADER = "srt/models/deepseek_common/deepseek_weight_loader.py"


def test_sglang_fuses_q_a_and_kv_a_only_within_one_load_call_so_buckets_keep_them_together():
    """SGLang's DeepSeek loader keeps its half-loaded q_a/kv_a tensors in a dict local to one
    ``do_load_weights`` call (one bucket) and writes ``fused_qkv_a_proj_with_mqa`` only when both
    halves are there; a half left at the call's end is dropped. What `flat_bucket` must do, then,
    is what tests/rollout/test_flat_bucket.py checks: both halves of a layer in one bucket."""
    loader = class_node(DEEPSEEK_LOADER, "DeepseekV2WeightLoaderMixin")
    method = next(
        n for n in loader.body if isinstance(n, ast.FunctionDef) and n.name == "do_load_weights"
    )
    local = [
        n
        for n in ast.walk(method)
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "cached_a_proj" for t in n.targets)
    ]
    assert local, "cached_a_proj is no longer a local of do_load_weights: re-read the contract"
    text = ast.unparse(method)
    assert "fused_qkv_a_proj_with_mqa" in text
    assert "q_a_proj_name in cached_a_proj and kv_a_proj_name in cached_a_proj" in text
    assert not any(
        isinstance(n, ast.Attribute) and n.attr == "cached_a_proj" for n in ast.walk(loader)
    ), "SGLang now keeps the halves across calls (self.cached_a_proj): re-read the contract"
    attention = "model.layers.0.self_attn."
    names = [attention + "q_a_proj.weight", attention + "q_b_proj.weight"]
    names += [attention + "kv_a_proj_with_mqa.weight", "model.layers.0.mlp.gate.weight"]
    stream = [(n, torch.zeros(64, dtype=torch.bfloat16)) for n in names]
    buckets = [[n for n, _ in b] for b in flat_bucket.flat_buckets(stream, bucket_bytes=200)]
    together = [b for b in buckets if any("q_a_proj" in n for n in b)]
    assert any("kv_a_proj_with_mqa" in n for n in together[0]), buckets
