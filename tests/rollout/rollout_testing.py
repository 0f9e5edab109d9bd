"""Shared helpers for the rollout tests: a tiny random HF Qwen3-MoE and direct references."""

from __future__ import annotations

import time

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_rl.model import preset_config
from megatron_rl.model.conversion.safetensors_io import CheckpointReader
from megatron_rl.rollout import InProcessEngine, InProcessEngineConfig

PROMPTS = [[5, 17, 33, 2], [101, 7], [9, 9, 250, 301, 44, 12]]


def tiny_config(**overrides) -> Qwen3MoeConfig:
    config = preset_config("tiny", **overrides)
    config._attn_implementation = "eager"
    return config


def random_hf_model(config: Qwen3MoeConfig, seed: int = 0) -> Qwen3MoeForCausalLM:
    """A random model whose routers are random too (HF initialises them to zeros: ties)."""
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.normal_(0.0, 0.5)
    return model


def make_engine(seed: int = 0, **config_kwargs) -> InProcessEngine:
    overrides = config_kwargs.pop("model_overrides", {})
    return InProcessEngine(
        random_hf_model(tiny_config(**overrides), seed), InProcessEngineConfig(**config_kwargs)
    )


def wait_for(predicate, what: str, limit_s: float = 120.0, poll_s: float = 0.02) -> None:
    """Poll ``predicate()`` until it holds; AssertionError naming ``what`` after ``limit_s``
    (generous: a guard against a hang on a loaded machine, not a measurement)."""
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {limit_s} s")
        time.sleep(poll_s)


def checkpoint_tensors(model: Qwen3MoeForCausalLM, folder) -> list[tuple[str, torch.Tensor]]:
    """The (checkpoint name, tensor) pairs ``save_pretrained`` writes (per-expert names)."""
    model.save_pretrained(folder)
    with CheckpointReader(folder) as reader:
        return [(name, reader.get(name)) for name in reader.names()]


@torch.no_grad()
def direct_logprobs(
    model: Qwen3MoeForCausalLM, prompt: list[int], response: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """float32 [R]: log softmax(logits / T) of each response token, one unpadded forward."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0].float()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@torch.no_grad()
def direct_routes(model: Qwen3MoeForCausalLM, token_ids: list[int]) -> torch.Tensor:
    """int64 [T, L, K]: each MoE layer's top-k for an unpadded forward, from the router weights.

    Recomputed from the hidden states entering each gate (softmax, top-k), not from the gate's
    own output, so the capture hook is checked against an independent computation.
    """
    inputs: list[torch.Tensor] = []
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    handles = [g.register_forward_hook(lambda m, a, o: inputs.append(a[0].detach())) for g in gates]
    model(input_ids=torch.tensor([token_ids]))
    for handle in handles:
        handle.remove()
    per_layer = []
    for gate, hidden in zip(gates, inputs, strict=True):
        probs = torch.softmax(hidden.float() @ gate.weight.float().T, dim=-1)
        per_layer.append(torch.topk(probs, gate.top_k, dim=-1).indices)
    return torch.stack(per_layer, dim=1)
