"""How megatron-core splits the decoder layers over pipeline stages."""

from __future__ import annotations


def megatron_stage_layers(
    num_layers: int, pipeline_parallel: int, first: int | None = None, last: int | None = None
) -> tuple[int, ...]:
    """Layers per pipeline stage as megatron-core splits them from
    ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers`` (``first`` /
    ``last``; None: that stage is like the others): the stages in between share the remaining
    layers evenly. ValueError where megatron would refuse the split."""
    pp = pipeline_parallel
    if pp < 1:
        raise ValueError(f"pipeline parallel size {pp}: must be >= 1")
    if pp == 1:
        if first is not None or last is not None:
            raise ValueError("first / last stage layers need pipeline parallel size > 1")
        return (num_layers,)
    for name, value in (("first", first), ("last", last)):
        if value is not None and value < 1:
            raise ValueError(f"{name} stage layers={value}: must be >= 1")
    rest = num_layers - (first or 0) - (last or 0)
    middle = pp - (first is not None) - (last is not None)
    if middle == 0:
        if rest:
            raise ValueError(
                f"first {first} + last {last} layers != num_hidden_layers={num_layers} at "
                f"pipeline parallel size {pp}"
            )
        return (first, last)
    if rest < middle or rest % middle:
        raise ValueError(
            f"the {rest} layers left after the first/last stages do not split evenly over the "
            f"{middle} other pipeline stages (num_hidden_layers={num_layers}, first={first}, "
            f"last={last})"
        )
    each = rest // middle
    return (first or each, *(each,) * (pp - 2), last or each)


def virtual_stage_size(
    num_layers: int,
    pipeline_parallel: int,
    virtual_stages: int | None = None,
    layers_per_virtual_stage: int | None = None,
    uneven: bool = False,
) -> int | None:
    """The number of model chunks per pipeline rank (megatron's
    ``virtual_pipeline_model_parallel_size``; None: plain 1F1B), from
    ``--virtual-pipeline-model-parallel-size`` (``virtual_stages``) or Megatron-LM's
    ``--num-layers-per-virtual-pipeline-stage`` (``layers_per_virtual_stage``: the size is
    ``num_layers / PP / layers_per_virtual_stage``). ValueError naming the flag where
    Megatron-LM refuses the combination: both flags, interleaving at PP 1, or the per-chunk
    size with uneven first/last stages (``uneven``)."""
    check_virtual_flags(pipeline_parallel, virtual_stages, layers_per_virtual_stage, uneven)
    if layers_per_virtual_stage is not None:
        per_rank, left = divmod(num_layers, pipeline_parallel)
        if left or per_rank % layers_per_virtual_stage:
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage={layers_per_virtual_stage}: the "
                f"{num_layers} layers over {pipeline_parallel} pipeline stages do not split into "
                "chunks of that size"
            )
        virtual_stages = per_rank // layers_per_virtual_stage
    if virtual_stages is None or virtual_stages == 1:
        return None
    if pipeline_parallel == 1:
        raise ValueError(
            f"virtual pipeline size {virtual_stages} needs --pipeline-model-parallel-size > 1"
        )
    return virtual_stages


def check_virtual_flags(
    pipeline_parallel: int,
    virtual_stages: int | None,
    layers_per_virtual_stage: int | None,
    uneven: bool = False,
) -> None:
    """ValueError for the virtual pipeline flag combinations Megatron-LM refuses whatever the
    model: both flags, the per-chunk size with uneven stages, a virtual size > 1 at PP 1 (the
    layer split itself is `virtual_stage_size`'s, which needs the layer count)."""
    if virtual_stages is not None and layers_per_virtual_stage is not None:
        raise ValueError(
            "--virtual-pipeline-model-parallel-size and --num-layers-per-virtual-pipeline-stage "
            "both given: give one"
        )
    if layers_per_virtual_stage is not None and uneven:
        raise ValueError(
            "--num-layers-per-virtual-pipeline-stage with --decoder-first/last-pipeline-num-"
            "layers: Megatron-LM refuses it; give --virtual-pipeline-model-parallel-size"
        )
    if virtual_stages not in (None, 1) and pipeline_parallel == 1:
        raise ValueError(
            f"virtual pipeline size {virtual_stages} needs --pipeline-model-parallel-size > 1"
        )


def virtual_chunk_layers(
    num_layers: int,
    pipeline_parallel: int,
    virtual_stages: int,
    first: int | None = None,
    last: int | None = None,
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``[pp_rank][chunk] -> (first global layer, layer count)`` of the interleaved split.

    Megatron splits each stage's layers (`megatron_stage_layers`) evenly over its
    ``virtual_stages`` chunks, and numbers the layers in virtual-stage order: chunk ``c`` of rank
    ``r`` is virtual stage ``c * PP + r``. PP 2 x VP 2 with 4 layers: rank 0 holds layers {0}, {2},
    rank 1 {1}, {3}. ValueError where a stage's layers do not divide by ``virtual_stages``."""
    stages = megatron_stage_layers(num_layers, pipeline_parallel, first, last)
    for rank, layers in enumerate(stages):
        if layers % virtual_stages:
            raise ValueError(
                f"pipeline stage {rank} holds {layers} layers, not divisible by the virtual "
                f"pipeline size {virtual_stages} (num_hidden_layers={num_layers}, "
                f"PP={pipeline_parallel}, first={first}, last={last})"
            )
    per_chunk = [layers // virtual_stages for layers in stages]
    round_size = sum(per_chunk)  # layers of one chunk on every rank: num_layers / VP
    return tuple(
        tuple(
            (c * round_size + sum(per_chunk[:rank]), per_chunk[rank]) for c in range(virtual_stages)
        )
        for rank in range(pipeline_parallel)
    )


def interleaved_group_size(micro_batches: int, pipeline_parallel: int) -> int:
    """megatron's ``microbatch_group_size_per_vp_stage`` as the trainer sets it: the smallest
    ``N`` in ``[PP, M]`` whose last group is empty or holds ``>= PP`` micro-batches (megatron's
    interleaved schedule refuses the others; ``PP`` whenever ``M % PP == 0``). ValueError where
    ``M < PP`` (the schedule refuses it)."""
    pp, m = pipeline_parallel, micro_batches
    if m < pp:
        raise ValueError(
            f"{m} micro-batches per update: the interleaved pipeline schedule needs >= PP={pp}"
        )
    return next(n for n in range(pp, m + 1) if m % n == 0 or m % n >= pp)
