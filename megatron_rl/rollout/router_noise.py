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
fp32, top-k, renormalised when ``norm_topk_prob``); DeepSeek-V3's router (sigmoid scores,
score-correction bias, group-limited top-k) is refused with a ValueError naming the flag.
Scaling by the spread keeps the fraction of flipped choices roughly constant as training
sharpens the router, so ``sigma`` sets the mismatch. The returned logits are the clean ones
(they only feed the auxiliary loss).

Each draw is a pure function of (``seed``, the sample's identity, the token's position, the
layer, the expert): a counter-based hash (Wellons' ``lowbias32``, in int64 tensor arithmetic
that never overflows) picks one of 2**16 equiprobable N(0, 1) quantiles,
``eps = Phi^-1((i + 1/2) / 2**16)`` (|eps| <= 4.2). Nothing depends on the batch, its padding
or its chunking, and the sampling's random stream is untouched. The engine names the rows of
each forward with `RouterNoise.rows` (a sample's sampling seed); a forward outside it uses the
batch row index. Positions are the forward's ``position_ids`` (else the cache length onwards).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence

import torch

from megatron_rl.rollout.route_capture import moe_gates

_MASK32 = 0xFFFFFFFF
_LEVELS = 1 << 16  # quantiles in the noise table; a hash's top 16 bits pick one


def _mul32(x, c: int):
    """``(x * c) mod 2**32`` for ``x < 2**32`` (int or int64 tensor), in two 16-bit halves so
    no intermediate reaches 2**63."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def mix32(x):
    """Wellons' ``lowbias32`` avalanche hash of 32-bit ``x`` (int or int64 tensor)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sample_key(seed: int, identity: int) -> int:
    """The 32-bit noise key of the sample ``identity`` under noise ``seed``."""
    digest = hashlib.blake2b(f"{int(seed)},{int(identity)}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def gaussian_table(levels: int = _LEVELS) -> torch.Tensor:
    """float32 [levels]: the N(0, 1) quantiles ``Phi^-1((i + 1/2) / levels)``."""
    u = (torch.arange(levels, dtype=torch.float64) + 0.5) / levels
    return torch.special.ndtri(u).float()


class RouterNoise:
    """Installs the noise hooks on ``model``'s routers; `remove` takes them off.

    Install before any `RouteCapture` so that captured routes are the noisy ones the engine
    used (forward hooks run in registration order).
    """

    def __init__(self, model: torch.nn.Module, sigma: float, seed: int = 0) -> None:
        if not (sigma > 0 and sigma < float("inf")):
            raise ValueError(f"router noise sigma={sigma!r}: must be a finite number > 0")
        self.sigma = float(sigma)
        self.seed = int(seed)
        self.gates = moe_gates(model)
        if not self.gates:
            raise ValueError("router noise: the model has no MoE layer (no mlp.gate)")
        if hasattr(self.gates[0], "e_score_correction_bias"):
            raise ValueError(
                f"--rollout-router-noise={sigma!r} (InProcessEngineConfig.router_noise) supports "
                f"the softmax top-k router only; {type(self.gates[0]).__name__} (sigmoid scores, "
                "score-correction bias, group-limited top-k) is not implemented: use 0"
            )
        self.generator = torch.Generator().manual_seed(self.seed)  # keys of unseeded samples
        self._table = gaussian_table()
        num_experts = int(self.gates[0].num_experts)
        experts_E = torch.arange(num_experts, dtype=torch.int64)
        # one salt per (layer, expert), so each layer and expert hashes differently
        self._salts_LE = torch.stack(
            [mix32(experts_E ^ mix32(layer + 0x9E3779B9)) for layer in range(len(self.gates))]
        )
        self._keys_B: torch.Tensor | None = None  # set by `rows`
        self._token_hash_BS: torch.Tensor | None = None  # set per forward call
        self._handles = [model.model.register_forward_pre_hook(self._see_call, with_kwargs=True)]
        self._handles.append(model.model.register_forward_hook(self._end_call))
        for layer, gate in enumerate(self.gates):
            self._handles.append(gate.register_forward_hook(self._hook_for(layer)))

    @contextlib.contextmanager
    def rows(self, identities: Sequence[int | None]) -> Iterator[None]:
        """Forward calls inside draw row ``b``'s noise from sample ``identities[b]``; a None
        identity gets a fresh key from this noise's own seeded generator."""
        keys = [
            sample_key(self.seed, ident)
            if ident is not None
            else int(torch.randint(0, _MASK32 + 1, (1,), generator=self.generator))
            for ident in identities
        ]
        previous, self._keys_B = self._keys_B, torch.tensor(keys, dtype=torch.int64)
        try:
            yield
        finally:
            self._keys_B = previous

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Inside `rows`: later forward calls hold only the rows at positions ``keep`` (the
        engine drops finished rows); each keeps its own identity, so its noise is unchanged."""
        if self._keys_B is None:
            raise RuntimeError("RouterNoise.keep_rows outside RouterNoise.rows")
        self._keys_B = self._keys_B[keep]

    def _see_call(self, module, args, kwargs) -> None:
        """Pre-hook of the decoder: hash each token's (sample key, position) once per call."""
        del module
        positions_BS = kwargs.get("position_ids")
        if positions_BS is None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            shape = ids.shape if ids is not None else kwargs["inputs_embeds"].shape[:2]
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            past = cache.get_seq_length() if cache is not None else 0
            positions_BS = torch.arange(past, past + shape[1]).expand(shape[0], -1)
        positions_BS = positions_BS.to(device="cpu", dtype=torch.int64)
        batch = positions_BS.shape[0]
        keys_B = self._keys_B
        if keys_B is None:
            keys_B = torch.tensor([sample_key(self.seed, b) for b in range(batch)])
        elif keys_B.numel() != batch:
            raise RuntimeError(
                f"router noise: {keys_B.numel()} row identities for a forward of {batch} rows"
            )
        self._token_hash_BS = mix32(keys_B[:, None] ^ mix32(positions_BS & _MASK32))

    def _end_call(self, module, args, output) -> None:
        self._token_hash_BS = None

    def _hook_for(self, layer: int):
        def hook(module, args, output):
            return self._noisy_output(layer, module, output)

        return hook

    def _noisy_output(self, layer: int, module, output):
        logits_TE, _, indices_TK = output
        hash_BS = self._token_hash_BS
        if hash_BS is None or hash_BS.numel() != logits_TE.shape[0]:
            raise RuntimeError(
                "router noise: a router ran outside a forward of the model the noise was "
                "installed on, or on another number of tokens"
            )
        index_TE = mix32(hash_BS.reshape(-1, 1) ^ self._salts_LE[layer]) >> 16
        z = logits_TE.float()
        eps = self._table[index_TE].to(z.device)
        noisy = z + self.sigma * z.std(dim=-1, keepdim=True) * eps
        top_TK, indices_TK = torch.topk(noisy.softmax(dim=-1), indices_TK.shape[-1], dim=-1)
        if module.norm_topk_prob:
            top_TK = top_TK / top_TK.sum(dim=-1, keepdim=True)
        return logits_TE, top_TK.to(logits_TE.dtype), indices_TK

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
