"""The CPU grouped GEMM kernel (`megatron_rl.kernels.grouped_gemm`) against torch._grouped_mm,
bit for bit: products, output strides and gradients."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.kernels import grouped_gemm
from megatron_rl.kernels.grouped_gemm import grouped_mm, kernel_ready


def _groups(generator, experts: int, most: int, case: int) -> torch.Tensor:
    """int32 group ends: random sizes, with empty groups or all one-row groups in some cases."""
    counts = torch.randint(0, most, (experts,), generator=generator)
    if case % 5 == 0:
        counts[::3] = 0
    if case % 7 == 0:
        counts[:] = 1
    return counts.cumsum(0).to(torch.int32)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.stride() == want.stride()
    assert torch.equal(got, want)


def test_the_kernel_is_built_and_loaded_here():
    """CI builds it at install (`make`); a missing compiler would silently cost the speed."""
    assert kernel_ready()
    assert hasattr(torch.ops.megatron_rl, "grouped_mm")


@pytest.mark.parametrize("case", range(40))
def test_products_are_bitwise_torchs_grouped_products(case):
    """Rows grouped (x @ W^T as the experts' forward, dY @ W as their input gradient) and the
    inner dimension grouped (X^T @ dY, dY^T @ X: the weight gradients), every layout the experts
    use, against torch._grouped_mm on the same tensors: values and output strides."""
    g = torch.Generator().manual_seed(case)
    experts = int(torch.randint(1, 70, (1,), generator=g))
    inner = 16 * int(torch.randint(1, 5, (1,), generator=g))
    cols = 8 * int(torch.randint(1, 9, (1,), generator=g))
    offs = _groups(g, experts, 40, case)
    rows = int(offs[-1])
    x = torch.randn(rows, inner, generator=g)
    w = torch.randn(experts, cols, inner, generator=g)
    dy = torch.randn(rows, cols, generator=g)
    for a, b in [(x, w.transpose(1, 2)), (dy, w), (x.t(), dy), (dy.t(), x)]:
        _same(grouped_mm(a, b, offs), torch._grouped_mm(a, b, offs=offs))
        _same(torch.ops.megatron_rl.grouped_mm(a, b, offs), torch._grouped_mm(a, b, offs=offs))


@pytest.mark.parametrize("case", range(12))
def test_gradients_are_bitwise_those_of_torchs_grouped_product(case):
    """Of a dense upstream gradient; and of an expanded one (``out.sum()``, stride 0, which
    torch._grouped_mm's backward refuses) as torch's of the same gradient made dense."""
    g = torch.Generator().manual_seed(100 + case)
    experts = int(torch.randint(1, 65, (1,), generator=g))
    offs = _groups(g, experts, 30, case)
    x = torch.randn(int(offs[-1]), 64, generator=g)
    w = torch.randn(experts, 48, 64, generator=g)
    dy = torch.randn(int(offs[-1]), 48, generator=g)
    grads = []
    for fn in (grouped_mm, lambda a, b, o: torch._grouped_mm(a, b, offs=o)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xi, wi.transpose(1, 2), offs)
        out.backward(dy)
        grads.append((out.detach(), xi.grad, wi.grad))
        xi.grad = wi.grad = None
        out = fn(xi, wi.transpose(1, 2), offs)
        if fn is grouped_mm:
            out.sum().backward()
        else:
            out.backward(torch.ones_like(out))
        grads[-1] += (xi.grad, wi.grad)
    for ours, torchs in zip(*grads, strict=True):
        assert torch.equal(ours, torchs)


def test_the_kernel_runs_the_experts_forward_and_backward(monkeypatch):
    calls = []
    real = grouped_gemm._GroupedProduct.apply
    monkeypatch.setattr(
        grouped_gemm._GroupedProduct, "apply", lambda *a: calls.append(1) or real(*a)
    )
    x = torch.randn(10, 16, requires_grad=True)
    w = torch.randn(3, 8, 16, requires_grad=True)
    grouped_mm(x, w.transpose(1, 2), torch.tensor([2, 2, 10], dtype=torch.int32)).sum().backward()
    assert calls == [1] and x.grad is not None and w.grad is not None


def test_other_dtypes_and_layouts_take_torchs_kernel(monkeypatch):
    """bf16, and a gradient through a contiguous ``b`` (a layout whose gradients were not
    checked bitwise), are torch._grouped_mm's own."""
    monkeypatch.setattr(grouped_gemm._GroupedProduct, "apply", None)  # would raise if used
    offs = torch.tensor([3, 5], dtype=torch.int32)
    a = torch.randn(5, 16, dtype=torch.bfloat16)
    b = torch.randn(2, 16, 8, dtype=torch.bfloat16)
    assert torch.equal(grouped_mm(a, b, offs), torch._grouped_mm(a, b, offs=offs))
    af, bf = a.float().requires_grad_(), b.float().requires_grad_()
    out = grouped_mm(af, bf, offs)
    out.backward(torch.ones_like(out))
    assert bf.grad.shape == bf.shape


def test_aten_chosen_by_environment_skips_the_kernel(monkeypatch):
    monkeypatch.setenv("MEGATRON_RL_CPU_GROUPED_GEMM", "aten")
    assert grouped_gemm._load() is False


def test_a_failed_build_warns_and_falls_back(monkeypatch, tmp_path):
    """No library to load and a build that fails: one warning naming the cause, torch's kernel."""
    monkeypatch.setattr(grouped_gemm, "build_folder", lambda: tmp_path / "none")
    monkeypatch.setattr(grouped_gemm.torch.ops, "megatron_rl", object())  # nothing loaded yet

    def fail():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(grouped_gemm, "build", fail)
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler.*torch._grouped_mm runs instead"):
        assert grouped_gemm._load() is False


def test_bad_offsets_are_refused_by_name():
    a, b = torch.randn(4, 16), torch.randn(2, 16, 8)
    with pytest.raises(RuntimeError, match="bad offs"):
        torch.ops.megatron_rl.grouped_mm(a, b, torch.tensor([3, 9], dtype=torch.int32))
