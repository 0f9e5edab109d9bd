"""Hugging Face `Qwen3MoeConfig` / `DeepseekV3Config` / `Glm4MoeConfig` -> megatron-core
`TransformerConfig` (`MLATransformerConfig` for DeepSeek-V3, see `megatron_rl.model.deepseek_v3`;
GLM-4.5 in `megatron_rl.model.glm4_moe`).

Parallel sizes are read from megatron-core's ``parallel_state`` (initialise it first, see
`megatron_rl.backend.init_distributed`); this module only states the architecture.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from transformers import Qwen3MoeConfig

from megatron_rl.model.deepseek_v3 import deepseek_v3_fields
from megatron_rl.model.glm4_moe import glm4_moe_fields
from megatron_rl.model.options import ModelOptions
from megatron_rl.model.presets import model_family
from megatron_rl.model.stages import megatron_stage_layers, virtual_chunk_layers
from megatron_rl.moe_layers import moe_layer_pattern

# apex's CUDA extension behind megatron's gradient-accumulation fusion in its own linear layers
# (``tensor_parallel/layers.py``: the output layer is one even with Transformer Engine)
GRAD_ACCUM_FUSION_MODULE = "fused_weight_gradient_mlp_cuda"

logger = logging.getLogger(__name__)


@functools.cache
def grad_accum_fusion_available() -> bool:
    """Whether apex's ``fused_weight_gradient_mlp_cuda`` can be imported (checked once, logged).

    megatron builds the output layer as its own ``ColumnParallelLinear`` even with Transformer
    Engine, and that layer raises at construction when the fusion is on without the kernel; TE
    alone (the ``[gpu]`` extra) does not provide it."""
    found = importlib.util.find_spec(GRAD_ACCUM_FUSION_MODULE) is not None
    if not found:
        logger.info(
            "gradient_accumulation_fusion off: apex's %s is not installed (its fusion saves one "
            "gradient copy per linear layer; build apex with --cuda_ext to enable it)",
            GRAD_ACCUM_FUSION_MODULE,
        )
    return found


def shared_expert_size(hf_config: Qwen3MoeConfig) -> int | None:
    """Shared-expert FFN size when the config has shared experts (Qwen2-MoE style), else None."""
    size = getattr(hf_config, "shared_expert_intermediate_size", None)
    return int(size) if size else None


def qwen3_moe_fields(hf_config: Qwen3MoeConfig, has_moe: bool) -> dict[str, Any]:
    """The `TransformerConfig` keyword arguments that state the Qwen3-MoE architecture."""
    shared = shared_expert_size(hf_config)
    return dict(
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=getattr(hf_config, "head_dim", None)
        or (hf_config.hidden_size // hf_config.num_attention_heads),
        qk_layernorm=True,
        add_qkv_bias=bool(getattr(hf_config, "attention_bias", False)),
        num_moe_experts=hf_config.num_experts if has_moe else None,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size,
        moe_router_score_function="softmax",
        # HF: softmax over all experts, top-k, renormalise iff norm_topk_prob. Megatron without
        # pre-softmax takes the softmax over the top-k logits, which is the renormalised form.
        moe_router_pre_softmax=not hf_config.norm_topk_prob,
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=shared is not None,
    )


def to_transformer_config(
    hf_config: Qwen3MoeConfig, options: ModelOptions, *, use_te: bool
) -> TransformerConfig:
    """The `TransformerConfig` matching ``hf_config`` under the current ``parallel_state``."""
    if hf_config.hidden_act != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r}: only 'silu' (SwiGLU) is supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported; set it to False")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    sequence_parallel = tp > 1 if options.sequence_parallel is None else options.sequence_parallel
    dtype = options.torch_dtype
    pattern = moe_layer_pattern(hf_config)
    has_moe = any(pattern)
    family = model_family(hf_config)
    if family == "deepseek_v3":
        config_class, extra = MLATransformerConfig, deepseek_v3_fields(hf_config)
    elif family == "glm4_moe":
        config_class, extra = TransformerConfig, glm4_moe_fields(hf_config)
    else:
        config_class, extra = TransformerConfig, qwen3_moe_fields(hf_config, has_moe)
    if options.recompute:
        extra.update(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp > 1:  # megatron's schedule: stages exchange [s, b, h] activations of varying shapes
        try:  # megatron asserts deep in its layer builder; say which flags to change instead
            megatron_stage_layers(
                hf_config.num_hidden_layers,
                pp,
                options.first_stage_layers,
                options.last_stage_layers,
            )
            vp = options.virtual_pipeline_size(hf_config.num_hidden_layers, pp)
            if vp is not None:
                virtual_chunk_layers(
                    hf_config.num_hidden_layers,
                    pp,
                    vp,
                    options.first_stage_layers,
                    options.last_stage_layers,
                )
        except ValueError as error:
            raise ValueError(
                f"pipeline parallel size {pp}: {error}; choose --pipeline-model-parallel-size, "
                "--decoder-first/last-pipeline-num-layers or the virtual pipeline size so that "
                "the layers split"
            ) from error
        extra.update(
            virtual_pipeline_model_parallel_size=vp,
            pipeline_dtype=dtype,
            variable_seq_lengths=True,
            num_layers_in_first_pipeline_stage=options.first_stage_layers,
            num_layers_in_last_pipeline_stage=options.last_stage_layers,
        )
    elif options.first_stage_layers is not None or options.last_stage_layers is not None:
        raise ValueError("first_stage_layers / last_stage_layers need pipeline parallel size > 1")
    else:
        options.virtual_pipeline_size(hf_config.num_hidden_layers, pp)  # refuses VP at PP 1
    return config_class(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=hf_config.initializer_range,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        moe_router_topk=hf_config.num_experts_per_tok,
        moe_layer_freq=pattern,
        moe_router_load_balancing_type="aux_loss" if options.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=options.aux_loss_coeff,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type=options.token_dispatcher,
        # grouped experts: TEGroupedMLP with TE; without it the spec's legacy GroupedMLP, which
        # the builder replaces by TorchGroupedMLP (megatron_rl/model/grouped_experts.py)
        moe_grouped_gemm=options.moe_grouped_gemm and has_moe,
        moe_enable_routing_replay=options.routing_replay,
        # Fusions need Transformer Engine (or apex): on with TE, off on the local path.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        # megatron fuses MLA's rope only for YaRN
        apply_rope_fusion=use_te and config_class is not MLATransformerConfig,
        moe_permute_fusion=use_te,
        gradient_accumulation_fusion=use_te and grad_accum_fusion_available(),
        persist_layer_norm=False,
        **extra,
    )
