"""Grouped fp32 products on the CPU without ATen's per-group dispatch: `grouped_mm`.

``torch._grouped_mm`` on the CPU loops over the groups inside ATen, and each group costs an
``item``, two ``slice``s, a ``select`` and an ``mm_out``, each through the dispatcher: ~1.9 us a
group against ~2-3 us of arithmetic for an expert of 28 tokens at hidden size 64. The experts
of a MoE layer are such groups (`megatron_rl.model.grouped_experts`, the engine's
`megatron_rl.rollout.fp32_matmuls`), 64 of them in each of 6 products per layer and update.

``grouped_gemm_cpu.cpp`` walks the groups in C++ and calls MKL's ``sgemm_`` with the arguments
ATen's ``addmm`` derives for each group's product (its transposes and leading dimensions,
`cpublas`' normalisation), on the same pointers, so each product is computed by the same kernel:
the results are bitwise ``torch._grouped_mm``'s, and so are the gradients of `grouped_mm`
(``dA = grouped(dY, B^T)``, ``dB^T = grouped(dY^T, A)``: the products ATen's autograd forms for
the layouts used here). Tested over random group sizes, empty and one-row groups and both
operand layouts, with ``torch._grouped_mm`` as the reference.

The library is built once per torch version and source with torch's extension builder (ninja and
the system C++ compiler; ``make`` builds it at install) into ``<sys.prefix>/megatron_rl-kernels``
(``MEGATRON_RL_KERNEL_DIR`` overrides), and later processes only load it. Where it cannot be
built or loaded (no compiler, a torch without MKL), `grouped_mm` is ``torch._grouped_mm`` after
one warning; ``MEGATRON_RL_CPU_GROUPED_GEMM=aten`` chooses that on purpose (benchmarks).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import warnings
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("grouped_gemm_cpu.cpp")
_STATE: dict[str, bool] = {}


def library_name() -> str:
    """The library's name: its source's and torch's version in it (a stale build never loads)."""
    digest = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()
    return f"megatron_rl_grouped_gemm_{digest[:12]}"


def build_folder() -> Path:
    """Where the library is built (and looked for)."""
    root = os.environ.get("MEGATRON_RL_KERNEL_DIR") or Path(sys.prefix) / "megatron_rl-kernels"
    return Path(root) / library_name()


def build() -> Path:
    """Build (or bring up to date) the library and load it; its path."""
    from torch.utils import cpp_extension  # setuptools and friends: only when building

    folder = build_folder()
    folder.mkdir(parents=True, exist_ok=True)
    # the extension builder runs ``ninja`` from PATH; pip puts it beside this interpreter
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    logger.info("building the CPU grouped GEMM kernel in %s (once per torch version)", folder)
    cpp_extension.load(
        name=library_name(),
        sources=[str(SOURCE)],
        build_directory=str(folder),
        extra_cflags=["-O2"],
        is_python_module=False,
        verbose=False,
    )
    return folder / f"{library_name()}.so"


def kernel_ready() -> bool:
    """Whether ``torch.ops.megatron_rl.grouped_mm`` is loaded (built first if needed)."""
    if "ready" not in _STATE:
        _STATE["ready"] = _load()
    return _STATE["ready"]


def _load() -> bool:
    if os.environ.get("MEGATRON_RL_CPU_GROUPED_GEMM", "auto") == "aten":
        return False
    if hasattr(torch.ops.megatron_rl, "grouped_mm"):
        return True
    path = build_folder() / f"{library_name()}.so"
    try:
        if path.exists():
            torch.ops.load_library(str(path))
        else:
            build()
        return True
    except Exception as err:  # any build or load failure: torch's kernel instead
        warnings.warn(
            f"the CPU grouped GEMM kernel could not be built or loaded ({type(err).__name__}: "
            f"{err}); torch._grouped_mm runs instead (the same results, more time per expert)",
            stacklevel=3,
        )
        return False


class _GroupedProduct(torch.autograd.Function):
    """``grouped(A, B)`` for ``A`` [T, K] and ``B`` [G, K, N] with ``B``'s stride(-2) 1 (a
    transposed weight), its gradients as ``torch._grouped_mm``'s autograd computes them."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        return torch.ops.megatron_rl.grouped_mm(a, b, offs)

    @staticmethod
    def backward(ctx, grad):
        a, b, offs = ctx.saved_tensors
        if not _row_or_column_major(grad):  # e.g. expanded: ATen copies such a group contiguous
            grad = grad.contiguous()
        op = torch.ops.megatron_rl.grouped_mm
        grad_a = op(grad, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
        grad_b = op(grad.t(), a, offs).transpose(-2, -1) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b, None


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``, bitwise, through the C++ kernel where it applies:
    fp32 CPU operands, ``a`` [T, K] with rows grouped by ``offs`` (int32 ends) and ``b`` [G, K, N],
    or ``a`` [M, T] and ``b`` [T, N] with the inner dimension grouped (no gradient). Elsewhere
    (CUDA, bf16, other layouts or ranks) torch's own."""
    usable = (
        a.device.type == "cpu"
        and a.dtype == torch.float32
        and b.dtype == torch.float32
        and offs.dtype == torch.int32
        and a.dim() == 2
        and b.dim() in (2, 3)
        and _row_or_column_major(a)
        and _row_or_column_major(b)
    )
    if not usable or not kernel_ready():
        return torch._grouped_mm(a, b, offs=offs)
    if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        if b.dim() != 3 or b.stride(-2) != 1:  # gradients checked for this layout only
            return torch._grouped_mm(a, b, offs=offs)
        return _GroupedProduct.apply(a, b, offs)
    return torch.ops.megatron_rl.grouped_mm(a, b, offs)


def _row_or_column_major(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 or t.stride(-2) == 1


if __name__ == "__main__":  # `make` builds the library at install: python -m ...grouped_gemm
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("built %s", build())
