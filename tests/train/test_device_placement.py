"""Every tensor the model, the loss or a collective sees is on the model's device (issue 10).

On a CPU-only machine the model's device *is* the host, so the CUDA bugs this guards against
(micro-batch tensors built on the CPU and never moved; CPU tensors handed to NCCL) run silently.
Two checks make them fail here:

* `device_guard.DeviceGuard` (see its docstring for the exact rule) gives the CPU a "virtual"
  model device by provenance: the model's parameters, buffers and optimizer state are on it, so
  is whatever is moved there with ``.to(device)`` or created with ``device=`` naming it, and so
  is every result computed from such tensors; everything else is host. Around the trainer's own
  ``train_on`` (old-logprob pass, losses, backward, megatron's optimizer step, the trainer's
  collectives) it raises `WrongDeviceError` where a GPU would raise "Expected all tensors to be on
  the same device" or NCCL would refuse a CPU tensor. The tests below show it passing on the
  trainer as it is, and failing when `MicroBatch.to` is bypassed (the old trainer never moved its
  micro-batches) and when a collective builds its tensor without a device (the old collectives).
* The collectives of `megatron_rl.collectives` are checked one by one against a group device that
  is not the CPU (``meta``), with ``all_reduce`` intercepted: the tensor each hands over must be
  on the group's device; a collective written the old way fails that check.

What this cannot prove (it is not a GPU): tensors moved or created with an explicit ``"cpu"``
device count as on the model's device (the model's device is the CPU here); factories run inside
autograd's backward are not seen by the guard's function mode and default to the device; the
group device of every collective is taken to be the model's device (true of NCCL groups); only
the code that runs is checked: world size 1, TP = EP = 1, the configurations below. Kernels,
streams and real NCCL behaviour need a GPU run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from device_guard import DeviceGuard, WrongDeviceError
from trainer_testing import rendezvous, small_config

from megatron_rl import collectives
from megatron_rl.train.batch import MicroBatch

# 2 prompts x 4 samples: one optimizer step of 2 micro-batches
SMALL = dict(rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=8)
MICRO_BATCH_FIELDS = ("tokens_BS", "loss_mask_BT", "rollout_logprobs_BT", "advantages_B")
# where a GPU would first fail when only that field stays on the host
CAUGHT_AT = {
    "tokens_BS": r"aten\.embedding",  # the model
    "loss_mask_BT": r"megatron_rl/losses/",  # the loss (CUDA accepts a CPU mask as an index)
    "rollout_logprobs_BT": r"aten\.sub(.|\n)*in record: self\.gaps\[key\]",  # the mismatch metric
    "advantages_B": r"megatron_rl/losses/",  # the loss
}


@pytest.fixture
def make_trainer(tmp_path):
    """Build a world-size-1 CPU trainer (closed afterwards) and its first rollout's samples."""
    from megatron_rl.train.trainer import Trainer

    built = []

    def make(**overrides):
        trainer = Trainer(small_config(tmp_path, **{**SMALL, **overrides}), **rendezvous(tmp_path))
        built.append(trainer)
        samples, _ = trainer.rollout()  # outside the guard: rollout samples are host tensors
        return trainer, samples

    yield make
    for trainer in built:
        trainer.close()


def _guard(trainer) -> DeviceGuard:
    """A guard whose device holds the trainer's model, optimizer state and KL reference."""
    return DeviceGuard(trainer.device).place(
        trainer.model, trainer.optimizer, getattr(trainer, "reference", None)
    )


# ------------------------------------------------------------------ the rule itself
def test_the_guard_tells_the_model_device_from_the_host_by_provenance():
    weight = torch.randn(8, 4)
    host_rows = torch.tensor([1, 2, 3])  # built on the host: no device named
    with DeviceGuard("cpu").place(weight) as guard:
        rows = host_rows.to("cpu")  # a move to the model's device (a no-op on the CPU)
        assert guard.on_device(rows) and guard.on_device(weight[rows])
        assert not guard.on_device(host_rows)  # a move leaves the source where it was
        assert guard.on_device(torch.arange(3, device=weight.device))
        assert not guard.on_device(torch.zeros(3))  # the host default, as on a GPU machine
        assert not guard.on_device(weight.sum(0).cpu())  # a host copy, as on a GPU machine
        weight * torch.tensor(2.0)  # CUDA accepts CPU scalars
        weight[host_rows]  # and CPU index tensors
        weight[host_rows] = 0.0
        host_ids = r"aten.embedding.*host tensor\(s\) \['int64\[3\]"
        with pytest.raises(WrongDeviceError, match=host_ids):
            torch.nn.functional.embedding(host_rows, weight)
        with pytest.raises(WrongDeviceError, match=r"aten\.add"):
            weight[0] + torch.zeros(4)
        assert len(guard.violations) == 2
        guard.violations.clear()  # caught here; the guard re-raises swallowed ones on exit


# ------------------------------------------------------------------ the trainer as it is
@pytest.mark.parametrize(
    "overrides",
    [{}, {"kl_coef": 0.1, "rollout_correction": "tis-token", "loss": "gspo"}],
    ids=["grpo", "kl_reference_rollout_correction_gspo"],
)
def test_train_on_keeps_every_tensor_on_the_model_device(make_trainer, overrides):
    """Old-logprob pass, losses, backward and megatron's optimizer step run under the guard
    without one tensor on the wrong device. (At world size 1 the trainer's votes and the
    log-probs' TP reductions are over one rank and call no collective; the collectives are
    checked against a non-CPU group device below.)"""
    trainer, samples = make_trainer(**overrides)
    for i, sample in enumerate(samples):  # mixed advantages: a non-zero gradient
        sample.advantage = (-1.0) ** i
    with _guard(trainer) as guard:
        metrics = trainer.train_on(samples)
    assert guard.violations == []
    checked = guard.ops_checked  # the guard saw the model and its backward
    assert checked["aten.embedding.default"] and checked["aten.embedding_dense_backward.default"]
    assert metrics["grad_norm"] > 0  # megatron's optimizer step ran guarded too


# ------------------------------------------------------------------ the old behaviour fails
def _leave_on_host(monkeypatch, fields) -> None:
    """`MicroBatch.to` that leaves ``fields`` where they were built (the old trainer left all)."""
    real_to = MicroBatch.to

    def to(self, device):
        moved = real_to(self, device)
        return dataclasses.replace(moved, **{f: getattr(self, f) for f in fields})

    monkeypatch.setattr(MicroBatch, "to", to)


@pytest.mark.parametrize("how", ["never_moved", "moved_copy_discarded"])
def test_micro_batches_not_moved_to_the_model_device_fail_in_the_model(
    make_trainer, monkeypatch, how
):
    """The old trainer: micro-batches built on the host, never moved (or moved and the copy
    dropped). The embedding lookup of the host token ids is the first op to mix devices."""
    trainer, samples = make_trainer()
    if how == "never_moved":
        _leave_on_host(monkeypatch, MICRO_BATCH_FIELDS)
    else:
        real_to = MicroBatch.to
        monkeypatch.setattr(MicroBatch, "to", lambda self, device: (real_to(self, device), self)[1])
    host_ids = r"aten.embedding.*host tensor\(s\) \['int64\["
    with pytest.raises(WrongDeviceError, match=host_ids), _guard(trainer):
        trainer.train_on(samples)


@pytest.mark.parametrize("field", MICRO_BATCH_FIELDS)
def test_each_micro_batch_tensor_left_on_the_host_is_caught(make_trainer, monkeypatch, field):
    trainer, samples = make_trainer()
    _leave_on_host(monkeypatch, [field])
    with pytest.raises(WrongDeviceError, match=CAUGHT_AT[field]), _guard(trainer):
        trainer.train_on(samples)


def test_a_host_tensor_handed_to_a_collective_fails(make_trainer, monkeypatch):
    """The old collectives built their tensors with ``torch.tensor([...])``: on the CPU even
    when the group is NCCL's. The trainer's all-ranks-agree vote then fails under the guard."""

    def old_reduce_flag(flag, op, group):
        value = torch.tensor([int(bool(flag))], dtype=torch.int32)  # the old code: no device
        dist.all_reduce(value, op=op, group=group)
        return bool(value.item())

    trainer, samples = make_trainer()
    monkeypatch.setattr(collectives, "_reduce_flag", old_reduce_flag)
    host_flag = r"collective c10d\.allreduce_.*host tensor\(s\) \['int32\[1\]'\]"
    with pytest.raises(WrongDeviceError, match=host_flag), _guard(trainer):
        trainer.train_on(samples)


# ------------------------------------------------------------------ collectives, one by one
GROUP_DEVICE = torch.device("meta")  # not the CPU: a tensor built without a device shows


class _HandedOver(Exception):
    """Raised by the intercepted ``all_reduce`` with the tensor it was given."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__(f"all_reduce got a tensor on {tensor.device}")
        self.device = tensor.device


@pytest.fixture
def two_rank_world(monkeypatch):
    """Collectives see rank 0 of 2 whose group device is ``meta``; ``all_reduce`` records the
    tensor it is handed and stops there (a meta tensor has no values to read back)."""
    monkeypatch.setattr(collectives, "is_distributed", lambda: True)
    monkeypatch.setattr(collectives, "group_device", lambda group=None: GROUP_DEVICE)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)

    def all_gather_object(out, obj, group=None):
        out[:] = [obj] * len(out)  # every rank reports the same metric keys

    def all_reduce(tensor, op=None, group=None, async_op=False):
        raise _HandedOver(tensor)

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)


def _assert_hands_over_on_group_device(call) -> None:
    with pytest.raises(_HandedOver) as handed:
        call()
    assert handed.value.device == collectives.group_device(), (
        f"the collective handed all_reduce a tensor on {handed.value.device}, "
        f"not on the group's device {collectives.group_device()}"
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda: collectives.sum_over_ranks([1.0, 2.0]),
        lambda: collectives.any_rank(True),
        lambda: collectives.all_ranks_agree(False),
        lambda: collectives.mean_over_ranks({"loss": 1.0, "entropy": 2.0}),
    ],
    ids=["sum_over_ranks", "any_rank", "all_ranks_agree", "mean_over_ranks"],
)
def test_collectives_allocate_on_the_group_device(two_rank_world, call):
    _assert_hands_over_on_group_device(call)


def test_a_collective_written_the_old_way_fails_the_group_device_check(two_rank_world):
    def old_sum_over_ranks(values, group=None):
        tensor = torch.tensor(list(values), dtype=torch.float64)  # the old code: no device
        dist.all_reduce(tensor, group=group)
        return tensor.tolist()

    with pytest.raises(AssertionError, match=r"on cpu, not on the group's device meta"):
        _assert_hands_over_on_group_device(lambda: old_sum_over_ranks([1.0, 2.0]))
