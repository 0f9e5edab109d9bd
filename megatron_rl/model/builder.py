"""Build the megatron-core `GPTModel` of a Qwen3-MoE, DeepSeek-V3 or GLM-4.5 config; run it as a
causal LM.

Layer spec: Transformer Engine on CUDA (an error naming the fix when TE is missing, unless the
local spec is asked for), the local (megatron-core only) spec on CPU. With TE, megatron's TE
fusions are on (rope, MoE permute, gradient-accumulation into ``main_grad``). Both specs hold the
same weights; `conversion.names` maps either set of parameter names to the HF names.

Experts: grouped GEMMs unless ``ModelOptions.moe_grouped_gemm`` is off: Transformer Engine's
``TEGroupedMLP`` with TE, `TorchGroupedMLP` (torch's grouped matmul, weights stacked per layer)
on the local spec; off, megatron's ``SequentialMLP`` (one MLP per expert, a Python loop).

Placement: megatron's layers allocate on ``torch.cuda.current_device()``, but the local spec's
norms (``torch.nn.RMSNorm``) allocate on the CPU; megatron's own ``get_model`` moves the whole
module with ``.cuda()``, and so does `build_model`, which then checks that every parameter and
buffer is on the compute device.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from transformers import Qwen3MoeConfig

from megatron_rl.backend import cuda_available
from megatron_rl.backend.chunk_sort import use_gather_chunk_sort
from megatron_rl.backend.norm import SequenceParallelTorchNorm, swap_module_in_spec
from megatron_rl.backend.plain_linear import use_plain_linear
from megatron_rl.backend.rope_tables import use_rope_tables
from megatron_rl.backend.without_te import define_missing_te_symbols
from megatron_rl.model.chunks import ModelChunks
from megatron_rl.model.config import ModelOptions, to_transformer_config
from megatron_rl.model.glm4_moe import rotary_percent
from megatron_rl.model.grouped_experts import TorchGroupedMLP
from megatron_rl.model.mla_attention import (
    MLADotProductAttention,
    shard_mla_kv_down_proj_grads,
    without_te_mla,
)
from megatron_rl.model.presets import load_hf_config, model_family
from megatron_rl.model.rope import rope_theta
from megatron_rl.model.router_padding import mask_padding_in_expert_bias
from megatron_rl.model.sdpa_attention import SdpaDotProductAttention
from megatron_rl.moe_layers import num_routed_experts

logger = logging.getLogger(__name__)

SPECS = ("auto", "local", "te")


def te_available() -> bool:
    """Transformer Engine importable and the process computing on CUDA."""
    if not cuda_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_spec(spec: str) -> str:
    """ "auto" -> "te" on CUDA, "local" on CPU; validates the name and the installation.

    On CUDA, "auto" without Transformer Engine is an error: the local spec would run unfused
    ``S x S`` attention and one GEMM per expert (out of memory at 16k tokens on an 80 GB GPU).
    Ask for ``spec="local"`` to accept that.
    """
    if spec not in SPECS:
        raise ValueError(f"spec={spec!r}: choose one of {SPECS}")
    if spec == "auto" and not cuda_available():
        return "local"
    if spec in ("auto", "te") and not te_available():
        raise ValueError(
            "CUDA without Transformer Engine: install it (pip install -e '.[gpu]', i.e. "
            "transformer-engine[pytorch]) or choose the local spec explicitly "
            "(--transformer-impl local / spec='local': unfused attention, looped experts, far "
            "more activation memory)"
            if spec == "auto"
            else "spec='te' needs Transformer Engine and CUDA; use spec='local'"
        )
    return "te" if spec == "auto" else spec


def build_model(
    hf_config: Qwen3MoeConfig | str | os.PathLike,
    options: ModelOptions | None = None,
    *,
    spec: str | None = None,
) -> GPTModel | ModelChunks:
    """The megatron-core GPTModel of ``hf_config`` for this rank's pipeline stage and shards
    (its `ModelChunks` under interleaved pipeline parallelism).

    ``parallel_state`` must be initialised (`megatron_rl.backend.init_distributed`). Weights are
    randomly initialised; load them with `megatron_rl.model.conversion.load_hf_checkpoint`.
    ``spec`` overrides ``options.spec`` (see `resolve_spec`).
    """
    hf_config = load_hf_config(hf_config)
    options = options or ModelOptions()
    use_te = resolve_spec(options.spec if spec is None else spec) == "te"
    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    if hf_config.vocab_size % tp:
        raise ValueError(f"vocab_size={hf_config.vocab_size} is not divisible by TP={tp}")
    if hf_config.num_key_value_heads % tp:
        raise ValueError(
            f"num_key_value_heads={hf_config.num_key_value_heads} not divisible by TP={tp}"
        )
    if num_routed_experts(hf_config) % ep:
        raise ValueError(f"num_experts={num_routed_experts(hf_config)} is not divisible by EP={ep}")
    config = to_transformer_config(hf_config, options, use_te=use_te)
    vp = config.virtual_pipeline_model_parallel_size
    # megatron's stage predicates and interleaved schedule read the virtual size from here
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vp)
    if vp is None:
        model = build_chunk(hf_config, options, config, use_te, None)
    else:
        model = ModelChunks([build_chunk(hf_config, options, config, use_te, c) for c in range(vp)])
    device = compute_device()
    if device.type == "cuda":
        model.cuda(device)
    check_placement(model, device)
    logger.info(
        "built %s-spec GPTModel: %d local parameters",
        "te" if use_te else "local",
        sum(p.numel() for p in model.parameters()),
    )
    return model


def build_chunk(hf_config, options: ModelOptions, config, use_te: bool, vp_stage: int | None):
    """One `GPTModel`: this rank's pipeline stage, or its chunk ``vp_stage`` of an interleaved
    pipeline (its layers per `megatron_rl.model.stages.virtual_chunk_layers`)."""
    with warnings.catch_warnings():  # "legacy GroupedMLP will be deprecated": it is replaced
        warnings.filterwarnings("ignore", message="The legacy GroupedMLP")
        block_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage
        )
    if not use_te:
        define_missing_te_symbols()
        use_gather_chunk_sort()  # the dispatcher's unfused chunk sort as one gather
        use_plain_linear()  # the local linears' autograd function as F.linear at TP 1 on CPU
        use_rope_tables()  # the unfused RoPE's cos/sin once per freqs, not per call
        block_spec = swap_module_in_spec(block_spec, WrappedTorchNorm, SequenceParallelTorchNorm)
        block_spec = swap_module_in_spec(block_spec, GroupedMLP, TorchGroupedMLP)
        if config.multi_latent_attention:  # local attention with MLA's head sizes
            without_te_mla()
            block_spec = swap_module_in_spec(
                block_spec, DotProductAttention, MLADotProductAttention
            )
        elif local_attention(options) == "sdpa":  # causal attention as one fused kernel
            block_spec = swap_module_in_spec(
                block_spec, DotProductAttention, SdpaDotProductAttention
            )
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope",
        # unused with MLA, whose attention builds its own rope (YaRN too: deepseek_v3.yarn_fields)
        rotary_base=rope_theta(
            hf_config, ("default", "yarn") if config.multi_latent_attention else ("default",)
        ),
        # GLM-4.5 rotates the first part of each head only (see megatron_rl.model.glm4_moe)
        rotary_percent=rotary_percent(hf_config) if model_family(hf_config) == "glm4_moe" else 1.0,
    )
    if config.multi_latent_attention:
        shard_mla_kv_down_proj_grads(model)  # k_rope's gradient under TP (see mla_attention)
    mask_padding_in_expert_bias(model)  # padded tokens out of the bias counts (router_padding)
    return model


def local_attention(options: ModelOptions) -> str:
    """``options.local_attention`` resolved: ``auto`` is sdpa on the CPU, unfused on CUDA."""
    if options.local_attention != "auto":
        return options.local_attention
    return "unfused" if compute_device().type == "cuda" else "sdpa"


def compute_device() -> torch.device:
    """Where this process's model lives: the current CUDA device, or the CPU backend's CPU."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_placement(model: torch.nn.Module, device: torch.device) -> None:
    """Raise naming the parameters/buffers of ``model`` that are not on ``device``."""
    stray = [
        f"{name} ({tensor.device})"
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
        if tensor.device != device
    ]
    if stray:
        raise RuntimeError(
            f"{len(stray)} model tensors are not on the compute device {device}: "
            f"{', '.join(stray[:5])}{' ...' if len(stray) > 5 else ''}; move the module after "
            "building it (build_model does) or build it under the device's context"
        )


def causal_lm_logits(model: GPTModel, input_ids_BT: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [B, T, V] (gathered over tensor parallel) for token ids [B, T].

    The attention is causal over each row; positions are 0..T-1.
    """
    batch, seq = input_ids_BT.shape
    position_ids_BT = torch.arange(seq, device=input_ids_BT.device).expand(batch, seq)
    logits_BTv = model(input_ids=input_ids_BT, position_ids=position_ids_BT, attention_mask=None)
    return gather_from_tensor_model_parallel_region(logits_BTv)
