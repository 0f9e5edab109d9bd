"""Which decoder layers of a HF Qwen3-MoE config are mixture-of-experts layers (the HF rule).

Layer ``i`` (0-based) is sparse when it is not in ``mlp_only_layers``, the model has experts
(``num_experts > 0``) and ``(i + 1) % decoder_sparse_step == 0``. One rule for the model builder,
the weight-name mapping, routing replay and the rollout clients. Plain Python on the config's
attributes: importable without transformers or megatron-core.
"""

from __future__ import annotations


def moe_layer_pattern(hf_config) -> list[int]:
    """Per layer, 1 for a sparse (MoE) layer and 0 for a dense one."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    has_experts = int(getattr(hf_config, "num_experts", 0) or 0) > 0
    return [
        int(i not in dense and has_experts and (i + 1) % step == 0)
        for i in range(hf_config.num_hidden_layers)
    ]


def moe_layer_numbers(hf_config) -> list[int]:
    """Megatron's 1-based layer numbers of the MoE layers (dense layers left out)."""
    return [i + 1 for i, sparse in enumerate(moe_layer_pattern(hf_config)) if sparse]
