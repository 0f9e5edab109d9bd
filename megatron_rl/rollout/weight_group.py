"""The weight-update process group between the trainer (rank 0) and rollout servers.

SGLang's ``/init_weights_update_group`` makes every TP worker of a server call
``init_custom_process_group`` (``sglang/srt/utils/common.py``) with
``init_method="tcp://{master_address}:{master_port}"``, ``rank = rank_offset + tp_rank``,
``world_size`` and ``group_name``: torch's ``rendezvous`` gives a ``TCPStore`` (hosted by rank
0, multi-tenant), the store is wrapped in ``PrefixStore(group_name, store)`` and the group is
made by torch's ``_new_process_group_helper(world_size, rank, [], backend, store,
group_name=...)``, which adds its own ``"{group_name}/"`` and ``"{device}/"`` prefixes. The
trainer's side must land on exactly the same store keys, so `init_weight_group` takes the same
path; a group built any other way (another prefix, ``ProcessGroupGloo`` on a bare store) waits
on keys nobody writes until it times out. ``tests/rollout/test_sglang_contract_weight_group.py``
runs SGLang's own function against this one.

One deliberate difference on rank 0: it hosts the ``TCPStore`` itself instead of going through
``rendezvous``, because under ``torchrun`` (``TORCHELASTIC_USE_AGENT_STORE=True``) the
``tcp://`` rendezvous turns every rank into a client of the elastic agent's store and nobody
would listen on ``master_port``. The store it builds is the one the rendezvous gives rank 0
otherwise (``is_master=True``, multi-tenant), so the keys are identical. The trainer binds it
with `host_store` before the servers are told its address: on port 0 the OS picks the port and
the store holds it from then on (a port picked free, released and bound again later could be
taken in between: EADDRINUSE); the servers' ranks connect to a store that already listens.

Group names are global per process in torch (a second group of the same name is refused), and
SGLang keeps a group until ``/destroy_weights_update_group``: `unique_group_name` gives every
group creation its own name, so a trainer restarted after a crash never collides with the group
its previous run left on the servers, and `destroy_weight_group` releases a group.

`GroupMemberProcess` is one non-zero rank of a group in a child process, built with
`init_weight_group` like an SGLang TP worker (the loopback server uses it; its HTTP process may
share a process with the trainer in tests, where torch would refuse the duplicate name).
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import itertools
import logging
import multiprocessing
import threading
import uuid
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_rl.rollout import flat_bucket

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")

# torch 2.6 renamed ``pg_options`` to ``backend_options`` (SGLang picks by version the same way).
_OPTIONS_KW = (
    "backend_options"
    if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters
    else "pg_options"
)
_attempts = itertools.count(1)


def unique_group_name(prefix: str, run_id: str | None = None) -> str:
    """``"{prefix}-{run_id}-{attempt}"``: a fresh name for every group creation.

    ``run_id`` defaults to a random hex id; ``attempt`` counts creations in this process.
    """
    if not prefix:
        raise ValueError("group name prefix must not be empty (SGLang rejects an empty name)")
    return f"{prefix}-{run_id or uuid.uuid4().hex[:12]}-{next(_attempts)}"


def tcp_init_method(address: str, port: int) -> str:
    """``tcp://host:port`` as SGLang builds it (IPv6 literals in brackets)."""
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address
    return f"tcp://{host}:{int(port)}"


def host_store(master_address: str, master_port: int = 0, timeout_s: float = 120.0):
    """Rank 0's ``TCPStore`` for a group, listening from now on: ``master_port`` 0 lets the
    OS pick the port (``store.port`` is the one to tell the other ranks).

    The store SGLang's rendezvous would give rank 0 (``is_master=True``, multi-tenant); it
    does not wait for the other ranks here (the group's creation does).
    """
    return dist.TCPStore(
        master_address.strip("[]"),
        int(master_port),
        None,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=True,
    )


def init_weight_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 120.0,
    store: dist.TCPStore | None = None,
) -> dist.ProcessGroup:
    """This side's member of the group (blocks until all ``world_size`` ranks joined).

    Same store, prefixes and group construction as SGLang's ``init_custom_process_group``; rank
    0 (the trainer) hosts the ``TCPStore``: ``store``, from `host_store` (bound before the
    other ranks were told its port), else one bound here on ``master_port``. Does not need
    (nor touch) the default group.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose one of {BACKENDS}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
    if not group_name:
        raise ValueError("group_name must not be empty")
    if store is not None and rank != 0:
        raise ValueError(f"rank={rank}: only rank 0 hosts the group's store")
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        if store is None:
            store = host_store(master_address, master_port, timeout_s)
    else:
        init_method = tcp_init_method(master_address, master_port)
        store, _, _ = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    try:
        group, _ = c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            c10d.Backend(backend),
            store,
            group_name=group_name,
            timeout=timeout,
            device_id=None,
            **{_OPTIONS_KW: None},
        )
    except dist.DistStoreError as err:
        if "timeout" not in str(err).lower():
            raise
        raise dist.DistStoreError(
            f"weight group {group_name!r}: rank {rank} timed out after {timeout_s:g} s waiting "
            f"for all {world_size} ranks to join ({err})"
        ) from err
    # Group ranks are global ranks here (what ``dist.broadcast(..., src=0, group=...)`` maps).
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_group(group: dist.ProcessGroup | None) -> bool:
    """Release ``group`` and its name in this process; False if it was already gone."""
    if group is None:
        return False
    try:
        dist.destroy_process_group(group)
    except (KeyError, ValueError, RuntimeError) as err:
        logger.debug("destroying weight group: %r", err)
        return False
    return True


def broadcast_tensor(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` from rank 0 of ``group`` in place."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's dtype strings: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def receive_bucket(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    *,
    flattened: bool = False,
    buffer: torch.Tensor | None = None,
    device: str = "cpu",
) -> list[tuple[str, torch.Tensor]]:
    """Receiver side of one bucket, as an SGLang TP worker takes it.

    ``flattened`` (``load_format="flattened_bucket"``): one broadcast of the whole bucket in
    SGLang's flat layout (`flat_bucket.layout`); otherwise one broadcast per tensor in the
    announced order. The tensors are views of ``buffer`` (uint8, at least
    `bucket_nbytes` bytes; a new one when None).
    """
    slots = flat_bucket.layout(names, dtypes, shapes, pad=not flattened)
    need = bucket_nbytes(slots)
    if buffer is None:
        buffer = torch.empty(need, dtype=torch.uint8, device=device)
    elif buffer.numel() < need:
        raise ValueError(f"receive buffer holds {buffer.numel()} bytes, the bucket needs {need}")
    if flattened:
        broadcast_tensor(group, buffer[:need])
    else:
        for slot in slots:
            broadcast_tensor(group, flat_bucket.view(buffer, slot))
    return flat_bucket.unpack(buffer, slots)


def bucket_nbytes(slots: Sequence[flat_bucket.Slot]) -> int:
    return slots[-1].end if slots else 0


# ---------------------------------------------------------------------- a member in a process
def _member_main(conn, kwargs: dict) -> None:
    """Child process: join the group, then serve ``receive`` / ``destroy`` requests."""
    try:
        group = init_weight_group(**kwargs)
    except Exception as err:
        conn.send(("error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ok", None))
    buffer = None  # shared with the parent, which reads the received tensors in place
    try:
        while True:
            try:
                request = conn.recv()
            except EOFError:
                return
            if request[0] == "buffer":
                buffer = request[1]
                continue
            if request[0] != "receive":
                return
            try:
                receive_bucket(group, *request[1:4], flattened=request[4], buffer=buffer)
                conn.send(("ok", None))
            except Exception as err:
                conn.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        destroy_weight_group(group)


class GroupMemberProcess:
    """Rank ``rank`` (> 0) of a weight group, joined by a child process with `init_weight_group`.

    The constructor returns once the group is joined (RuntimeError if joining failed);
    `receive` takes one bucket as `receive_bucket` does, into a shared-memory buffer the child
    writes and this process reads in place (no copy between them); `close` destroys the group.
    """

    def __init__(
        self,
        *,
        backend: str,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        timeout_s: float = 120.0,
    ) -> None:
        if backend != "gloo":
            raise ValueError(f"backend={backend!r}: a member process receives on CPU (gloo)")
        kwargs = {
            "backend": backend,
            "master_address": master_address,
            "master_port": master_port,
            "rank": rank,
            "world_size": world_size,
            "group_name": group_name,
            "timeout_s": timeout_s,
        }
        self.group_name = group_name
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_member_main, args=(child, kwargs), daemon=True)
        self._process.start()
        child.close()
        status, message = self._answer(timeout_s + 60.0)
        if status != "ok":
            self.close()
            raise RuntimeError(f"joining weight group {group_name!r} failed: {message}")

    def _answer(self, timeout_s: float):
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"weight group member gave no answer in {timeout_s:.0f} s")
        try:
            return self._conn.recv()
        except EOFError as err:
            raise RuntimeError("weight group member process died") from err

    @contextlib.contextmanager
    def receive(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        flattened: bool = False,
    ):
        """Receive one bucket; yields (name, tensor) views of the shared buffer, valid inside
        the block (the next bucket reuses the buffer)."""
        with self._lock:
            slots = flat_bucket.layout(names, dtypes, shapes, pad=not flattened)
            need = bucket_nbytes(slots)
            if self._buffer is None or self._buffer.numel() < need:
                storage = torch.UntypedStorage._new_shared(max(need, 1))
                self._buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
                self._conn.send(("buffer", self._buffer))
            request = ("receive", list(names), list(dtypes), [list(s) for s in shapes], flattened)
            self._conn.send(request)
            status, message = self._answer(self._timeout_s + 30.0)
            if status != "ok":
                raise RuntimeError(message)
            yield flat_bucket.unpack(self._buffer, slots)

    def close(self, timeout_s: float = 10.0) -> None:
        """Destroy the group in the child and end it (killed if it does not end in time)."""
        with contextlib.suppress(OSError):
            self._conn.send(("destroy",))
        self._process.join(timeout_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
