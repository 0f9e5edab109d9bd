"""`ipc_serializer` writes what SGLang's ``MultiprocessingSerializer.deserialize`` reads.

Against SGLang's real code (``.venv-sglang``, in a subprocess: an unrelated process, as a
server is): CPU shared-memory tensors serialised here come back with equal bytes, and a CUDA
reduction written here reaches SGLang's patched ``rebuild_cuda_tensor`` with our GPU UUID at the
position where SGLang looks for it. Against SGLang's source (read, not imported): the names and
positions the format depends on. What no CPU can check: torch's CUDA IPC handle itself.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import inspect
import json
import os
import pickle
import subprocess
import types
import uuid
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import pytest
import torch
from sglang_source import class_node, load_function, sglang_path
from torch.multiprocessing import reductions

from megatron_rl.rollout.weight_sync import ipc_serializer, staging

PATCH = "srt/utils/patch_torch.py"
FAKE_UUID = "GPU-00000000-1111-2222-3333-444444444444"
REAL_SGLANG = Path(__file__).resolve().parents[1] / "real_sglang"


def shared(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` copied into a shared-memory file storage (what the staging buffer is)."""
    nbytes = tensor.numel() * tensor.element_size()
    flat = torch.empty(0, dtype=torch.uint8).set_(staging.new_shared_storage(nbytes))
    flat.copy_(tensor.contiguous().view(-1).view(torch.uint8))
    return flat.view(tensor.dtype).view(tensor.shape)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def payload_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(64, 48, generator=generator)
    return {
        "fp32": shared(values),
        "bf16": shared(values.bfloat16()),
        "fp8": shared(values.to(torch.float8_e4m3fn)),
        "i64": shared(torch.arange(17)),
    }


class _CudaShaped:
    """Pickles as torch's reduction of a CUDA tensor on device 0, passed through
    `ipc_serializer`'s reduction (a CPU torch cannot reduce a real one)."""

    def __init__(self, monkeypatch):
        monkeypatch.setattr(ipc_serializer, "device_uuid", lambda index: FAKE_UUID)
        args = (torch.Tensor, (4,), (1,), 0, torch.UntypedStorage, torch.float32, 0, b"handle",
                16, 0, False, b"ref", 0, b"event", False)  # fmt: skip

        def torch_reduce(tensor):
            return reductions.rebuild_cuda_tensor, args

        self.reduced = ipc_serializer._reduce_tensor_by_uuid(
            torch_reduce, types.SimpleNamespace(is_cuda=True)
        )

    def __reduce__(self):
        return self.reduced


SCRIPT = """
import base64, hashlib, json, sys, torch
from sglang.srt.utils.common import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
shared, cuda = json.load(sys.stdin)
obj = MultiprocessingSerializer.deserialize(shared)
out = {"tensors": {k: [str(t.dtype), list(t.shape),
                       hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()]
                   for k, t in obj["tensors"].items()},
       "meta": obj["meta"].__dict__ | {"dtype": str(obj["meta"].dtype)}}
monkey_patch_torch_reductions()  # what tp_worker.deserialize_own_rank does first
try:
    MultiprocessingSerializer.deserialize(cuda)
    out["cuda"] = "loaded"
except Exception as error:
    out["cuda"] = f"{type(error).__name__}: {error}"
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def sglang_read(request):
    """What SGLang's real deserializer (``.venv-sglang``) makes of two payloads written here."""
    import sys

    sys.path.insert(0, str(REAL_SGLANG))
    from servers import SGLANG_PYTHON, SHIMS_DIR, require

    require()
    monkeypatch = pytest.MonkeyPatch()
    tensors = payload_tensors()
    meta = types.SimpleNamespace(name="w", shape=torch.Size([4, 2]), dtype=torch.bfloat16)
    shared_entry = ipc_serializer.serialize({"tensors": tensors, "meta": meta})
    cuda_entry = ipc_serializer.serialize(_CudaShaped(monkeypatch))
    monkeypatch.undo()
    run = subprocess.run(
        [str(SGLANG_PYTHON), "-c", SCRIPT],
        input=json.dumps([shared_entry, cuda_entry]),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SHIMS_DIR), "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    return tensors, json.loads(line.removeprefix("RESULT "))


@pytest.mark.slow
def test_shared_tensors_load_with_equal_bytes_through_sglangs_real_deserializer(sglang_read):
    tensors, got = sglang_read
    want = {k: [str(t.dtype), list(t.shape), digest(t)] for k, t in tensors.items()}
    assert got["tensors"] == want
    assert got["meta"] == {"name": "w", "shape": [4, 2], "dtype": "torch.bfloat16"}


@pytest.mark.slow
def test_a_cuda_handle_names_its_gpu_by_the_uuid_sglang_looks_up(sglang_read):
    """SGLang's patched ``rebuild_cuda_tensor`` receives our UUID string at its device position
    and looks it up among the visible GPUs (none on CPU): only that lookup raises this."""
    _, got = sglang_read
    assert got["cuda"] == f"Exception: Invalid device_uuid={FAKE_UUID}"


# ---------------------------------------------------------------- the format, read from source
def _constant(relative: str, name: str):
    for node in ast.parse(sglang_path(relative).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in sglang/{relative}")


def test_the_device_position_is_torchs_storage_device_and_sglangs_index():
    assert _constant(PATCH, "_REDUCE_TENSOR_ARG_DEVICE_INDEX") == ipc_serializer.DEVICE_ARG
    names = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert names[ipc_serializer.DEVICE_ARG] == "storage_device"


def test_our_uuid_string_is_the_one_sglangs_lookup_maps_to_the_device(monkeypatch):
    """SGLang's ``_device_to_uuid`` / ``_device_from_maybe_uuid`` (compiled from its source)
    on a stand-in torch with two GPUs: our `device_uuid` writes their string, and theirs maps
    it back to the same index."""
    uuids = [uuid.UUID(int=7), uuid.UUID(int=9)]
    cuda = types.SimpleNamespace(
        device_count=lambda: len(uuids),
        get_device_properties=lambda i: types.SimpleNamespace(uuid=uuids[i]),
    )
    fake_torch = types.SimpleNamespace(cuda=cuda)
    from typing import Union

    to_uuid = load_function(PATCH, "_device_to_uuid", {"torch": fake_torch})
    from_uuid = load_function(
        PATCH, "_device_from_maybe_uuid", {"torch": fake_torch, "Union": Union}
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", cuda.get_device_properties)
    ours = ipc_serializer.device_uuid.__wrapped__
    for index in range(len(uuids)):
        assert ours(index) == to_uuid(index)
        assert from_uuid(ours(index)) == index


def test_the_server_patches_rebuild_cuda_tensor_before_it_deserialises():
    """The payload names torch's ``rebuild_cuda_tensor``: the server must have replaced it
    (``monkey_patch_torch_reductions``) by then, and its ``SafeUnpickler`` must admit it."""
    patch = next(
        n for n in ast.parse(sglang_path(PATCH).read_text()).body
        if isinstance(n, ast.FunctionDef) and n.name == "monkey_patch_torch_reductions"
    )  # fmt: skip
    assigned = {
        (ast.unparse(t), ast.unparse(n.value))
        for n in ast.walk(patch)
        if isinstance(n, ast.Assign)
        for t in n.targets
    }
    assert ("reductions.rebuild_cuda_tensor", "_rebuild_cuda_tensor_modified") in assigned
    method = next(
        n for n in class_node("srt/managers/tp_worker.py", "BaseTpWorker").body
        if isinstance(n, ast.FunctionDef) and n.name == "deserialize_own_rank"
    )  # fmt: skip
    calls = [ast.unparse(n.func) for n in ast.walk(method) if isinstance(n, ast.Call)]
    assert calls.index("monkey_patch_torch_reductions") < calls.index(
        "MultiprocessingSerializer.deserialize"
    )
    allowed = class_node("srt/utils/common.py", "SafeUnpickler")
    text = ast.unparse(allowed)
    for name in ("rebuild_cuda_tensor", "rebuild_storage_filename", "rebuild_tensor"):
        assert f"('torch.multiprocessing.reductions', '{name}')" in text


def test_only_this_pickler_names_gpus_by_uuid():
    """torch's class-wide reductions stay as they are (other picklers in the trainer keep
    torch's format); the payload of a CPU tensor is the plain ForkingPickler one."""
    before = dict(ForkingPickler._extra_reducers)
    tensor = shared(torch.arange(6.0))
    data = ipc_serializer.serialize({"t": tensor}, output_str=False)
    assert ForkingPickler._extra_reducers == before
    assert reductions.rebuild_cuda_tensor.__module__ == "torch.multiprocessing.reductions"
    assert torch.equal(pickle.loads(data)["t"], tensor)
    assert base64.b64decode(ipc_serializer.serialize({"t": tensor}), validate=True)[:2] == data[:2]


def test_a_reduction_that_is_not_rebuild_cuda_tensor_is_refused():
    with pytest.raises(RuntimeError, match="rebuild_cuda_tensor"):
        ipc_serializer.with_device_uuid(reductions.rebuild_tensor, (0,) * 15, str)
