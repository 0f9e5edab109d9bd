"""The plan's activation estimates: the per-layer formula, the stored activations with and
without recompute, and the local spec's attention matrices against megatron's
DotProductAttention and a CPU trace of its code."""

from __future__ import annotations

import pytest
import torch
from memory_plan_testing import F_MOE, D, E, H, make_layout
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.memory_plan import (
    ModelShape,
    PlanOptions,
    attention_bytes,
    layer_activation_bytes,
    load_model_config,
    plan_memory,
    stage_params,
    stored_activations,
)


def test_activation_estimate_formula_and_recompute():
    config = load_model_config("qwen3-30b-a3b")
    layout = make_layout(16, tensor_parallel=2, expert_parallel=8)
    options = PlanOptions(micro_batch_tokens=18432)
    shape = ModelShape.from_hf(config)
    terms = layer_activation_bytes(shape, layout, options, moe=True)
    s, t, a = 18432, 9216, 2
    q, kv = 32 * D // 2, 4 * D // 2
    assert terms["norms"] == 4 * t * H * a
    # QKV out + q/k-norm out + rotated q, k and v + attention out + fp32 log-sum-exp
    qkv, qk, attn_in, out = (q + 2 * kv), (q + kv), (q + 2 * kv), q
    assert terms["attention"] == s * a * (qkv + qk + attn_in + out) + 4 * s * 16
    assert terms["router"] == 4 * t * (H + 2 * E)
    assert terms["experts"] == t * 8 * (2 * H + 3 * F_MOE) * a
    layer = sum(terms.values())
    # the stored activations are a timeline now (issue 22): at the end of the forward, the
    # layer inputs (full recompute) or every layer (none), + the final norm; a recomputed layer's
    # backward adds that layer's activations. The old single "activations" term was the sum.
    params = stage_params(shape, layout, 0)
    full = stored_activations(shape, layout, options, params)
    assert full.end == 48 * t * H * a + 2 * t * H * a
    assert full.recomputed == full.end + layer
    none_options = PlanOptions(micro_batch_tokens=18432, recompute="none")
    none = stored_activations(shape, layout, none_options, params)
    assert none.end == 48 * layer + 2 * t * H * a
    assert none.recomputed == 0
    # at the last layer's attention its MLP part is not stored (yet / any more), nor the final norm
    mlp = terms["router"] + terms["experts"]
    assert none.attention == 48 * layer - mlp
    assert not plan_memory(config, layout, none_options).fits  # 48 layers at 18k: not in 80 GiB


def test_local_spec_keeps_the_unfused_attention_matrices():
    """`layer_activation_bytes` of the local spec: the kernel keeps GQA-expanded k and v (every
    query head) and no log-sum-exp, and each layer keeps its [heads, s, s] probabilities."""
    shape = ModelShape.from_hf(load_model_config("qwen3-30b-a3b"))
    layout = make_layout(16, tensor_parallel=2, expert_parallel=8)
    te = layer_activation_bytes(shape, layout, PlanOptions(micro_batch_tokens=4096), moe=True)
    options = PlanOptions(micro_batch_tokens=4096, spec="local")
    local = layer_activation_bytes(shape, layout, options, moe=True)
    s, a, q, kv = 4096, 2, 32 * D // 2, 4 * D // 2
    assert local["attention"] - te["attention"] == s * a * (3 * q - (q + 2 * kv)) - 4 * s * 16
    assert local["attention probabilities"] == attention_bytes(shape, layout, options).saved
    assert "attention probabilities" not in te


def test_attention_terms_follow_megatrons_dot_product_attention():
    """bf16: per layer fp32 P + bf16 P + the [s, s] bool mask kept; the bf16 global scores buffer
    kept once; at a layer's softmax cast the scores and their fp32 copy on top (6 B), at its
    softmax backward P, dP and dscores in fp32 (12 B) instead of the saved 6 B. fp32 has no copy
    and no cast. TE's fused attention has no [s, s] tensor."""
    shape = ModelShape.from_hf(load_model_config("qwen3-30b-a3b"))
    layout = make_layout(2, tensor_parallel=2)
    s, n = 4096, 16  # 32 heads over TP 2
    A = 2 * n * (s // 2) ** 2  # two sequences of 2,048 tokens
    bf16 = attention_bytes(
        shape, layout, PlanOptions(micro_batch_tokens=s, micro_batch_sequences=2, spec="local")
    )
    assert (bf16.elements, bf16.saved, bf16.persistent) == (A, 6 * A + (s // 2) ** 2, 2 * A)
    assert (bf16.forward, bf16.backward, bf16.excess) == (6 * A, 6 * A, 4 * A)
    assert bf16.saved - (s // 2) ** 2 + bf16.backward == 12 * A  # three fp32 [b n, s, s]
    fp32_options = PlanOptions(params_dtype="float32", micro_batch_tokens=s, spec="local")
    fp32 = attention_bytes(shape, layout, fp32_options)
    A = n * s * s
    assert (fp32.saved, fp32.persistent, fp32.forward, fp32.backward) == (
        4 * A + s * s,
        4 * A,
        4 * A,
        8 * A,
    )
    te = attention_bytes(shape, layout, PlanOptions(micro_batch_tokens=s))
    q, kv = 32 * D // 2, 4 * D // 2
    assert (te.saved, te.persistent, te.forward, te.excess) == (0, 0, 0, 0)
    assert te.backward == s * (q + 2 * kv) * 2  # dq, dk, dv
    with pytest.raises(ValueError, match="no context parallelism"):
        plan_memory(shape, make_layout(2, context_parallel=2), PlanOptions(spec="local"))


class _SquareTensorBytes(TorchDispatchMode):
    """Bytes of live storages created (not viewed) under this mode whose tensors end in ``[s, s]``:
    the attention matrices and masks; the peak before and after ``mark_backward()``."""

    def __init__(self, s: int) -> None:
        super().__init__()
        self.s, self.live, self.peaks, self.phase = s, {}, [0, 0], 0

    def mark_backward(self) -> None:
        self.phase = 1

    @property
    def nbytes(self) -> int:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        return sum(nbytes for _, nbytes in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            for tensor in pytree.tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.shape[-2:] == (self.s, self.s):
                    ref = StorageWeakRef(tensor.untyped_storage())
                    self.live.setdefault(ref.cdata, (ref, tensor.untyped_storage().nbytes()))
        self.peaks[self.phase] = max(self.peaks[self.phase], self.nbytes)
        return out


def test_local_attention_terms_match_a_cpu_trace_of_megatrons_code(ws1):
    """The tiny bf16 model on the local spec (megatron-core's own DotProductAttention and
    softmax): every [.., s, s] storage its forward and backward create, followed op by op, gives
    exactly `attention_bytes`'s saved / forward / backward counts. (The H200's measured excess is
    on top of these; the persistent scores buffer exists from the first, no-grad forward.)"""
    from megatron_rl.model import ModelOptions, build_model
    from megatron_rl.train.logprobs import forward_logits

    config = load_model_config("tiny")
    options = ModelOptions(dtype="bfloat16", local_attention="unfused")
    model = build_model(config, options, spec="local")
    s = 96  # not the vocabulary (512), hidden (64) or a head's width
    tokens = torch.randint(0, config.vocab_size, (1, s), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        forward_logits(model, tokens)  # megatron allocates its global scores buffer here
    tracker = _SquareTensorBytes(s)
    with tracker:
        logits = forward_logits(model, tokens)
        after_forward = tracker.nbytes
        tracker.mark_backward()
        logits.float().square().mean().backward()
    options = PlanOptions(micro_batch_tokens=s, spec="local")
    att = attention_bytes(ModelShape.from_hf(config), make_layout(), options)
    layers = config.num_hidden_layers
    assert after_forward == layers * att.saved
    assert tracker.peaks[0] == layers * att.saved + att.forward  # the last layer's softmax cast
    assert tracker.peaks[1] == layers * att.saved + att.backward  # its softmax backward
    print("saved per layer", att.saved, "peaks", tracker.peaks)
