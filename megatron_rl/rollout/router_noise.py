"""Noise in the engine's router: a train/inference routing mismatch that training cannot erase.

Numeric mismatches fade on the embedded model: with bf16 or FP8 serving (`fp8_weights`) the
engine and the fp32 trainer pick different top-k sets on 19% (FP8) of token-layers at
initialisation, but the router's logits spread out within ~10 steps and the disagreement falls
below 1% (docs/study.md). A real engine's kernels (fused top-k, batch-dependent reductions,
quantized GEMMs) keep disagreeing at trained weights, which is what routing replay is for.

`RouterNoise` stands in for them: a forward hook on each MoE layer's router adds Gaussian noise
to every token's logits before the top-k, scaled by that token's own logit spread,

    z'_e = z_e + sigma * std_e(z) * eps_e,      eps ~ N(0, 1) i.i.d. per token and expert,

then recomputes the router's output as transformers' ``Qwen3MoeTopKRouter`` does (softmax in
fp32, top-k, renormalised when ``norm_topk_prob``). Scaling by the spread keeps the fraction of
flipped choices roughly constant as training sharpens the router, so ``sigma`` sets the
mismatch. The returned logits are the clean ones (they only feed the auxiliary loss). Draws come
from the hook's own generator (seeded), so they do not move the sampling's random stream.
"""

from __future__ import annotations

import torch

from megatron_rl.rollout.route_capture import moe_gates


class RouterNoise:
    """Installs the noise hooks on ``model``'s routers; `remove` takes them off.

    Install before any `RouteCapture` so that captured routes are the noisy ones the engine
    used (forward hooks run in registration order).
    """

    def __init__(self, model: torch.nn.Module, sigma: float, seed: int = 0) -> None:
        if not (sigma > 0 and sigma < float("inf")):
            raise ValueError(f"router noise sigma={sigma!r}: must be a finite number > 0")
        self.sigma = float(sigma)
        self.gates = moe_gates(model)
        if not self.gates:
            raise ValueError("router noise: the model has no MoE layer (no mlp.gate)")
        self.generator = torch.Generator().manual_seed(seed)
        self._handles = [gate.register_forward_hook(self._hook) for gate in self.gates]

    def _hook(self, module, args, output):
        logits_TE, _, indices_TK = output
        z = logits_TE.float()
        eps = torch.randn(z.shape, generator=self.generator).to(z.device)
        noisy = z + self.sigma * z.std(dim=-1, keepdim=True) * eps
        top_TK, indices_TK = torch.topk(noisy.softmax(dim=-1), indices_TK.shape[-1], dim=-1)
        if module.norm_topk_prob:
            top_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
        return logits_TE, top_TK.to(logits_TE.dtype), indices_TK

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
