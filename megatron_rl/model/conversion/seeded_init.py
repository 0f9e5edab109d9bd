"""A random initialisation defined by HF tensor names, so every parallel layout gets one model.

megatron-core initialises each rank's parameters from the generator state it happens to reach:
a pipeline stage draws its first layer where PP = 1 drew the embedding, tensor-parallel shards
are drawn per TP rank, expert-parallel ranks draw their local experts from one stream. A seeded
run from random weights is therefore a different run at every layout (PP = 2 trained another
model than PP = 1: grad norm 1.0004 against 0.9029 at the first step of the same batch).

Here each HF tensor is drawn whole from its own generator, seeded by (seed, name), and every rank
copies its shard of it through the checkpoint loader (`copy_full_tensors`). The weights are then
a function of the seed alone: the same for any TP / PP / EP / CP split and either experts module.

The distributions are megatron-core's (``TransformerConfig`` defaults, σ = ``init_method_std`` =
the HF ``initializer_range``, L = number of layers):
- norms (``*norm.weight``, ``*_layernorm.weight``): 1;
- biases: 0;
- output projections (``o_proj``, ``down_proj``, experts' and shared expert's): N(0, σ / sqrt(2L))
  (megatron's ``scaled_init_method_normal``);
- every other weight (embedding, LM head, q/k/v, gate/up, router, shared-expert gate): N(0, σ).
"""

from __future__ import annotations

import logging
import math
import zlib

import torch
from transformers import Qwen3MoeConfig

from megatron_rl.model.conversion.load import copy_full_tensors
from megatron_rl.model.conversion.names import TensorMap
from megatron_rl.model.conversion.transforms import fuse, hf_shape
from megatron_rl.model.presets import load_hf_config

logger = logging.getLogger(__name__)

_SCALED = ("o_proj.weight", "down_proj.weight")


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of HF tensor ``name``: stable across processes and Python versions."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def init_std(name: str, cfg: Qwen3MoeConfig) -> float | None:
    """σ of the normal draw of ``name``; None for the constant tensors (norms 1, biases 0)."""
    if name.endswith("bias") or name.endswith("norm.weight"):
        return None
    std = float(cfg.initializer_range)
    if name.endswith(_SCALED):
        return std / math.sqrt(2.0 * cfg.num_hidden_layers)
    return std


def seeded_hf_tensor(name: str, cfg: Qwen3MoeConfig, seed: int) -> torch.Tensor:
    """The fp32 initial value of HF tensor ``name`` (shape `hf_shape`) for ``seed``."""
    shape = hf_shape(name, cfg)
    std = init_std(name, cfg)
    if std is None:
        fill = 0.0 if name.endswith("bias") else 1.0
        return torch.full(shape, fill, dtype=torch.float32)
    generator = torch.Generator().manual_seed(tensor_seed(seed, name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)


def init_from_seed(model: torch.nn.Module, hf_config, seed: int) -> None:
    """Overwrite this rank's shard of ``model`` with the layout-independent initial weights.

    Each rank draws only the tensors its shard needs, one whole tensor at a time.
    """
    cfg = load_hf_config(hf_config)

    def full_tensor(tmap: TensorMap) -> torch.Tensor:
        return fuse(tmap, [seeded_hf_tensor(name, cfg, seed) for name in tmap.hf], cfg)

    count = copy_full_tensors(model, cfg, full_tensor)
    logger.info("initialised %d tensors from seed %d (layout-independent)", count, seed)
