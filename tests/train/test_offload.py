"""The trainer's offload around a rollout: nothing left on the device, everything back bit for
bit, and the next update equal to a never-offloaded twin's (plain and distributed Adam, fp32 and
bf16, on megatron-core's own DDP and optimizer)."""

from __future__ import annotations

import pytest
import torch
from megatron.core import tensor_parallel

from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
from megatron_rl.model import ModelOptions, build_model, causal_lm_logits, preset_config
from megatron_rl.train.offload import ARENA_ALIGN, HostArena, TrainerOffload, _torch_optimizers

LAYOUTS = [
    {"distributed": False, "dtype": "float32"},
    {"distributed": True, "dtype": "float32"},
    {"distributed": True, "dtype": "bfloat16"},
]


def _tiny(distributed: bool, dtype: str):
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # megatron's init forks this generator
    config = preset_config("tiny")
    model = wrap_for_training(
        build_model(config, ModelOptions(dtype=dtype)), use_distributed_optimizer=distributed
    )
    optimizer = build_optimizer(
        model, OptimizerConfig(lr=1e-2, clip_grad=1.0, use_distributed_optimizer=distributed)
    )
    return config, model, optimizer


def _backward(model, vocab_size: int, seed: int) -> None:
    tokens = torch.randint(0, vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    logits = causal_lm_logits(model, tokens[:, :-1]).float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), tokens[:, 1:].ravel())
    loss.backward()


def _snapshot(model, optimizer) -> dict[str, torch.Tensor]:
    """Parameters, DDP grad buffers and every optimizer state tensor, cloned."""
    out = {f"param/{n}": p.detach().clone() for n, p in model.module.named_parameters()}
    for i, buffer in enumerate(model.buffers + model.expert_parallel_buffers):
        out[f"grad_data/{i}"] = buffer.grad_data.clone()
    for k, torch_optimizer in enumerate(_torch_optimizers(optimizer)):
        for i, state in enumerate(torch_optimizer.state.values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim/{k}/{i}/{key}"] = value.clone()
        for g, group in enumerate(torch_optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                out[f"main/{k}/{g}/{i}"] = param.detach().clone()
    return out


def _trained_once(layout):
    """One update applied (Adam state exists) and the next backward done (grads non-zero)."""
    config, model, optimizer = _tiny(**layout)
    optimizer.zero_grad()
    _backward(model, config.vocab_size, seed=1)
    assert optimizer.step() is not None
    optimizer.zero_grad()
    _backward(model, config.vocab_size, seed=2)
    return config, model, optimizer


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x['dtype']}_dist{x['distributed']}")
def test_offload_frees_every_storage_and_onload_restores_them_bit_for_bit(ws1, layout):
    _, model, optimizer = _trained_once(layout)
    before = _snapshot(model, optimizer)
    assert any(k.endswith("exp_avg") for k in before)
    offload = TrainerOffload(model, optimizer)
    resident = offload.resident_bytes()
    assert resident > 0
    assert offload.offload() == resident
    assert offload.resident_bytes() == 0
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="storage"):  # any use of an offloaded tensor fails
        causal_lm_logits(model, tokens)
    with pytest.raises(RuntimeError, match="already offloaded"):
        offload.offload()
    assert offload.onload() == resident
    assert offload.resident_bytes() == resident
    after = _snapshot(model, optimizer)
    assert before.keys() == after.keys()
    different = [k for k in before if not torch.equal(before[k], after[k])]
    # the gradient buffers are zeroed before every update, so they come back zeroed, uncopied
    assert different == [k for k in before if k.startswith("grad_data/")], different[:5]
    assert all(before[k].any() and not after[k].any() for k in different)
    with pytest.raises(RuntimeError, match="without offload"):
        offload.onload()


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x['dtype']}_dist{x['distributed']}")
def test_an_update_after_offload_and_onload_equals_a_never_offloaded_twins(ws1, layout):
    _, model, optimizer = _trained_once(layout)
    _, twin, twin_optimizer = _trained_once(layout)
    start, twin_start = _snapshot(model, optimizer), _snapshot(twin, twin_optimizer)
    assert all(torch.equal(start[k], twin_start[k]) for k in start)  # the twins are twins
    offload = TrainerOffload(model, optimizer)
    offload.offload()
    offload.onload()
    config = preset_config("tiny")
    for m, o in ((model, optimizer), (twin, twin_optimizer)):  # the trainer's next update
        o.zero_grad()
        _backward(m, config.vocab_size, seed=3)
    assert optimizer.step() == twin_optimizer.step()
    end, twin_end = _snapshot(model, optimizer), _snapshot(twin, twin_optimizer)
    assert all(torch.equal(end[k], twin_end[k]) for k in end)
    assert any(not torch.equal(start[k], end[k]) for k in start if k.startswith("param/"))


def test_every_offload_of_a_run_copies_into_one_host_arena_of_the_bytes_it_needs(ws1):
    """One host allocation per rank, reused by every later offload, and exactly the device bytes
    up to the alignment of each copy (torch's pinned allocator, one call per storage, rounds each
    copy up to a power of two)."""
    _, model, optimizer = _trained_once(LAYOUTS[1])
    offload = TrainerOffload(model, optimizer)
    assert offload.host_bytes == 0 and offload.host_allocations == 0
    resident = offload.resident_bytes()
    storages = len(offload._storages())
    for _ in range(3):
        offload.offload()
        offload.onload()
    assert offload.host_allocations == 1
    gradients = sum(b.grad_data.untyped_storage().nbytes() for b in model.buffers)
    copied = resident - gradients  # the gradient buffers are freed, never copied
    assert gradients > 0 and copied <= offload.host_bytes <= copied + storages * ARENA_ALIGN
    arena = offload._arena
    assert all(v.data_ptr() % ARENA_ALIGN == 0 for v in arena.views)
    one = arena.buffer.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == one for v in arena.views)
    assert optimizer.step() is not None  # Adam's state is the same storages: the arena stays
    offload.offload()
    offload.onload()
    assert offload.host_allocations == 1
    with pytest.raises(RuntimeError, match="while offloaded"):
        offload.offload()
        offload.close()
    offload.onload()
    offload.close()
    assert offload.host_bytes == 0


def test_a_fresh_optimizers_first_offload_already_holds_adams_state(ws1):
    """The first --colocate offload comes before any update (the first rollout): Adam's moments
    exist from construction, so the arena is built once, not again after step 1."""
    config, model, optimizer = _tiny(**LAYOUTS[1])
    offload = TrainerOffload(model, optimizer)
    offload.offload()
    offload.onload()
    first = offload.host_bytes
    optimizer.zero_grad()
    _backward(model, config.vocab_size, seed=1)
    assert optimizer.step() is not None
    offload.offload()
    offload.onload()
    assert offload.host_allocations == 1 and offload.host_bytes == first


def test_a_storage_that_changes_size_gets_a_new_arena_and_still_round_trips(ws1):
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    offload = TrainerOffload(model, optimizer)
    offload.offload()
    offload.onload()
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()  # Adam's moments and the grads are new storages
    expected = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    offload.offload()
    assert offload.host_allocations == 2
    offload.onload()
    got = optimizer.state_dict()["state"][0]
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_host_arena_views_are_aligned_slices_of_exactly_the_sizes_asked():
    arena = HostArena([3, ARENA_ALIGN, 1])
    assert [v.numel() for v in arena.views] == [3, ARENA_ALIGN, 1]
    assert arena.nbytes == 3 * ARENA_ALIGN
    assert [v.data_ptr() - arena.buffer.data_ptr() for v in arena.views] == [0, 512, 1024]
    assert all(v.data_ptr() % ARENA_ALIGN == 0 for v in arena.views)
    with pytest.raises(ValueError, match="positive"):
        HostArena([4, 0])
