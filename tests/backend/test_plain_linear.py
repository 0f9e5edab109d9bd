"""megatron's local linear layers through `megatron_rl.backend.plain_linear` at TP 1 on the CPU:
bitwise what megatron's own autograd function computes."""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron_rl.backend import plain_linear
from megatron_rl.model import ModelOptions, build_model, preset_config
from megatron_rl.model.builder import causal_lm_logits


def _logits_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = causal_lm_logits(model, tokens)
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("preset", ["tiny", "tiny-dense-tied", "tiny-mismatch"])
def test_plain_linear_is_bitwise_megatrons_linear_function(ws1, preset, monkeypatch):
    """Logits and every parameter gradient (attention projections, dense MLP, tied or separate
    output layer) equal megatron's autograd function's bit for bit."""
    model = build_model(preset_config(preset), ModelOptions())
    layers = importlib.import_module(plain_linear.LAYERS)
    assert layers.linear_with_grad_accumulation_and_async_allreduce is plain_linear.linear_at_tp1
    tokens = torch.randint(0, 500, (5, 9), generator=torch.Generator().manual_seed(0))
    calls = []
    real = plain_linear.F.linear
    monkeypatch.setattr(plain_linear.F, "linear", lambda *a: calls.append(1) or real(*a))
    plain, plain_grads = _logits_and_grads(model, tokens)
    assert calls  # the plain path ran
    monkeypatch.setattr(
        layers,
        "linear_with_grad_accumulation_and_async_allreduce",
        plain_linear._MEGATRON["linear"],
    )
    megatron, megatron_grads = _logits_and_grads(model, tokens)
    assert torch.equal(plain, megatron)
    assert len(plain_grads) == len(megatron_grads)
    for a, b in zip(plain_grads, megatron_grads, strict=True):
        assert torch.equal(a, b)


def test_megatrons_function_runs_under_the_name_it_reads_its_warning_flag_from(ws1):
    """megatron's function reads ``<its global name>.warned``; with `linear_at_tp1` installed
    under that name, a tensor-parallel call (here ``allreduce_dgrad`` over one rank) still runs."""
    build_model(preset_config("tiny"), ModelOptions())  # installs linear_at_tp1
    x = torch.randn(3, 2, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    out = plain_linear.linear_at_tp1(x, w, None, False, True, False)
    out.sum().backward()
    assert torch.allclose(out, x @ w.t()) and w.grad is not None


def test_tensor_parallel_flags_go_to_megatrons_function(monkeypatch):
    seen = []
    monkeypatch.setitem(plain_linear._MEGATRON, "linear", lambda *a: seen.append(a[3:6]) or "mcore")
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    for flags in [(True, False, False), (False, True, False), (False, False, True)]:
        assert plain_linear.linear_at_tp1(x, w, None, *flags) == "mcore"
    assert seen == [(True, False, False), (False, True, False), (False, False, True)]
    assert torch.equal(plain_linear.linear_at_tp1(x, w, None, False, False, False), x @ w.t())
