"""megatron-core without Transformer Engine, on any device (the local layer spec).

megatron-core 0.16.1's ``moe_utils`` imports ``te_general_gemm`` and the ``fused_*`` MoE kernels
from its Transformer Engine extension inside a ``try`` whose ``except ImportError`` defines none
of them, then tests ``te_general_gemm is not None`` in the router's gating linear: without TE
every MoE forward raises ``NameError``, on CUDA exactly as on CPU (seen on an H200 with the local
spec). `define_missing_te_symbols` binds each missing name to ``None``, the value megatron's own
fallbacks test for (``torch.mm`` gating, unfused permute). 0.19 defines them itself.
"""

from __future__ import annotations

import importlib

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"

TE_SYMBOLS_OF_MOE_UTILS = (
    "fused_compute_score_for_moe_aux_loss",
    "fused_moe_aux_loss",
    "fused_permute",
    "fused_permute_with_probs",
    "fused_sort_chunks_by_index",
    "fused_sort_chunks_by_index_with_probs",
    "fused_topk_with_score_function",
    "fused_unpermute",
    "te_general_gemm",
)


def define_missing_te_symbols() -> list[str]:
    """Bind each TE symbol ``moe_utils`` lacks to None; returns the names it bound (idempotent)."""
    moe_utils = importlib.import_module(MOE_UTILS)
    missing = [name for name in TE_SYMBOLS_OF_MOE_UTILS if not hasattr(moe_utils, name)]
    for name in missing:
        setattr(moe_utils, name, None)
    return missing
