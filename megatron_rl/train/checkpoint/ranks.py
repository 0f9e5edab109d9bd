"""The job's ranks as a checkpoint sees them: the parallel layout a step was saved at, this
rank's coordinates in it, and one rank's failure raised on every rank (so no rank waits forever
in a collective the failed one never reaches)."""

from __future__ import annotations

from megatron_rl.collectives import any_rank, rank_and_world_size
from megatron_rl.parallel import initialized_parallel_state

_AXES = {
    "tensor_parallel": "tensor_model_parallel",
    "pipeline_parallel": "pipeline_model_parallel",
    "expert_parallel": "expert_model_parallel",
    "expert_tensor_parallel": "expert_tensor_parallel",
    "context_parallel": "context_parallel",
    "data_parallel": "data_parallel",
}


# layout entries a checkpoint saved before they were recorded was saved at
_UNRECORDED = {"virtual_pipeline": 1}


def layout() -> dict[str, int]:
    """World size and megatron's parallel sizes (all 1 without megatron's groups), and the
    virtual pipeline size (model chunks per pipeline rank; 1 without interleaving): a ``torch``
    checkpoint's per-rank files hold a rank's chunks, so they load at the same one only."""
    ps = initialized_parallel_state()
    sizes = {"world_size": rank_and_world_size()[1]}
    for name, axis in _AXES.items():
        sizes[name] = getattr(ps, f"get_{axis}_world_size")() if ps else 1
    sizes["virtual_pipeline"] = (ps and ps.get_virtual_pipeline_model_parallel_world_size()) or 1
    return sizes


def coords() -> dict[str, int]:
    """This rank's global rank and its rank along every parallel axis."""
    ps = initialized_parallel_state()
    ranks = {"rank": rank_and_world_size()[0]}
    for name, axis in _AXES.items():
        ranks[name] = getattr(ps, f"get_{axis}_rank")() if ps else 0
    return ranks


def layout_difference(saved: dict, current: dict, folder: str) -> str | None:
    """Why ``folder``, saved at layout (or coordinates) ``saved``, does not match ``current``;
    None when they are the same."""
    diffs = [
        f"{k}: saved {saved.get(k, _UNRECORDED.get(k))}, now {v}"
        for k, v in current.items()
        if saved.get(k, _UNRECORDED.get(k)) != v
    ]
    if not diffs:
        return None
    return (
        f"{folder} was saved with another parallel layout ({'; '.join(diffs)}); resume with the "
        "saved layout, or export to HF and load that into the new layout"
    )


def raise_if_any_rank_failed(error: Exception | None, what: str) -> None:
    """Collective: raise ``error`` on the rank that has one, a RuntimeError naming ``what`` on
    the others; nothing when no rank failed."""
    if any_rank(error is not None):
        if error is not None:
            raise error
        raise RuntimeError(f"another rank failed while {what}; the previous checkpoint is intact")
