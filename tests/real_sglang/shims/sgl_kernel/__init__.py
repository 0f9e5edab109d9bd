"""Test-only stand-in for the ``sgl_kernel`` extension (PyPI ``sglang-kernel``), for SGLang
0.5.23 on a CPU: the PyPI wheel is CUDA-only and the CPU build is not on PyPI.

What it stands in for, in the installed ``sglang`` package (line numbers of 0.5.23):

* ``sglang/srt/mem_cache/allocation.py`` line 46 imports ``assign_req_to_token_pool_cpu`` at
  module level when ``is_cpu()``; ``assign_req_to_token_pool_func`` (line 737) calls it (line
  746) instead of the Triton kernel ``assign_req_to_token_pool`` (line 692). It is the only
  kernel the torch-native CPU path (no AMX) calls at run time: implemented below with that
  Triton kernel's semantics.
* ``sglang/kernels/ops/kvcache/cache_move.py`` line 10 imports ``copy_all_layer_kv_cache_cpu``
  at module level when ``is_cpu()``; other modules import further names lazily. Every name but
  the one above resolves (module ``__getattr__``) to a function that raises NotImplementedError
  naming itself when called, so a path that needs a real kernel fails loudly. (SGLang's CPU
  model files also probe ``torch.ops.sgl_kernel.*``: no ops are registered here, so those raise
  AttributeError at import and SGLang's model registry skips those models, e.g. grok, qwen3_5.)

Put the folder holding this package on the server's ``PYTHONPATH`` only (tests/real_sglang).
"""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] = `` the i-th
    consecutive slice of ``out_cache_loc`` (slices of lengths ``end - start`` in request order).

    ``pool_len`` (``req_to_token.shape[1]``) is the row stride the C++/Triton kernels need.
    """
    del pool_len
    starts, ends = start_offset.tolist(), end_offset.tolist()
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), starts, ends, strict=True):
        req_to_token[row, start:end] = out_cache_loc[offset : offset + end - start]
        offset += end - start


def __getattr__(name: str):
    if name.startswith("__"):  # keep Python's own probes (__path__, __file__, ...) working
        raise AttributeError(name)

    def missing_kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: tests/real_sglang/shims/sgl_kernel stands in "
            "for the CUDA-only sglang-kernel wheel and implements only "
            "assign_req_to_token_pool_cpu"
        )

    missing_kernel.__name__ = name
    return missing_kernel
