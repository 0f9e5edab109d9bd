"""The embedded rollout engine: transformers' Qwen3-MoE on CPU (or GPU), batched, KV-cached.

Rows (prompt, sample) are left-padded into batches of at most ``max_batch_size``; one prefill
and then one KV-cached decoding step per new token. Rows that finished keep being fed (their
extra tokens are dropped) until every row of the batch is done. Stopping: a token in
``stop_token_ids`` (kept as the last response token, finish reason "stop") or
``max_new_tokens`` ("length"); like SGLang with ``ignore_eos``, the model's own EOS token is not
special, pass it in ``stop_token_ids``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import threading
from collections.abc import Iterable, Sequence

import torch
from transformers import DynamicCache, Qwen3MoeConfig, Qwen3MoeForCausalLM

from megatron_rl.rollout import hf_weights
from megatron_rl.rollout.protocol import check_generate_args
from megatron_rl.rollout.route_capture import RouteCapture, moe_gates
from megatron_rl.rollout.sampling import LOGPROB_MODES, row_seed, sample_next, token_logprobs
from megatron_rl.rollout.types import EngineHealth, RolloutSample, SamplingParams
from megatron_rl.routing import CODECS, RoutingCodec

logger = logging.getLogger(__name__)

ENGINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(kw_only=True, slots=True)
class InProcessEngineConfig:
    """Options of `InProcessEngine`.

    ``dtype="bfloat16"`` casts the weights (synced weights too), reproducing the train/inference
    mismatch of bf16 serving. ``routing_codec``: the `RoutingCodec` dtype routes are stored in.
    ``logprob_mode``: see `megatron_rl.rollout.sampling`.
    """

    dtype: str = "float32"
    device: str = "cpu"
    max_batch_size: int = 64
    routing_codec: str = "auto"
    logprob_mode: str = "temperature"
    pad_token_id: int = 0
    initial_version: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ENGINE_DTYPES:
            raise ValueError(
                f"InProcessEngineConfig.dtype={self.dtype!r}: choose one of {tuple(ENGINE_DTYPES)}"
            )
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(
                f"InProcessEngineConfig.max_batch_size={self.max_batch_size!r}: must be an int >= 1"
            )
        if self.routing_codec not in CODECS:
            raise ValueError(
                f"InProcessEngineConfig.routing_codec={self.routing_codec!r}: choose one of "
                f"{CODECS}"
            )
        if self.logprob_mode not in LOGPROB_MODES:
            raise ValueError(
                f"InProcessEngineConfig.logprob_mode={self.logprob_mode!r}: choose one of "
                f"{LOGPROB_MODES}"
            )


class InProcessEngine:
    """`RolloutEngine` over a transformers ``Qwen3MoeForCausalLM`` held in this process.

    Thread-safe: one lock serialises generation and weight updates (the loopback HTTP server
    calls it from several threads).
    """

    def __init__(self, model: Qwen3MoeForCausalLM, config: InProcessEngineConfig | None = None):
        self.config = config or InProcessEngineConfig()
        self.model = model.to(
            device=self.config.device, dtype=ENGINE_DTYPES[self.config.dtype]
        ).eval()
        hf = model.config
        self.vocab_size = int(hf.vocab_size)
        self.num_moe_layers = len(moe_gates(self.model))
        self.codec = RoutingCodec(
            int(hf.num_experts), int(hf.num_experts_per_tok), self.config.routing_codec
        )
        self._version = self.config.initial_version
        self._lock = threading.RLock()
        forward_args = inspect.signature(type(self.model).forward).parameters
        # transformers >= 5.2x calls the KV cache ``cache``; older ones ``past_key_values``.
        self._cache_kwarg = "cache" if "cache" in forward_args else "past_key_values"

    @classmethod
    def from_hf_config(
        cls, hf_config: Qwen3MoeConfig, config: InProcessEngineConfig | None = None, seed: int = 0
    ) -> InProcessEngine:
        """A randomly initialised model (weights usually arrive by `update_weights` next)."""
        torch.manual_seed(seed)
        return cls(Qwen3MoeForCausalLM(hf_config), config)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, config: InProcessEngineConfig | None = None
    ) -> InProcessEngine:
        model = Qwen3MoeForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float32)
        return cls(model, config)

    # ------------------------------------------------------------------ protocol
    @property
    def weight_version(self) -> int:
        return self._version

    def health(self) -> EngineHealth:
        return EngineHealth(healthy=True, weight_version=self._version, detail="in-process")

    def wait_until_ready(self) -> float:
        """Ready at once (in-process); 0 seconds waited."""
        return 0.0

    def take_aborted(self) -> int:
        """0: the in-process engine never aborts a sample."""
        return 0

    def membership_metrics(self) -> dict[str, float]:
        """{}: one engine in this process, no server membership to report."""
        return {}

    def close(self) -> None:
        """No-op: the engine holds no threads, sockets or process groups."""

    def flush_cache(self) -> None:
        """No-op: KV caches live for one `generate` call; there is no cross-call prefix cache."""

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Load (HF checkpoint name, tensor) pairs in place and move to ``version``.

        All-or-nothing: the stream is validated and staged before any weight is written, so a
        bad stream (unknown name, wrong shape, non-finite values) raises ValueError and leaves
        the weights and the version as they were.
        """
        if not isinstance(version, int):
            raise ValueError(f"version={version!r}: must be an int")
        with self._lock:
            staged = hf_weights.stage_weights(self.model, named_tensors)
            hf_weights.apply_staged(staged)
            self._version = version
        logger.info("in-process engine: %d tensors loaded, version %d", len(staged), version)

    def load_weights_in_place(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, check_finite: bool = True
    ) -> int:
        """Stage and write tensors without touching the version (bucketed transports).

        ``check_finite=False`` where the sender already checked (SGLang does not check either).
        """
        with self._lock:
            staged = hf_weights.stage_weights(self.model, named_tensors, check_finite=check_finite)
            hf_weights.apply_staged(staged)
        return len(staged)

    def set_version(self, version: int) -> None:
        with self._lock:
            self._version = int(version)

    def checksums(self, names: Iterable[str]) -> dict[str, float]:
        """Per-tensor checksums of the engine's current weights (`hf_weights.checksums`)."""
        with self._lock:
            return hf_weights.checksums(hf_weights.read_back(self.model, names))

    @torch.no_grad()
    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 [S - 1]: ``log p(token[i + 1] | tokens[: i + 1])`` at temperature 1."""
        with self._lock:
            ids_1S = torch.tensor([list(token_ids)], device=self.config.device)
            logits_1SV = self.model(input_ids=ids_1S).logits.float()
            logp_SV = torch.log_softmax(logits_1SV[0, :-1], dim=-1)
            return logp_SV.gather(-1, ids_1S[0, 1:, None]).squeeze(-1).cpu()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        n: int = 1,
        return_routed_experts: bool = False,
    ) -> list[RolloutSample]:
        check_generate_args(prompts, n, self.vocab_size)
        seed = params.seed
        rows = [
            (i, j, list(map(int, p)), None if seed is None else row_seed(seed, i, j))
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        samples: list[RolloutSample] = []
        with self._lock:
            for start in range(0, len(rows), self.config.max_batch_size):
                chunk = rows[start : start + self.config.max_batch_size]
                samples.extend(self._generate_rows(chunk, params, return_routed_experts))
        return samples

    def generate_one(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        sample_seed: int | None,
        return_routed_experts: bool = False,
    ) -> RolloutSample:
        """One sample drawn with generator seed ``sample_seed`` (SGLang's ``sampling_seed``).

        ``generate`` with batch seed ``s`` draws sample (i, j) with ``row_seed(s, i, j)``, so a
        server answering per-sample requests reproduces it exactly.
        """
        check_generate_args([prompt], 1, self.vocab_size)
        with self._lock:
            rows = [(0, 0, list(map(int, prompt)), sample_seed)]
            return self._generate_rows(rows, params, return_routed_experts)[0]

    # ------------------------------------------------------------------ internals
    @torch.no_grad()
    def _generate_rows(
        self,
        rows: list[tuple[int, int, list[int], int | None]],
        params: SamplingParams,
        want_routes: bool,
    ) -> list[RolloutSample]:
        device = self.config.device
        batch = len(rows)
        lengths = [len(row[2]) for row in rows]
        width = max(lengths)
        input_BT = torch.full((batch, width), self.config.pad_token_id, dtype=torch.long)
        mask_BT = torch.zeros((batch, width), dtype=torch.long)
        for b, (_, _, prompt, _) in enumerate(rows):
            input_BT[b, width - len(prompt) :] = torch.tensor(prompt)
            mask_BT[b, width - len(prompt) :] = 1
        input_BT, mask_BT = input_BT.to(device), mask_BT.to(device)
        position_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
        generators = None
        if all(row[3] is not None for row in rows):
            generators = [torch.Generator().manual_seed(row[3]) for row in rows]
        cache = DynamicCache(config=self.model.config)
        stop = set(params.stop_token_ids)
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        reasons: list[str | None] = [None] * batch
        capture = RouteCapture(self.model, batch) if want_routes else None
        with capture if capture is not None else contextlib.nullcontext():
            step_ids, step_pos = input_BT, position_BT
            for _ in range(params.max_new_tokens):
                out = self.model(
                    input_ids=step_ids,
                    attention_mask=mask_BT,
                    position_ids=step_pos,
                    use_cache=True,
                    logits_to_keep=1,
                    **{self._cache_kwarg: cache},
                )
                logits_BV = out.logits[:, -1].float()
                next_B = sample_next(
                    logits_BV,
                    temperature=params.temperature,
                    top_k=params.top_k,
                    top_p=params.top_p,
                    generators=generators,
                )
                lp_B = token_logprobs(
                    logits_BV, next_B, params.temperature, self.config.logprob_mode
                )
                _record(next_B, lp_B, tokens, logprobs, reasons, stop, params.max_new_tokens)
                if all(r is not None for r in reasons):
                    break
                step_ids = next_B[:, None]
                step_pos = step_pos[:, -1:] + 1
                mask_BT = torch.cat([mask_BT, torch.ones_like(mask_BT[:, :1])], dim=1)
        routes_BTLK = capture.routes_BTLK() if capture is not None else None
        samples = []
        for b, (i, j, prompt, _) in enumerate(rows):
            blob = None
            if routes_BTLK is not None:
                first = width - lengths[b]
                rows_TLK = routes_BTLK[b, first : width + len(tokens[b]) - 1]
                blob = self.codec.encode(rows_TLK)
            sample = RolloutSample(
                prompt_index=i,
                sample_index=j,
                prompt_ids_P=torch.tensor(prompt, dtype=torch.long),
                response_ids_R=torch.tensor(tokens[b], dtype=torch.long),
                logprobs_R=torch.tensor(logprobs[b], dtype=torch.float32),
                finish_reason=reasons[b] or "length",
                weight_version=self._version,
                routes=blob,
            )
            sample.check(num_moe_layers=self.num_moe_layers)
            samples.append(sample)
        return samples


def _record(next_B, lp_B, tokens, logprobs, reasons, stop, max_new_tokens) -> None:
    """Append each unfinished row's token and log-prob; set its finish reason when it ends."""
    for b, (token, logprob) in enumerate(zip(next_B.tolist(), lp_B.tolist(), strict=True)):
        if reasons[b] is not None:
            continue
        tokens[b].append(token)
        logprobs[b].append(logprob)
        if token in stop:
            reasons[b] = "stop"
        elif len(tokens[b]) >= max_new_tokens:
            reasons[b] = "length"
