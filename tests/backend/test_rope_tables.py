"""megatron's unfused RoPE through `megatron_rl.backend.rope_tables`: bitwise what megatron's
``_apply_rotary_pos_emb_bshd`` computes, with its cos/sin tables taken once per ``freqs``."""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron_rl.backend import rope_tables
from megatron_rl.model import ModelOptions, build_model, preset_config
from megatron_rl.model.builder import causal_lm_logits


def _megatron_bshd():
    rope_tables.use_rope_tables()
    return rope_tables._MEGATRON["bshd"]


def _rotated_with_grads(fn, t, k, freqs, mscale):
    t, k = t.detach().requires_grad_(), k.detach().requires_grad_()
    q_out, k_out = fn(t, freqs, mscale=mscale), fn(k, freqs, mscale=mscale)
    weights = torch.linspace(-1, 1, q_out.numel()).view_as(q_out)
    ((q_out * weights).sum() + k_out.square().sum()).backward()
    return q_out.detach(), k_out.detach(), t.grad, k.grad


@pytest.mark.parametrize("rot_dim", [16, 8], ids=["whole_head", "partial_rotary"])
@pytest.mark.parametrize("mscale", [1.0, 1.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_bshd_is_bitwise_megatrons(rot_dim, mscale, dtype):
    """Query and key through one shared ``freqs`` (the second call reuses the tables): outputs
    and input gradients equal megatron's bit for bit."""
    megatron = _megatron_bshd()
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(7, 3, 4, 16, generator=gen).to(dtype)
    k = torch.randn(7, 3, 2, 16, generator=gen).to(dtype)
    freqs = torch.randn(7, 1, 1, rot_dim, generator=gen)
    ours = _rotated_with_grads(rope_tables.rotary_bshd, t, k, freqs, mscale)
    theirs = _rotated_with_grads(megatron, t, k, freqs, mscale)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_tables_are_recomputed_for_new_or_changed_freqs():
    _megatron_bshd()
    t = torch.randn(5, 2, 2, 8)
    freqs = torch.randn(5, 1, 1, 8)
    first = rope_tables.rotary_bshd(t, freqs)
    freqs.mul_(2.0)  # in place: a new version of the same tensor
    assert torch.equal(rope_tables.rotary_bshd(t, freqs), _megatron_bshd()(t, freqs))
    other = torch.randn(5, 1, 1, 8)
    assert torch.equal(rope_tables.rotary_bshd(t, other), _megatron_bshd()(t, other))
    assert not torch.equal(first, rope_tables.rotary_bshd(t, other))


def test_other_cases_go_to_megatrons_function(monkeypatch):
    _megatron_bshd()
    seen = []
    monkeypatch.setitem(rope_tables._MEGATRON, "bshd", lambda *a: seen.append(a[2:]) or "mcore")
    t, freqs = torch.randn(3, 1, 2, 8), torch.randn(3, 1, 1, 8)
    assert rope_tables.rotary_bshd(t, freqs, True) == "mcore"  # interleaved
    assert rope_tables.rotary_bshd(t, freqs, False, True) == "mcore"  # MLA
    assert rope_tables.rotary_bshd(t, freqs.requires_grad_()) == "mcore"
    assert seen == [(True, False, 1.0), (False, True, 1.0), (False, False, 1.0)]


def _logits_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = causal_lm_logits(model, tokens)
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("preset", ["tiny", "tiny-mismatch"])
def test_model_logits_and_gradients_are_bitwise_megatrons(ws1, preset, monkeypatch):
    model = build_model(preset_config(preset), ModelOptions())
    rope = importlib.import_module(rope_tables.ROPE)
    assert rope._apply_rotary_pos_emb_bshd is rope_tables.rotary_bshd
    tokens = torch.randint(0, 500, (5, 9), generator=torch.Generator().manual_seed(0))
    tables = []
    real_tables = rope_tables._tables
    monkeypatch.setattr(rope_tables, "_tables", lambda *a: tables.append(1) or real_tables(*a))
    ours, our_grads = _logits_and_grads(model, tokens)
    assert tables  # the table path ran (a query and a key per layer)
    monkeypatch.setattr(rope, "_apply_rotary_pos_emb_bshd", rope_tables._MEGATRON["bshd"])
    theirs, their_grads = _logits_and_grads(model, tokens)
    assert torch.equal(ours, theirs)
    assert len(our_grads) == len(their_grads)
    for a, b in zip(our_grads, their_grads, strict=True):
        assert torch.equal(a, b)
