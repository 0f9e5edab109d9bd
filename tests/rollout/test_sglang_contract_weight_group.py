"""The weight-update group against SGLang's own server side, and its names and teardown.

The server half is SGLang's ``init_custom_process_group`` (``sglang/srt/utils/common.py``),
compiled from the pinned package's source by `sglang_source.load_function` and run in a child
process exactly as SGLang's ``init_weights_update_group`` calls it (``tcp://`` init method,
``rank = rank_offset + tp_rank``, ``group_name``), and it receives buckets with SGLang's own
``WeightUpdater.receive_weights_from_distributed`` (per tensor, and ``flattened_bucket`` through
SGLang's ``FlattenedTensorBucket``). The trainer half is the project's `init_weight_group`,
`flat_bucket.flat_buckets` / `pack` and one broadcast per flat bucket. A group built any other
way waits on store keys the other side never writes, so these tests fail by timeout (short here)
rather than by a wrong answer.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing

import pytest
import torch
from sglang_source import load_function, load_method, load_module

from megatron_rl.rollout import flat_bucket, weight_group

# The child process re-imports this module: heavier imports stay inside the tests.

TIMEOUT_S = 15.0
TENSORS = [
    ("a.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7),
    ("b.bias", torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)),
    ("c.index", torch.tensor([[7, -1], [2**40, 0]], dtype=torch.int64)),
]


def _sglang_receiver(group_name: str, group):
    """SGLang's ``receive_weights_from_distributed``, bound to a stand-in ``self`` on CPU."""
    updater = "srt/model_executor/model_runner_components/weight_updater.py"
    bucket_module = load_module("srt/weight_sync/tensor_bucket.py", "sglang_tensor_bucket")
    namespace = {"torch": torch, "FlattenedTensorBucket": bucket_module["FlattenedTensorBucket"]}
    receive = load_method(updater, "WeightUpdater", "receive_weights_from_distributed", namespace)
    bucketed = load_method(
        updater, "WeightUpdater", "_receive_bucketed_weights_from_distributed", namespace
    )
    this = type("Updater", (), {"_receive_bucketed_weights_from_distributed": bucketed})()
    this._model_update_group, this.device = {group_name: group}, "cpu"
    return lambda **request: receive(this, **request)


def _sglang_server_rank(conn, port: int, world_size: int, group_name: str, buckets) -> None:
    """Child process: SGLang's server side (rank 1), then buckets received and sent back."""
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    init_custom_process_group = load_function(
        "srt/utils/common.py",
        "init_custom_process_group",
        {"torch": torch, "torch_release": release},
    )
    conn.send(("ready", None))  # the group's timeout starts once both sides are running
    try:
        group = init_custom_process_group(
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
            world_size=world_size,
            rank=1,
            group_name=group_name,
        )
        receive = _sglang_receiver(group_name, group)
        received = []
        for names, dtypes, shapes, load_format in buckets:
            received += receive(
                names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
                load_format=load_format,
            )  # fmt: skip
        buffer = io.BytesIO()  # views of one flat buffer: cloned to be saved one by one
        torch.save([(n, t.clone()) for n, t in received], buffer)
        conn.send(("ok", buffer.getvalue()))
        torch.distributed.destroy_process_group(group)  # what SGLang's destroy endpoint does
    except Exception as err:
        conn.send(("error", f"{type(err).__name__}: {err}"))


@pytest.mark.distributed
@pytest.mark.parametrize(
    "under_torchrun,flattened",
    [
        pytest.param(False, True, marks=pytest.mark.slow, id="flattened"),
        pytest.param(True, True, marks=pytest.mark.slow, id="flattened_torchrun_agent_store"),
        pytest.param(False, False, id="per_tensor"),  # the fast lane keeps one (3 s each)
    ],
)
@pytest.mark.slow
def test_trainer_group_interoperates_with_sglangs_init_custom_process_group(
    monkeypatch, under_torchrun, flattened
):
    """Also under torchrun, whose agent-store setting would make a ``tcp://`` rendezvous on
    rank 0 a mere client: the trainer must still host the store. Mixed dtypes: the int64
    tensor would start unaligned after the bf16 one, so `flat_buckets` cuts a bucket there
    (SGLang 0.5.23 refuses an unaligned start). The trainer's store listens before SGLang's
    side is told its port, as in a sync (`weight_group.host_store`)."""
    store = weight_group.host_store("127.0.0.1", 0, TIMEOUT_S)
    name = weight_group.unique_group_name("contract")
    buckets = list(flat_bucket.flat_buckets(TENSORS, bucket_bytes=1 << 20))
    assert [len(b) for b in buckets] == [2, 1]
    requests = [
        (
            [n for n, _ in bucket],
            [weight_group.dtype_name(t.dtype) for _, t in bucket],
            [list(t.shape) for _, t in bucket],
            flat_bucket.FLATTENED if flattened else None,
        )
        for bucket in buckets
    ]
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    args = (child, store.port, 2, name, requests)
    server = context.Process(target=_sglang_server_rank, args=args)
    server.start()
    try:
        assert parent.poll(120) and parent.recv()[0] == "ready"
        if under_torchrun:  # the trainer only; SGLang's process started without it
            monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
        group = weight_group.init_weight_group(
            backend="gloo",
            master_address="127.0.0.1",
            master_port=store.port,
            rank=0,
            world_size=2,
            group_name=name,
            timeout_s=TIMEOUT_S,
            store=store,
        )
        for bucket in buckets:
            if flattened:
                flat = torch.empty(flat_bucket.bucket_slots(bucket)[-1].end, dtype=torch.uint8)
                flat_bucket.pack(bucket, flat)
                weight_group.broadcast_tensor(group, flat)
            else:
                for _, tensor in bucket:
                    weight_group.broadcast_tensor(group, tensor.clone())
        assert parent.poll(TIMEOUT_S + 30), "SGLang's side never answered"
        status, blob = parent.recv()
        assert status == "ok", blob
        received = torch.load(io.BytesIO(blob), weights_only=True)
        assert [n for n, _ in received] == [n for n, _ in TENSORS]
        for (_, got), (_, want) in zip(received, TENSORS, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
        assert weight_group.destroy_weight_group(group)
        assert not weight_group.destroy_weight_group(group)  # already gone: no error
    finally:
        server.join(TIMEOUT_S + 30)
        if server.is_alive():
            server.kill()
    assert server.exitcode == 0


def test_group_names_are_unique_per_creation_and_never_empty():
    names = {weight_group.unique_group_name("w", "run1") for _ in range(3)}
    assert len(names) == 3 and all(n.startswith("w-run1-") for n in names)
    assert weight_group.unique_group_name("w") != weight_group.unique_group_name("w")
    with pytest.raises(ValueError, match="empty"):
        weight_group.unique_group_name("")
    assert weight_group.tcp_init_method("::1", 5) == "tcp://[::1]:5"


def _sync(server_url: str, engine, version: int):
    from megatron_rl.rollout.http_pool import HttpPool, HttpPoolConfig
    from megatron_rl.rollout.weight_sync import WeightSync, WeightSyncConfig

    pool = HttpPool(HttpPoolConfig(urls=(server_url,), request_timeout_s=60.0, backoff_s=0.01))
    config = WeightSyncConfig(transport="distributed", group_timeout_s=TIMEOUT_S)
    sync = WeightSync(pool, config)
    named = [(n, p.detach() + version) for n, p in list(engine.model.named_parameters())[:3]]
    sync.sync(named, version=version)
    return sync


@pytest.mark.slow
@pytest.mark.distributed
def test_a_restarted_trainer_syncs_again_and_close_tears_the_group_down(servers):
    from rollout_testing import make_engine

    engine = make_engine(seed=0)
    (server,) = servers(1, engine=engine)
    first = _sync(server.url, engine, version=1)
    stale = first.transport.group_name
    assert list(server.weight_groups) == [stale]
    # The trainer "crashes": its half of the group dies with it, the server keeps its half.
    weight_group.destroy_weight_group(first.transport.groups[0].local)
    first.threads.shutdown(wait=False)

    second = _sync(server.url, engine, version=2)  # a fresh name: no clash with the stale group
    second_name = second.transport.group_name
    assert second_name != stale and set(server.weight_groups) == {stale, second_name}
    assert engine.weight_version == 2
    second.close()
    assert second.transport.groups[0].local is None and second.transport.group_name is None
    assert set(server.weight_groups) == {stale}  # only the crashed run's group is left
    status, answer = server.handle("/destroy_weights_update_group", {"group_name": stale})
    assert status == 200 and answer["success"] is True
    status, answer = server.handle("/destroy_weights_update_group", {"group_name": stale})
    assert status == 400 and answer["success"] is False  # SGLang's answer for an unknown group


@pytest.mark.slow
@pytest.mark.distributed
def test_a_failed_group_creation_destroys_both_halves(servers):
    from rollout_testing import make_engine

    from megatron_rl.rollout.http_pool import HttpPool, HttpPoolConfig
    from megatron_rl.rollout.weight_sync import WeightSync, WeightSyncConfig

    engine = make_engine(seed=0)
    (server,) = servers(1, engine=engine)
    seen = []

    def fail_the_join(path, payload):
        if path == "/init_weights_update_group":
            seen.append(payload["group_name"])
            return "503"
        return None

    server.before_request = fail_the_join
    pool = HttpPool(HttpPoolConfig(urls=(server.url,), request_timeout_s=60.0, backoff_s=0.01))
    sync = WeightSync(pool, WeightSyncConfig(transport="distributed", group_timeout_s=3.0))
    with pytest.raises(Exception, match=r"(?i)timed out|init_weights_update_group"):
        sync.transport._init_group(sync.transport.groups[0])
    assert sync.transport.groups[0].local is None and sync.transport.group_name is None
    assert not server.weight_groups
    assert "/destroy_weights_update_group" in server.requests
    server.before_request = None
    # the retry must succeed however loaded the machine is: no short timeout decides it (the
    # 3 s above only bounds the wait for a member that never joins)
    sync.config.group_timeout_s = 300.0
    sync.transport._init_group(sync.transport.groups[0])  # a retry works under a new name
    name = sync.transport.group_name
    assert name != seen[0] and list(server.weight_groups) == [name]
    sync.close()
    assert not server.weight_groups
