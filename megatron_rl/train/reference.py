"""The frozen reference policy of the KL term, and where its weights live between uses.

``--kl-coef > 0`` needs ``log pi_ref`` of every response token once per RL step (in the
old-logprob pass). The reference is a second copy of the initial policy (same layout and shards,
no routing replay, no gradients), i.e. the policy's parameter bytes again on every GPU (about
4-8 GiB per GPU for Qwen3-30B-A3B on the 32-GPU launcher's layout; ``megatron-rl plan``
counts it). With ``offload`` (the default) its weights stay in host memory and visit the compute
device only for the duration of its own pass (`ReferencePolicy.resident`), so the update
passes, which hold gradients, optimizer state and activations, never see them. On a CPU-only run
both places are the CPU and nothing moves. The pass runs like the policy's old-logprob pass
(`megatron_rl.train.merged_pass.forward_only_pass`: micro-batches merged into forwards of at most
``max_tokens`` padded tokens, on one stage or through megatron's pipeline schedule).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron_rl.routing.passes import ReplayPasses
from megatron_rl.train.batch import MicroBatch
from megatron_rl.train.logprobs import token_logprobs
from megatron_rl.train.merged_pass import forward_only_pass

FREE_ROUTING = ReplayPasses()  # the reference routes freely


class ReferencePolicy:
    """``logprobs(micro_batches)`` of a frozen model; call it inside ``with resident():``."""

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
    def logprobs(
        self,
        micro_batches: list[MicroBatch],
        temperature: float,
        *,
        max_tokens: int = 0,
        group=None,
    ) -> list[torch.Tensor | None]:
        """Per micro-batch ``[b, s - 1]`` ``log pi_ref`` of ``tokens[:, 1:]`` (see
        `token_logprobs`), on the last pipeline stage (None on the others). ``max_tokens`` and
        ``group``: see `forward_only_pass` (0: one forward per micro-batch)."""
        if not self._resident:
            raise RuntimeError("the reference weights are offloaded: use `with resident():`")
        refs: list[torch.Tensor | None] = [None] * len(micro_batches)

        def on_logits(k: int, logits: torch.Tensor) -> None:
            refs[k] = token_logprobs(logits, micro_batches[k].tokens_BS, temperature)

        keys = list(range(len(micro_batches)))
        forward_only_pass(
            self.model,
            micro_batches,
            keys,
            FREE_ROUTING,
            on_logits,
            max_tokens=max_tokens,
            group=group,
        )
        return refs
