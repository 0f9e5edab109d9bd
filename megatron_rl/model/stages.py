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
