"""Which decoder layers of a HF MoE config are mixture-of-experts layers (the HF rules).

Qwen3-MoE: layer ``i`` (0-based) is sparse when it is not in ``mlp_only_layers``, the model has
experts (``num_experts > 0``) and ``(i + 1) % decoder_sparse_step == 0``.
DeepSeek-V3 and GLM-4.5 (a config with ``first_k_dense_replace``): layer ``i`` is sparse when
``i >= first_k_dense_replace`` and the model has routed experts (``n_routed_experts > 0``).
One rule for the model builder, the weight-name mapping, routing replay and the rollout clients.
Plain Python on the config's attributes: importable without transformers or megatron-core.
"""

from __future__ import annotations


def num_routed_experts(hf_config) -> int:
    """Routed experts per MoE layer: ``num_experts`` (Qwen3-MoE) or ``n_routed_experts``
    (DeepSeek-V3, GLM-4.5); 0 for a dense model."""
    count = getattr(hf_config, "num_experts", None)
    if count is None:
        count = getattr(hf_config, "n_routed_experts", None)
    return int(count or 0)


def moe_layer_pattern(hf_config) -> list[int]:
    """Per layer, 1 for a sparse (MoE) layer and 0 for a dense one."""
    has_experts = num_routed_experts(hf_config) > 0
    first_k_dense = getattr(hf_config, "first_k_dense_replace", None)
    if first_k_dense is not None:
        return [int(has_experts and i >= first_k_dense) for i in range(hf_config.num_hidden_layers)]
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or [])
    return [
        int(i not in dense and has_experts and (i + 1) % step == 0)
        for i in range(hf_config.num_hidden_layers)
    ]


def moe_layer_numbers(hf_config) -> list[int]:
    """Megatron's 1-based layer numbers of the MoE layers (dense layers left out)."""
    return [i + 1 for i, sparse in enumerate(moe_layer_pattern(hf_config)) if sparse]
