"""Reshardable model and optimizer state (``--ckpt-format torch_dist``): megatron-core's
``dist_checkpointing`` with its ``torch_dist`` strategy (torch.distributed.checkpoint files).

Every tensor is saved as a shard of its *global* tensor (the model's ``sharded_state_dict()``
gives each TP/EP shard its global shape and offsets), so a checkpoint saved at one TP/EP/DP
layout loads at another: each rank reads the slices its new layout owns. The commit (staging
folder, sha256 records, rename, ``latest``) is `megatron_rl.train.checkpoint.commit`'s, shared
with the per-rank ``torch`` format. Background writes (``--async-save``): `async_write`.

What was measured on megatron-core 0.16.1 (CPU, gloo, tiny Qwen3-MoE, world size 2):

* ``DistributedOptimizer.sharded_state_dict`` offers ``dp_reshardable`` (reshards along DP
  only), ``fully_reshardable`` and the default ``fully_sharded_model_space``. The default raises
  ``ShardedTensor.flattened_range is not supported`` (its own validation rejects it, CPU or not).
  ``fully_reshardable`` gathers the optimizer state per parameter in model space (each Adam
  moment shaped and sharded like its parameter): with NCCL it calls ``.cuda()``, so it is used
  with ``distrib_optim_fully_reshardable_mem_efficient`` (gather over gloo to DP rank 0, which
  alone writes it). That is the mode used here, on GPU as well.
* ``ChainedOptimizer`` prefixes keys with ``chained_<i>.`` when it holds several optimizers;
  TP2/EP1 builds one optimizer and EP2 two (dense and expert), so the keys and the number of
  non-tensor optimizer states differ between layouts. Each inner optimizer is therefore asked for
  its own sharded state (keys then name the parameter only), and the non-tensor state (parameter
  groups' hyper-parameters, the Adam step, a grad scaler) is stored once, keyed by megatron's
  parameter-group identifiers, and handed back to every inner optimizer at load.
* Under interleaved pipeline parallelism a rank's model is a `ModelChunks`; each chunk's sharded
  state is asked for on its own (`_model_sharded_state`), so its tensors keep the keys every other
  layout gives them (global layer numbers, no ``chunks.{c}.`` prefix) and the checkpoint reshards
  between PP x VP, plain PP and PP 1 (tests/train/test_pipeline_checkpoint.py).
* The ``torch_dist`` strategy modules are imported lazily by megatron, after the CPU backend
  redirected megatron's ``torch``; they call ``torch.cuda.synchronize()`` and allocate on
  ``device='cuda'``. `_megatron_dist_checkpointing` imports them and re-applies the CPU backend
  to them (a no-op on GPU).
* Saving the tiny model at TP2 took 5.7 s per rank (most of it megatron's sharding validation
  and the gather); loading at EP2 a similar time. The per-rank ``torch`` format takes well
  under a second, and stays the default for that reason on small runs.

RNG states are not resharded: each rank writes its own ``rng_rank*.pt``; a resume at the same
layout restores them all, one at another layout restores torch/python/numpy states from the rank
with the same index (modulo the saved world size) and keeps megatron's tensor-parallel RNG
tracker as seeded (its streams are per TP rank).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from megatron_rl.model.chunks import as_chunks
from megatron_rl.parent_death import forks_die_with_parent
from megatron_rl.train.checkpoint.async_write import BackgroundWrite, results_queue_dies_with_us
from megatron_rl.train.checkpoint.optimizer_state import (
    _fresh_adam_state,
    _torch_optimizer,
    _unshare_steps,
    inner_optimizers,
)

logger = logging.getLogger(__name__)

FORMAT = "torch_dist"
# megatron's metadata for the optimizer's sharded state dict (see the module docstring)
SHARDING_METADATA = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
    "chained_optim_avoid_prefix": True,
}
# megatron's parameter-group identifiers but is_expert_parallel, which is False for every group
# at EP1 and True for the expert group at EP>1: hyper-parameters depend on these three only
_GROUP_KEYS = ("wd_mult", "lr_mult", "is_decoupled_lr")
_GROUP_IDENTIFIERS = (*_GROUP_KEYS, "is_expert_parallel")
_COMMON_KEY = "megatron_rl_optimizer_common"


def _megatron_dist_checkpointing():
    """megatron's dist_checkpointing with its torch_dist strategy, CPU shims applied on CPU.

    Raises:
        RuntimeError: psutil is missing. megatron-core 0.16's file writer calls it in every
            writer process before its own error handling, so without it a worker dies without
            reporting and the save waits forever (found in a fresh environment).
    """
    try:
        import psutil  # noqa: F401
    except ImportError as err:
        raise RuntimeError(
            "--ckpt-format torch_dist needs psutil (megatron-core's checkpoint writer uses it): "
            "pip install psutil"
        ) from err
    import megatron.core.dist_checkpointing.strategies.async_utils
    import megatron.core.dist_checkpointing.strategies.filesystem_async
    import megatron.core.dist_checkpointing.strategies.state_dict_saver
    import megatron.core.dist_checkpointing.strategies.torch  # noqa: F401
    from megatron.core import dist_checkpointing

    from megatron_rl.backend.cpu import activate_cpu_backend, cpu_backend_active

    if cpu_backend_active():
        activate_cpu_backend()  # covers the strategy modules imported just now
    return dist_checkpointing


def _calls(optimizer):
    shim = getattr(optimizer, "_megatron_calls", None)
    return shim() if shim is not None else contextlib.nullcontext()


def _model_sharded_state(model) -> dict[str, dict]:
    """Each model chunk's megatron sharded state dict, by its `ModelChunks` prefix (``""``
    without interleaving).

    Every chunk is asked on its own, without a prefix: the checkpoint keys of its tensors are then
    those of any other layout (layers under their global numbers, ``embedding.*`` and
    ``output_layer.*`` plain), so a checkpoint saved at PP 2 x VP 2 loads at PP 1 or plain PP 2
    and back. `ModelChunks.sharded_state_dict` would key them ``chunks.{c}.*``, which no other
    layout has. The optimizer's state follows: megatron keys each parameter's state by the
    sharded tensor whose ``data`` is that parameter, found in this dict whatever its nesting.
    """
    chunks = as_chunks(model)
    if len(chunks) == 1:
        return {"": chunks[0].sharded_state_dict(metadata=SHARDING_METADATA)}
    return {
        f"chunks.{c}.": chunk.sharded_state_dict(metadata=SHARDING_METADATA)
        for c, chunk in enumerate(chunks)
    }


def _is_sharded(value) -> bool:
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return isinstance(value, ShardedBase)


def _leaves(tree, found=None) -> list[tuple]:
    """``(container, key)`` of every ShardedBase leaf of ``tree`` (dicts and lists), in order."""
    found = [] if found is None else found
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in items:
        if _is_sharded(value):
            found.append((tree, key))
        elif isinstance(value, (dict, list)):
            _leaves(value, found)
    return found


def _group_key(group: dict) -> str:
    return repr(tuple(group.get(k, group.get(f"pre_{k}")) for k in _GROUP_KEYS))


def _non_tensor_state(inner_state: dict) -> dict:
    """The layout-independent non-tensor state of one inner optimizer's sharded state dict."""
    optim = inner_state.get("optimizer", inner_state)  # FP32Optimizer: torch's dict itself
    groups = {}
    for group in optim.get("param_groups", []):
        groups[_group_key(group)] = {
            k: v
            for k, v in group.items()
            if k != "params" and k not in _GROUP_IDENTIFIERS and k[4:] not in _GROUP_IDENTIFIERS
        }
    common = {"param_groups": groups}
    step = optim.get("state", {}).get("common_step") if "state" in optim else None
    if step is not None:
        common["common_step"] = step
    if inner_state.get("grad_scaler") is not None:
        common["grad_scaler"] = inner_state["grad_scaler"]
    return common


def _sharded_state(model, optimizer, is_loading: bool) -> tuple[dict, list[dict], dict]:
    """(each model chunk's sharded state dict (`_model_sharded_state`), each inner optimizer's,
    a flat dict of all their ShardedBase leaves for megatron's save/load).

    The flat dict has no lists and no non-tensor values: megatron merges the saved common state
    into the loaded one, and a list (or a number of optimizers) that differs between layouts
    would not merge.
    """
    model_state = _model_sharded_state(model)
    inner_states = []
    with _calls(optimizer):
        for inner in inner_optimizers(optimizer):
            _fresh_adam_state(_torch_optimizer(inner))
            inner_states.append(
                inner.sharded_state_dict(
                    model_state, is_loading=is_loading, metadata=SHARDING_METADATA
                )
            )
    leaves = _leaves(model_state) + _leaves(inner_states)
    flat = {str(i): container[key] for i, (container, key) in enumerate(leaves)}
    return model_state, inner_states, flat


def sharded_save_state(model, optimizer) -> dict:
    """What `save_sharded` writes: the model's and optimizer's sharded state, the non-tensor
    optimizer state merged over the inner optimizers (their parameter groups keyed by megatron's
    group identifiers) into megatron's common state.

    Built apart from the write so that a rank failing here (megatron's checks of its own
    optimizer state) can stop every rank (`raise_if_any_rank_failed`) before the write's
    global collectives, which the others would otherwise wait in forever. Megatron's
    optimizer may run collectives of its own process groups here.
    """
    _, inner_states, flat = _sharded_state(model, optimizer, is_loading=False)
    common: dict = {"param_groups": {}}
    for state in inner_states:
        part = _non_tensor_state(state)
        common["param_groups"].update(part.pop("param_groups"))
        common.update(part)
    return {"tensors": flat, _COMMON_KEY: common}


def save_sharded(folder: str, state: dict, background: bool = False):
    """Collective: write ``state`` (`sharded_save_state`) into ``folder`` (which exists).

    Returns:
        None once the files are written; with ``background=True`` a `BackgroundWrite` whose
        writer process is running (the state it writes is already snapshotted, see
        `async_write`): ``folder`` is complete only after its ``finished(wait=True)``.
    """
    dist_checkpointing = _megatron_dist_checkpointing()
    results_queue_dies_with_us()
    with forks_die_with_parent():  # the writer processes (see `async_write`)
        request = dist_checkpointing.save(
            state,
            folder,
            sharded_strategy=("torch_dist", 1),
            async_sharded_save=background,
        )
        return BackgroundWrite(request) if background else None


def load_sharded(folder: str, model, optimizer) -> None:
    """Collective: load ``folder`` into ``model`` and ``optimizer`` at this job's layout.

    A tensor whose global shape differs from the model's raises (megatron's check, before any
    tensor is read).
    """
    dist_checkpointing = _megatron_dist_checkpointing()
    model_state, inner_states, flat = _sharded_state(model, optimizer, is_loading=True)
    leaves = _leaves(model_state) + _leaves(inner_states)
    loaded = dist_checkpointing.load(
        {"tensors": flat, _COMMON_KEY: {}}, folder, sharded_strategy=("torch_dist", 1)
    )
    for i, (container, key) in enumerate(leaves):
        container[key] = loaded["tensors"][str(i)]
    common = loaded[_COMMON_KEY]
    for chunk, state in zip(as_chunks(model), model_state.values(), strict=True):
        chunk.load_state_dict(state, strict=True)
    with _calls(optimizer), torch.no_grad():
        for inner, state in zip(inner_optimizers(optimizer), inner_states, strict=True):
            _unwrap_local(state)
            _apply_common(state, common)
            param_state = state.pop("param_state", None)
            state.pop("param_state_sharding_type", None)
            inner.load_state_dict(state)
            if param_state is not None:
                _load_param_state(inner, param_state)
            _unshare_steps(_torch_optimizer(inner))


def _unwrap_local(tree) -> None:
    """Replace megatron's ``LocalNonpersistentObject`` wrappers (parameter ids of the plain
    optimizer's groups, never saved) by what they wrap, as megatron's own load does."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in list(items):
        if isinstance(value, LocalNonpersistentObject):
            tree[key] = value.unwrap()
        elif isinstance(value, (dict, list)):
            _unwrap_local(value)


def _load_param_state(inner, param_state: dict) -> None:
    """megatron's ``load_parameter_state_from_fully_reshardable`` with torch's Adam.

    It copies every entry of a parameter's torch state, ``step`` included, from the loaded
    tensors, which never hold ``step`` (KeyError in 0.16.1 without Apex/TE): the steps are set
    aside meanwhile (they come from the parameter groups, restored by ``load_state_dict``).
    """
    torch_optimizer = _torch_optimizer(inner)
    steps = {p: s.pop("step") for p, s in torch_optimizer.state.items() if "step" in s}
    try:
        inner.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for param, step in steps.items():
            torch_optimizer.state[param]["step"] = step


def _apply_common(state: dict, common: dict) -> None:
    optim = state.get("optimizer", state)
    for group in optim.get("param_groups", []):
        saved = common["param_groups"].get(_group_key(group))
        if saved is None:
            raise ValueError(
                f"the checkpoint has no optimizer parameter group {_group_key(group)} "
                f"(it has {sorted(common['param_groups'])})"
            )
        group.update(saved)
    if "common_step" in common and "state" in optim:
        optim["state"]["common_step"] = common["common_step"]
    if "grad_scaler" in common and "grad_scaler" in state:
        state["grad_scaler"] = common["grad_scaler"]
