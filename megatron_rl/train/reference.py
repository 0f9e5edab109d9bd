"""The frozen reference policy of the KL term, and where its weights live between uses.

``--kl-coef > 0`` needs ``log pi_ref`` of every response token once per RL step (in the
old-logprob pass). The reference is a second copy of the initial policy (same layout and shards,
no routing replay, no gradients), i.e. the policy's parameter bytes again on every GPU (about
4-8 GiB per GPU for Qwen3-30B-A3B on the 32-GPU launcher's layout; ``tools/memory_plan.py``
counts it). With ``offload`` (the default) its weights stay in host memory and visit the compute
device only for the duration of the old-logprob pass (`ReferencePolicy.resident`), so the update
passes, which hold gradients, optimizer state and activations, never see them. On a CPU-only run
both places are the CPU and nothing moves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron_rl.train.logprobs import forward_logits, token_logprobs


class ReferencePolicy:
    """``logprobs(tokens)`` of a frozen model; call it inside ``with resident():``."""

    def __init__(self, model: torch.nn.Module, device: torch.device, *, offload: bool) -> None:
        self.model = model.eval().requires_grad_(False)
        self.device = torch.device(device)
        self.offload = offload and self.device.type != "cpu"
        self._resident = not self.offload
        if self.offload:
            self.model.to("cpu")

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Bring the weights to the compute device for the block (a no-op without offload)."""
        if not self.offload:
            yield
            return
        self.model.to(self.device)
        self._resident = True
        try:
            yield
        finally:
            self.model.to("cpu")
            self._resident = False

    @torch.no_grad()
    def logprobs(self, tokens_BS: torch.Tensor, temperature: float) -> torch.Tensor:
        """``[b, s - 1]`` ``log pi_ref`` of ``tokens[:, 1:]`` (see `token_logprobs`)."""
        if not self._resident:
            raise RuntimeError("the reference weights are offloaded: use `with resident():`")
        return token_logprobs(forward_logits(self.model, tokens_BS), tokens_BS, temperature)
