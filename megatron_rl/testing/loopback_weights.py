"""The weight-update endpoints of `LoopbackServer`, as SGLang 0.5.23 answers them.

``/begin_weight_update`` and ``/end_weight_update`` (sessions), ``/update_weights_from_disk``,
``/update_weights_from_tensor``, ``/init_weights_update_group``,
``/update_weights_from_distributed``, ``/destroy_weights_update_group`` and
``/update_weight_version``, field names from ``sglang/srt/managers/io_struct.py``.

``update_weights_from_tensor`` reads SGLang's ``MultiprocessingSerializer`` format (base64 of a
``ForkingPickler`` pickle; on CPU a tensor arrives as a shared-memory handle), with or without
``load_format="flattened_bucket"``, through an allowlist taken from SGLang's ``SafeUnpickler``;
``update_weights_from_distributed`` receives per tensor or one flat bucket, as SGLang does.
Neither checks the weights for NaN/Inf (SGLang does not; the trainer checks before sending).
Tensor and distributed updates outside a session are refused (HTTP 400), as is a second begin;
``LoopbackServer.sessions = False`` plays a release before 0.5.21 (no sessions).
"""

from __future__ import annotations

import base64
import io
import pickle

import torch

from megatron_rl.rollout.flat_bucket import FLATTENED
from megatron_rl.rollout.weight_group import GroupMemberProcess

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8)
_DTYPES += (torch.int16, torch.int32, torch.int64, torch.bool)


class WeightUpdateEndpoints:
    """`LoopbackServer`'s weight-update handlers (module docstring). They use the server's
    ``engine``, ``sessions``, ``tp_size``, ``tensor_entries``, ``weight_groups`` and
    ``weight_group_timeout_s``, and its ``_refused_without_weights``, ``_flush_after_update``
    and ``_abort_everything``."""

    _session_open = False

    def _commit(self, payload: dict) -> None:
        version = payload.get("weight_version")
        if version is not None:
            self.engine.set_version(int(version))

    def _begin_session(self, payload: dict) -> tuple[int, object]:
        # SchedulerWeightUpdater.begin_weight_update (srt/managers/scheduler_components/
        # weight_updater.py): a second begin is refused; http_server answers 400
        if self._session_open:
            message = "a weight-update session is already open; call end_weight_update() first"
            return 400, {"success": False, "message": message}
        self._session_open = True
        return 200, {"success": True, "message": "Success"}

    def _end_session(self, payload: dict) -> tuple[int, object]:
        if not self._session_open:
            message = "no weight-update session is open; call begin_weight_update() first"
            return 400, {"success": False, "message": message}
        self._session_open = False
        return 200, {"success": True, "message": "Success"}

    def _refused_outside_session(self, what: str) -> tuple[int, object] | None:
        """SGLang 0.5.23 refuses tensor and distributed updates outside a session (HTTP 400,
        ``success: false``; `_begin_session` cites where); servers without sessions do not."""
        if not self.sessions or self._session_open:
            return None
        message = f"{what} must run between begin_weight_update() and end_weight_update()"
        return 400, {"success": False, "message": message}

    def _update_version(self, payload: dict) -> tuple[int, object]:
        if payload.get("abort_all_requests", True):  # UpdateWeightVersionReqInput's default
            self._abort_everything()
        try:
            self.engine.set_version(int(payload["new_version"]))
        except (KeyError, TypeError, ValueError) as err:  # SGLang: HTTP 400, success false
            message = f"Failed to update weight version: {err}"
            return 400, {"success": False, "message": message}
        version = payload["new_version"]
        message = f"Weight version updated to {version}"
        return 200, {"success": True, "message": message, "new_version": version}

    def _from_disk(self, payload: dict) -> tuple[int, object]:
        from megatron_rl.model.conversion.safetensors_io import CheckpointReader

        if refused := self._refused_without_weights("update_weights_from_disk"):
            return refused

        try:
            with CheckpointReader(payload["model_path"]) as reader:
                count = self.engine.load_weights_in_place(
                    ((n, reader.get(n)) for n in reader.names()), check_finite=False
                )
        except (OSError, ValueError) as err:  # SGLang: HTTP 400 with success false
            return 400, {"success": False, "message": f"{type(err).__name__}: {err}"}
        self._commit(payload)
        return self._flush_after_update(
            payload, (200, {"success": True, "message": f"loaded {count} tensors"})
        )

    def _from_tensor(self, payload: dict) -> tuple[int, object]:
        if refused := self._refused_outside_session("update_weights_from_tensor"):
            return refused
        if refused := self._refused_without_weights("update_weights_from_tensor"):
            return refused
        # As each of SGLang's ``tp_size`` TP ranks: its own entry (``deserialize_own_rank``),
        # by ``MultiprocessingSerializer.deserialize`` (base64, then an unpickler that admits
        # only tensor and plain-data globals). Rank 0's tensors are loaded; every other rank's
        # must be the same bytes (each TP rank loads the full tensors and keeps its shard).
        try:
            entries = payload["serialized_named_tensors"]
            ranks = [
                deserialize_tensors(entries[r], payload.get("load_format"))
                for r in range(self.tp_size)
            ]
        except (KeyError, IndexError, ValueError, RuntimeError, pickle.UnpicklingError) as err:
            return 400, {"success": False, "message": f"{type(err).__name__}: {err}"}
        named = ranks[0]
        for r, other in enumerate(ranks[1:], start=1):
            for (name, want), (other_name, got) in zip(named, other, strict=True):
                if name != other_name or not torch.equal(want, got):
                    message = f"TP rank {r} received other bytes for {name!r} than rank 0"
                    return 400, {"success": False, "message": message}
        self.tensor_entries.append(list(entries[: self.tp_size]))
        try:
            count = self.engine.load_weights_in_place(named, check_finite=False)
        except ValueError as err:
            return 400, {"success": False, "message": str(err)}
        self._commit(payload)
        return self._flush_after_update(
            payload, (200, {"success": True, "message": f"loaded {count} tensors"})
        )

    def _init_group(self, payload: dict) -> tuple[int, object]:
        # Like an SGLang TP worker: its own process joins the group through the project's
        # mirror of SGLang's ``init_custom_process_group`` (`init_weight_group`).
        name = payload.get("group_name", "weight_update_group")
        if name in self.weight_groups:
            message = f"Failed to initialize custom process group: {name!r} already exists."
            return 400, {"success": False, "message": message}
        try:
            member = GroupMemberProcess(
                backend=payload.get("backend", "nccl"),
                master_address=payload["master_address"],
                master_port=int(payload["master_port"]),
                rank=int(payload["rank_offset"]),
                world_size=int(payload["world_size"]),
                group_name=name,
                timeout_s=self.weight_group_timeout_s,
            )
        except (RuntimeError, TimeoutError, ValueError) as err:
            message = f"Failed to initialize custom process group: {err}."
            return 400, {"success": False, "message": message}
        self.weight_groups[name] = member
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def _from_distributed(self, payload: dict) -> tuple[int, object]:
        if refused := self._refused_outside_session("update_weights_from_distributed"):
            return refused
        if refused := self._refused_without_weights("update_weights_from_distributed"):
            return refused
        group = self.weight_groups.get(payload["group_name"])
        if group is None:
            return 200, {"success": False, "message": f"no group {payload['group_name']!r}"}
        flattened = payload.get("load_format") == FLATTENED  # SGLang: any other value, per tensor
        try:
            with group.receive(
                payload["names"], payload["dtypes"], payload["shapes"], flattened=flattened
            ) as tensors:
                count = self.engine.load_weights_in_place(tensors, check_finite=False)
        except (RuntimeError, TimeoutError) as err:
            return 400, {"success": False, "message": f"{type(err).__name__}: {err}"}
        except ValueError as err:
            return 200, {"success": False, "message": str(err)}
        self._commit(payload)
        return self._flush_after_update(
            payload, (200, {"success": True, "message": f"loaded {count} tensors"})
        )

    def _destroy_group(self, payload: dict) -> tuple[int, object]:
        member = self.weight_groups.pop(payload.get("group_name", "weight_update_group"), None)
        if member is None:  # SGLang's answer, HTTP 400
            return 400, {"success": False, "message": "The group to be destroyed does not exist."}
        member.close()
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}


class _SafeUnpickler(pickle.Unpickler):
    """The globals a CPU weight payload needs, from SGLang's ``SafeUnpickler`` allowlist
    (``sglang/srt/utils/common.py``); anything else is refused as there."""

    ALLOWED = (
        {("builtins", name) for name in ("dict", "list", "tuple", "int", "str", "bool", "float")}
        | {
            ("collections", "OrderedDict"),
            ("copyreg", "__newobj__"),
            ("types", "SimpleNamespace"),
            ("torch", "Size"),
            ("torch", "dtype"),
            ("torch", "UntypedStorage"),
            ("torch.storage", "UntypedStorage"),
            ("torch.storage", "TypedStorage"),
            ("torch", "Tensor"),
            ("torch._utils", "_rebuild_tensor"),
            ("torch._utils", "_rebuild_tensor_v2"),
            ("torch._utils", "_rebuild_parameter"),
            ("torch.multiprocessing.reductions", "rebuild_tensor"),
            ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
            ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
            ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
            ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
            ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"),
            ("multiprocessing.resource_sharer", "DupFd"),
        }
        | {("torch", str(d).removeprefix("torch.")) for d in _DTYPES}
    )

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            # SGLang's patch_torch maps the handle's GPU UUID to a visible device and raises
            # this when there is none; this server sees no GPU at all
            raise RuntimeError("Invalid device_uuid=GPU-(not visible to this server)")
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


def deserialize_tensors(entry: str, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """One rank's ``serialized_named_tensors`` entry -> (name, tensor) pairs, as SGLang reads
    it: a list of pairs, or (``flattened_bucket``) ``{"flattened_tensor", "metadata"}`` whose
    entries name byte ranges ``[start_idx, end_idx)`` of the flat tensor."""
    data = base64.b64decode(entry, validate=True) if isinstance(entry, str) else entry
    obj = _SafeUnpickler(io.BytesIO(data)).load()
    if load_format == FLATTENED:
        flat = obj["flattened_tensor"]
        return [
            (m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
            for m in obj["metadata"]
        ]
    if load_format is not None:
        raise ValueError(f"load_format={load_format!r}: this server takes None or {FLATTENED!r}")
    return list(obj)
