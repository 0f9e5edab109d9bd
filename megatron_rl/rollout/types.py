"""Data that crosses the rollout boundary: sampling parameters, samples, engine health.

Routed-expert alignment (R3), the contract every engine honours:

A sample's full sequence is ``prompt_ids + response_ids`` (length ``S = P + R``). The engine
processes (feeds through the model) positions ``0 .. S - 2``; the final response token is sampled
but never fed back. ``RolloutSample.routes`` therefore holds ``S - 1`` rows ``[S - 1, L, K]``:
row ``i`` is the top-k expert set that each of the ``L`` MoE layers chose for the token at
position ``i`` (whose output predicts token ``i + 1``). This is SGLang's
``routed_experts`` with ``routed_experts_start_len = 0``. A trainer that runs its forward pass on
the first ``S - 1`` tokens (inputs) to score tokens ``1 .. S - 1`` (labels) can replay row ``i``
at input position ``i`` with no shift; when it feeds all ``S`` tokens it must drop (or not
replay) the last position, which no engine routed.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megatron_rl.routing import RoutingBlob

FINISH_REASONS = ("stop", "length", "abort")
# how bf16 serving multiplies (`megatron_rl.rollout.fp32_matmuls`): auto, torch's bf16 kernels, or
# bf16 operands through fp32 kernels with one rounding
BF16_MATMULS = ("auto", "native", "fp32")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SamplingParams:
    """Per-batch sampling parameters (SGLang's ``sampling_params`` subset used for RL).

    ``temperature == 0`` is greedy. ``top_k = -1`` and ``top_p = 1`` disable those filters.
    ``seed``: with the same seed, prompts, ``n`` and weights an engine returns the same samples;
    the in-process engine derives one generator per (prompt, sample) from it, so a sample does not
    depend on what else is in the batch. ``None``: non-deterministic.
    ``return_sampling_support`` (SGLang's ``return_sampling_mask``): every response token comes
    with the ids of the support it was drawn from (``RolloutSample.support_RK``) and its log-prob
    under that renormalised support instead of the full vocabulary (`megatron_rl.rollout.
    sampling`). It needs a finite ``top_k``, which bounds the support (SGLang rejects the request
    otherwise; 1 for greedy).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    return_sampling_support: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"SamplingParams.temperature={self.temperature!r}: must be finite and >= 0 "
                "(0 is greedy)"
            )
        if not (0 < self.top_p <= 1):
            raise ValueError(f"SamplingParams.top_p={self.top_p!r}: must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"SamplingParams.top_k={self.top_k!r}: use an int >= 1, or -1 (off)")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens={self.max_new_tokens!r}: must be an int >= 1"
            )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"SamplingParams.stop_token_ids={self.stop_token_ids!r}: must be ints >= 0"
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed={self.seed!r}: must be an int or None")
        if self.return_sampling_support and (
            self.top_k == -1 or (self.temperature == 0 and self.top_k != 1)
        ):
            raise ValueError(
                f"SamplingParams.top_k={self.top_k!r} with return_sampling_support: set a finite "
                "top_k (e.g. 512; 1 when temperature is 0), which bounds each token's support "
                "(SGLang accepts top_k up to its --sampling-mask-max-tokens)"
            )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def to_sglang(self) -> dict:
        """The ``sampling_params`` payload of SGLang's ``/generate`` (one sample per request)."""
        payload = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            "n": 1,
        }
        return payload


@dataclasses.dataclass(kw_only=True, slots=True)
class RolloutSample:
    """One generated sample.

    Attributes:
        prompt_index: index of its prompt in the batch; samples of one prompt form a group.
        sample_index: 0 .. n-1 within the group.
        prompt_ids_P: int64 [P].
        response_ids_R: int64 [R], R >= 1, including a stop token when one ended it.
        logprobs_R: float32 [R], the engine's log-prob of each response token (see
            `megatron_rl.rollout.sampling` for the temperature convention).
        finish_reason: "stop" (a stop token), "length" (max_new_tokens) or "abort".
        weight_version: the oldest engine weight version that produced a token of it (the
            only one, unless it spans an update).
        weight_versions: per segment of response tokens, ``(version, start, end)`` (token
            indices ``[start, end)``), as SGLang reports them (``meta_info.weight_versions``)
            when a request outlives a weight update; empty when the engine does not report them.
        routes: None, or a `RoutingBlob` of ``num_tokens = P + R - 1`` rows ``[P + R - 1, L, K]``
            (see the module docstring for the alignment), encoded with the engine's
            `RoutingCodec`.
        support_RK: None, or int32 ``[R, K]``: row ``j`` holds the ids of the sampling support
            response token ``j`` was drawn from, in descending probability, padded with -1 to the
            sample's largest support ``K`` (``SamplingParams.return_sampling_support``); then
            ``logprobs_R`` are log-probs under those renormalised supports.
    """

    prompt_index: int
    sample_index: int
    prompt_ids_P: torch.Tensor
    response_ids_R: torch.Tensor
    logprobs_R: torch.Tensor
    finish_reason: str
    weight_version: int
    weight_versions: tuple[tuple[int, int, int], ...] = ()
    routes: RoutingBlob | None = None
    support_RK: torch.Tensor | None = None

    @property
    def num_routed_positions(self) -> int:
        """Rows the routes must hold: every position but the last, ``P + R - 1``."""
        return self.prompt_ids_P.numel() + self.response_ids_R.numel() - 1

    def check(self, *, num_moe_layers: int | None = None, values: bool = True) -> None:
        """RuntimeError naming this sample if a field breaks the contract above (``values``
        False: all but the log-probs' values, which `check_samples` checks in one pass)."""
        name = f"sample (prompt {self.prompt_index}, sample {self.sample_index})"
        num_response = self.response_ids_R.numel()
        if num_response < 1:
            raise RuntimeError(f"{name}: empty response")
        if self.logprobs_R.shape != (num_response,):
            raise RuntimeError(
                f"{name}: {self.logprobs_R.numel()} logprobs for {num_response} response tokens"
            )
        if values:
            self._check_logprob_values(name)
        if self.support_RK is not None:
            check_support(self.support_RK, self.response_ids_R, name)
        if self.finish_reason not in FINISH_REASONS:
            raise RuntimeError(
                f"{name}: finish_reason {self.finish_reason!r} not in {FINISH_REASONS}"
            )
        if self.routes is not None:
            if self.routes.num_tokens != self.num_routed_positions:
                raise RuntimeError(
                    f"{name}: routes cover {self.routes.num_tokens} positions, expected "
                    f"prompt {self.prompt_ids_P.numel()} + response {num_response} - 1 = "
                    f"{self.num_routed_positions}"
                )
            if num_moe_layers is not None and self.routes.num_layers != num_moe_layers:
                raise RuntimeError(
                    f"{name}: routes have {self.routes.num_layers} MoE layers, the model has "
                    f"{num_moe_layers}"
                )

    def _check_logprob_values(self, name: str) -> None:
        if not bool(torch.isfinite(self.logprobs_R).all()):
            bad = int((~torch.isfinite(self.logprobs_R)).nonzero()[0])
            raise RuntimeError(
                f"{name}: non-finite logprob {float(self.logprobs_R[bad])} at response token {bad}"
            )
        if bool((self.logprobs_R > 1e-4).any()):
            raise RuntimeError(f"{name}: positive logprob {float(self.logprobs_R.max())}")


def check_support(support_RK: torch.Tensor, response_ids_R: torch.Tensor, name: str) -> None:
    """RuntimeError naming ``name`` unless ``support_RK`` is int32 ``[R, K >= 1]`` with every
    response token in its own row and only -1 after a row's last id."""
    num_response = response_ids_R.numel()
    if (
        support_RK.dtype != torch.int32
        or support_RK.dim() != 2
        or support_RK.shape[0] != (num_response)
    ):
        raise RuntimeError(
            f"{name}: support_RK is {support_RK.dtype} {tuple(support_RK.shape)}, expected "
            f"int32 [{num_response}, K]: one support row per response token"
        )
    present_RK = support_RK >= 0
    if support_RK.shape[1] == 0 or bool((present_RK[:, 1:] & ~present_RK[:, :-1]).any()):
        raise RuntimeError(f"{name}: support_RK rows must start with >= 1 id, -1 only after")
    inside_R = (support_RK == response_ids_R[:, None].to(torch.int32)).any(dim=1)
    if not bool(inside_R.all()):
        j = int((~inside_R).nonzero()[0])
        raise RuntimeError(
            f"{name}: response token {j} (id {int(response_ids_R[j])}) is not in its sampling "
            f"support {support_RK[j][present_RK[j]].tolist()[:8]}"
        )


def pad_supports(rows: list[torch.Tensor]) -> torch.Tensor:
    """int32 ``[len(rows), max size]``: 1-D id rows stacked, padded with -1 on the right."""
    if not rows:
        return torch.full((0, 1), -1, dtype=torch.int32)
    rows = [row.to(torch.int32) for row in rows]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1)


def check_samples(samples: list[RolloutSample], *, num_moe_layers: int | None = None) -> None:
    """`RolloutSample.check` of every sample, the log-probs' values in one pass over all of them
    (a failing batch is re-checked sample by sample, so the error names the first bad one)."""
    for sample in samples:
        sample.check(num_moe_layers=num_moe_layers, values=False)
    if not samples:
        return
    logprobs = torch.cat([s.logprobs_R for s in samples])
    if not bool(torch.isfinite(logprobs).all()) or bool((logprobs > 1e-4).any()):
        for sample in samples:
            sample.check(num_moe_layers=num_moe_layers)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class EngineHealth:
    """What `RolloutEngine.health` reports."""

    healthy: bool
    weight_version: int
    detail: str = ""
