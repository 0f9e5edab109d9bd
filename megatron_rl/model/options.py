"""Training-side model choices that are not part of the HF architecture (no megatron import)."""

from __future__ import annotations

from argparse import ArgumentTypeError
from dataclasses import dataclass

import torch

from megatron_rl.flags import bad_value, check_choice, derived, option

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TRANSFORMER_IMPLS = {"auto": "auto", "transformer_engine": "te", "local": "local"}


def _spec(text: str) -> str:
    """``--transformer-impl`` -> `ModelOptions.spec`."""
    if text not in TRANSFORMER_IMPLS:
        raise ArgumentTypeError(f"{text!r}: choose one of {tuple(TRANSFORMER_IMPLS)}")
    return TRANSFORMER_IMPLS[text]


def _recompute(text: str) -> bool:
    """``--recompute-granularity`` -> `ModelOptions.recompute` (megatron's ``full`` only)."""
    if text != "full":
        raise ArgumentTypeError(f"{text!r}: only 'full' is supported")
    return True


@dataclass(kw_only=True, slots=True)
class ModelOptions:
    """The policy's megatron-core side: precision, layer spec, recompute, uneven stages."""

    dtype: str = option("float32", name="bf16", const="bfloat16", help="bf16 parameters")
    sequence_parallel: bool | None = None  # None: on whenever tensor parallel > 1
    routing_replay: bool = derived(False, source="replay.mode != 'off'")
    aux_loss_coeff: float = 0.0
    recompute: bool = option(
        False,
        name="recompute-granularity",
        parse=_recompute,
        help="full: recompute every layer's activations in the backward (megatron's 'full')",
    )
    token_dispatcher: str = "alltoall"
    moe_grouped_gemm: bool = option(
        True,
        name="no-moe-grouped-gemm",
        help="run the experts one by one (megatron's SequentialMLP) instead of grouped GEMMs "
        "(Transformer Engine's TEGroupedMLP, or megatron_rl's TorchGroupedMLP on torch's "
        "grouped matmul without TE)",
    )
    spec: str = option(
        "auto",
        name="transformer-impl",
        parse=_spec,
        help="layer spec: auto (transformer_engine on CUDA, error if missing; local on CPU), "
        "transformer_engine or local",
    )
    local_attention: str = option(
        "auto",
        name="local-attention",
        help="the local spec's causal attention: sdpa (torch's fused scaled_dot_product_attention, "
        "one kernel forward and backward), unfused (megatron's DotProductAttention) or auto "
        "(sdpa on the CPU; unfused on CUDA, where the memory plan and the GPU smoke describe it)",
    )
    # uneven pipeline stages: layers of the first / last stage (None: even split)
    first_stage_layers: int | None = option(
        None,
        name="decoder-first-pipeline-num-layers",
        help="layers of the first pipeline stage (uneven stages); the rest are split evenly",
    )
    last_stage_layers: int | None = option(
        None,
        name="decoder-last-pipeline-num-layers",
        help="layers of the last pipeline stage (uneven stages); the rest are split evenly",
    )
    # interleaved pipeline: model chunks per pipeline rank (see model/stages.virtual_stage_size)
    virtual_stages: int | None = option(
        None,
        name="virtual-pipeline-model-parallel-size",
        help="model chunks per pipeline rank: megatron's interleaved 1F1B schedule, whose bubble "
        "is 1/VP of plain 1F1B's (needs PP > 1; each stage's layers divisible by it)",
    )
    layers_per_virtual_stage: int | None = option(
        None,
        name="num-layers-per-virtual-pipeline-stage",
        help="layers per model chunk (Megatron-LM's flag): the virtual pipeline size is "
        "num_layers / PP / this; not with --decoder-first/last-pipeline-num-layers",
    )

    def __post_init__(self) -> None:
        for name in (
            "first_stage_layers",
            "last_stage_layers",
            "virtual_stages",
            "layers_per_virtual_stage",
        ):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise bad_value(self, name, "must be an integer >= 1")
        check_choice(self, "spec", ("auto", "te", "local"))
        check_choice(self, "dtype", tuple(DTYPES))
        check_choice(self, "local_attention", ("auto", "sdpa", "unfused"))
        if self.aux_loss_coeff < 0:
            raise bad_value(self, "aux_loss_coeff", "must be >= 0")
        check_choice(self, "token_dispatcher", ("alltoall", "allgather"))

    @property
    def interleaved(self) -> bool:
        """Whether a virtual pipeline flag asks for model chunks (the size needs the layers)."""
        return self.virtual_stages not in (None, 1) or self.layers_per_virtual_stage is not None

    @property
    def uneven_stages(self) -> bool:
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def virtual_pipeline_size(self, num_layers: int, pipeline_parallel: int) -> int | None:
        """Model chunks per pipeline rank (None: plain 1F1B); ValueError naming the flags
        megatron would refuse (`megatron_rl.model.stages.virtual_stage_size`)."""
        from megatron_rl.model.stages import virtual_stage_size

        return virtual_stage_size(
            num_layers,
            pipeline_parallel,
            self.virtual_stages,
            self.layers_per_virtual_stage,
            uneven=self.uneven_stages,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
