"""The ``tensor`` transport's payload, written without SGLang: the bytes SGLang's
``MultiprocessingSerializer.deserialize`` (``srt/utils/common.py``) reads.

The format (SGLang 0.5.23):

- the object is pickled by ``multiprocessing.reduction.ForkingPickler``, whose dispatch table
  holds torch's ``torch.multiprocessing.reductions``: a tensor travels as a handle to its
  storage, never as its bytes. A CPU tensor in shared memory is named by its shared-memory file
  (torch's ``"file_system"`` strategy, so a process that does not share this one's
  multiprocessing authkey can map it); a CUDA tensor by a CUDA IPC handle, rebuilt by
  ``rebuild_cuda_tensor(cls, size, stride, offset, storage_cls, dtype, storage_device, handle,
  ...)``;
- in that CUDA call the device (argument ``DEVICE_ARG`` = 6) is the GPU's UUID as a string, not
  its index. SGLang's ``monkey_patch_torch_reductions`` (``srt/utils/patch_torch.py``) replaces
  ``rebuild_cuda_tensor`` on the server, before it deserialises (``tp_worker
  .deserialize_own_rank``), by a wrapper that maps a UUID string to the local device index
  (``str(torch.cuda.get_device_properties(i).uuid)``; "Invalid device_uuid=..." when none
  matches), because a server with other ``CUDA_VISIBLE_DEVICES`` numbers the same GPU
  differently;
- with ``output_str`` the pickle bytes are base64-encoded (what ``serialized_named_tensors``
  carries in JSON); SGLang decodes a ``str`` with ``b64decode(validate=True)``.

Unlike SGLang's producer, which patches torch's reductions for the whole process, the UUID is
put in by this pickler's own dispatch table: torch's reductions stay as they are for every other
pickler in the trainer (data-loader workers, torch.multiprocessing queues). The payload names
torch's ``torch.multiprocessing.reductions.rebuild_cuda_tensor``, which SGLang's ``SafeUnpickler``
admits and which, once the server has patched the module, is SGLang's UUID-aware wrapper.

Checked on CPU (``tests/rollout/test_ipc_serializer.py``): shared-memory tensors serialised here
are read back with equal bytes by SGLang's real ``MultiprocessingSerializer.deserialize``, and a
CUDA-shaped reduction written here reaches SGLang's real UUID lookup with our UUID string.
Only a GPU can check the CUDA path itself: torch's ``reduce_tensor`` of a CUDA tensor (the IPC
handle, the reference counter, the event) and the server opening the handle.
"""

from __future__ import annotations

import base64
import functools
import io
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # registers torch's reductions with ForkingPickler

from megatron_rl.rollout.weight_sync.staging import file_system_sharing

# what torch's reduce_tensor names for a CUDA tensor (SGLang's wrapper, if it patched this process)
CUDA_REBUILDS = ("rebuild_cuda_tensor", "_rebuild_cuda_tensor_modified")
DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device (SGLang: _REDUCE_TENSOR_ARG_DEVICE_INDEX)


def serialize(obj, *, output_str: bool = True) -> str | bytes:
    """``obj`` (a dict / list of tensors and plain values) as SGLang's
    ``MultiprocessingSerializer.serialize(obj, output_str)`` writes it: ForkingPickler bytes,
    CUDA devices named by UUID, base64 text when ``output_str``. The tensors must stay alive
    (and CPU ones in shared memory) until the receiver has read them."""
    buffer = io.BytesIO()
    with file_system_sharing():
        _pickler(buffer).dump(obj)
    data = buffer.getvalue()
    return base64.b64encode(data).decode("ascii") if output_str else data


def _pickler(buffer: io.BytesIO) -> ForkingPickler:
    """A ForkingPickler whose tensor reductions name CUDA devices by UUID (this pickler
    only: the class-wide table is untouched)."""
    pickler = ForkingPickler(buffer)
    table = dict(pickler.dispatch_table)
    for cls, reduce in list(table.items()):
        if isinstance(cls, type) and issubclass(cls, torch.Tensor):
            table[cls] = functools.partial(_reduce_tensor_by_uuid, reduce)
    pickler.dispatch_table = table
    return pickler


def _reduce_tensor_by_uuid(reduce, tensor: torch.Tensor):
    """torch's reduction of ``tensor``; for a CUDA tensor the device index replaced by the
    GPU's UUID (what SGLang's patched ``rebuild_cuda_tensor`` expects)."""
    rebuild, args = reduce(tensor)
    if tensor.is_cuda:
        args = with_device_uuid(rebuild, args, device_uuid)
    return rebuild, args


def with_device_uuid(rebuild, args: tuple, uuid_of) -> tuple:
    """``args`` of ``rebuild_cuda_tensor`` with argument ``DEVICE_ARG`` (an int device index)
    replaced by ``uuid_of(index)``; a UUID already there is kept."""
    if getattr(rebuild, "__name__", "") not in CUDA_REBUILDS:
        raise RuntimeError(
            f"torch reduced a CUDA tensor to {rebuild!r}, not rebuild_cuda_tensor: the CUDA "
            "IPC payload format SGLang reads has changed in this torch"
        )
    device = args[DEVICE_ARG]
    if isinstance(device, str):
        return args
    if not isinstance(device, int):
        raise RuntimeError(f"rebuild_cuda_tensor argument {DEVICE_ARG} is {device!r}, not a device")
    return (*args[:DEVICE_ARG], uuid_of(device), *args[DEVICE_ARG + 1 :])


@functools.cache
def device_uuid(index: int) -> str:
    """GPU ``index``'s UUID as SGLang compares it (``str(properties.uuid)``)."""
    return str(torch.cuda.get_device_properties(index).uuid)
