"""The embedded rollout engine: transformers' Qwen3-MoE or DeepSeek-V3 on CPU (or GPU), batched,
KV-cached.

Rows (prompt, sample) are left-padded into batches of at most ``max_batch_size``; one prefill
and then one KV-cached decoding step per new token. A row that finished leaves the batch with
its KV cache, generator, noise identity and captured routes (`megatron_rl.rollout.live_rows`).
Stopping: a token in ``stop_token_ids`` (kept as the last response token, finish reason "stop") or
``max_new_tokens`` ("length"); like SGLang with ``ignore_eos``, the model's own EOS token is not
special, pass it in ``stop_token_ids``.

Pausing at a weight update (partial rollouts), as SGLang's ``/pause_generation`` does
(``PauseGenerationReqInput.mode`` in ``srt/managers/io_struct.py``, ``Scheduler.pause_generation``
in ``srt/managers/scheduler.py``, SGLang >= 0.5.6). `InProcessEngine.pause` takes effect at the
next decode-step boundary (after a step's tokens are recorded, so every row holds >= 1 token):

* ``"abort"``: the unfinished rows of the running calls end at once with finish reason
  ``"abort"`` and the tokens generated so far (SGLang's abort mode aborts every request and
  returns its partial output);
* ``"in_place"``: the running calls park with their KV cache and release the engine lock, so
  `update_weights` (`load_weights_in_place`, `set_version`) can run; after `resume` they go on
  decoding over the old KV cache (SGLang keeps the requests in the running batch with their KV);
* ``"retract"``: they park likewise, and on `resume` first recompute the KV cache of prompt +
  tokens so far with the current weights (SGLang moves them to the waiting queue, frees their
  KV and prefills them again), so every later token sees only the new weights.

Calls that arrive while paused wait for `resume` (SGLang's tokenizer manager holds them), as do
the later chunks (``max_batch_size``) of a running call. Every sample reports per-segment weight
versions, ``weight_versions = ((version, start, end), ...)`` over its response tokens, computed as
SGLang's ``compute_weight_version_spans`` (``srt/utils/weight_versions.py``, SGLang >= 0.5.19):
one span when no update happened during the sample, and ``weight_version`` is the oldest. A call
that is never paused runs the same forwards and draws as before pausing existed: bit-identical.
Pauses are per ``scope`` (any hashable; ``None`` by default): the loopback server passes itself,
so several stand-in servers over one engine pause independently, as real servers do.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import os
import threading
from collections.abc import Hashable, Iterable, Iterator, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from megatron_rl.model.presets import HFConfig, hf_causal_lm_class, load_hf_config
from megatron_rl.moe_layers import num_routed_experts
from megatron_rl.rollout import fp8_weights, hf_weights
from megatron_rl.rollout.fp32_matmuls import use_fp32_matmuls
from megatron_rl.rollout.live_rows import LiveRows
from megatron_rl.rollout.padded_experts import PADDED_BMM, register_padded_experts
from megatron_rl.rollout.pause_gate import PAUSE_MODES, PauseGate
from megatron_rl.rollout.protocol import check_generate_args
from megatron_rl.rollout.route_capture import RouteCapture, moe_gates
from megatron_rl.rollout.router_noise import RouterNoise
from megatron_rl.rollout.sampling import (
    LOGPROB_MODES,
    row_seed,
    sample_next,
    sample_on_support,
    token_logprobs,
)
from megatron_rl.rollout.types import (
    BF16_MATMULS,
    EngineHealth,
    RolloutSample,
    SamplingParams,
    check_samples,
    pad_supports,
)
from megatron_rl.routing import CODECS, RoutingCodec

logger = logging.getLogger(__name__)

# engine dtype -> compute dtype; "float8": FP8 serving, e4m3 weights and bf16 compute
ENGINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8": torch.bfloat16}
# transformers' experts functions (its ExpertsInterface) the engine accepts, plus padded_bmm
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", PADDED_BMM, "batched_mm", "eager")


@dataclasses.dataclass(kw_only=True, slots=True)
class InProcessEngineConfig:
    """Options of `InProcessEngine`.

    ``dtype="bfloat16"`` casts the weights (synced weights too), reproducing the train/inference
    mismatch of bf16 serving; ``dtype="float8"`` also rounds the attention and MLP matrices to
    e4m3 per output channel after every load (FP8 serving, `megatron_rl.rollout.fp8_weights`),
    a stronger mismatch. ``router_noise`` > 0: Gaussian noise of that relative size in every
    router's logits before the top-k (`megatron_rl.rollout.router_noise`), a mismatch that
    persists at trained weights; a draw is a function of ``router_noise_seed``, the sample's
    sampling seed, the position and the layer, so batching never changes a sample.
    ``max_batch_size``: rows per batched generation (a request of more rows runs in chunks);
    256 holds a study-sized request (16 prompts x 8 samples) in one batch: 1.17-1.43x faster
    per token on CPU than 64 (``megatron-rl bench engine``), the same tokens (fp32 log-probs move
    by rounding, ~2e-7: BLAS rounds a row by the matrix's row count).
    ``experts_implementation``: how transformers runs the experts, one of
    `EXPERTS_IMPLEMENTATIONS` (``"padded_bmm"``: `megatron_rl.rollout.padded_experts`); None
    (default) keeps the model's own (transformers picks ``"grouped_mm"`` where it can).
    ``bf16_matmul``: how bf16 (and FP8) serving computes its matrix products: ``"native"``,
    torch's bf16 kernels; ``"fp32"``, the same bf16 operands multiplied by fp32 kernels and
    rounded to bf16 once (`megatron_rl.rollout.fp32_matmuls`: what a bf16 kernel with fp32
    accumulation computes, up to the order of its additions; 2-6x faster on a CPU without
    native bf16); ``"auto"`` (default), ``"fp32"`` on the CPU when ``experts_implementation``
    is None, else ``"native"``.
    ``drop_finished_rows``: a row that finished leaves the batch at the next step boundary
    (`megatron_rl.rollout.live_rows`); False feeds it on until the batch's longest row ends.
    ``routing_codec``: the `RoutingCodec` dtype routes are stored in.
    ``logprob_mode``: see `megatron_rl.rollout.sampling`. ``pause_mode``: None (default), an
    `InProcessEngine.update_weights` during a running ``generate`` waits for it to end; one of
    `PAUSE_MODES`, the update pauses the running calls in that mode first and resumes them after
    (what the SGLang weight sync does with ``WeightSyncConfig.pause_mode``).
    """

    dtype: str = "float32"
    device: str = "cpu"
    max_batch_size: int = 256
    routing_codec: str = "auto"
    logprob_mode: str = "temperature"
    pad_token_id: int = 0
    initial_version: int = 0
    pause_mode: str | None = None
    router_noise: float = 0.0
    router_noise_seed: int = 0
    experts_implementation: str | None = None
    bf16_matmul: str = "auto"
    drop_finished_rows: bool = True

    def __post_init__(self) -> None:
        experts = self.experts_implementation
        if experts is not None and experts not in EXPERTS_IMPLEMENTATIONS:
            raise ValueError(
                f"InProcessEngineConfig.experts_implementation={experts!r}: None or one of "
                f"{EXPERTS_IMPLEMENTATIONS}"
            )
        if self.bf16_matmul not in BF16_MATMULS:
            raise ValueError(
                f"InProcessEngineConfig.bf16_matmul={self.bf16_matmul!r}: choose one of "
                f"{BF16_MATMULS}"
            )
        if self.bf16_matmul == "fp32" and experts is not None:
            raise ValueError(
                f"InProcessEngineConfig.bf16_matmul='fp32' runs the experts itself: drop "
                f"experts_implementation={experts!r}, or use bf16_matmul='native'"
            )
        if not (0 <= self.router_noise < float("inf")):
            raise ValueError(
                f"InProcessEngineConfig.router_noise={self.router_noise!r}: must be >= 0 "
                "(0: no noise)"
            )
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
        if self.pause_mode is not None and self.pause_mode not in PAUSE_MODES:
            raise ValueError(
                f"InProcessEngineConfig.pause_mode={self.pause_mode!r}: None or one of "
                f"{PAUSE_MODES}"
            )

    @property
    def resolved_bf16_matmul(self) -> str:
        """``bf16_matmul`` with ``"auto"`` decided: ``"fp32"`` or ``"native"``."""
        if self.bf16_matmul != "auto":
            return self.bf16_matmul
        auto = self.device == "cpu" and self.experts_implementation is None
        return "fp32" if auto else "native"


class InProcessEngine:
    """`RolloutEngine` over a transformers causal LM held in this process: ``Qwen3MoeForCausalLM``
    or ``DeepseekV3ForCausalLM`` (`megatron_rl.model.presets.FAMILIES`).

    Thread-safe: one lock serialises generation and weight updates (the loopback HTTP server
    calls it from several threads); a call parked by `pause` (or waiting for `resume`) does not
    hold it.
    """

    def __init__(self, model: PreTrainedModel, config: InProcessEngineConfig | None = None):
        self.config = config or InProcessEngineConfig()
        self.model = model.to(
            device=self.config.device, dtype=ENGINE_DTYPES[self.config.dtype]
        ).eval()
        self._fp8 = self.config.dtype == "float8"
        if self._fp8:
            fp8_weights.quantize_model_(self.model)
        hf = model.config
        self.vocab_size = int(hf.vocab_size)
        self.num_moe_layers = len(moe_gates(self.model))
        if self.config.experts_implementation is not None:
            register_padded_experts()
            self.model.set_experts_implementation(self.config.experts_implementation)
        if self.config.dtype != "float32" and self.config.resolved_bf16_matmul == "fp32":
            use_fp32_matmuls(self.model)
        self.router_noise: RouterNoise | None = None
        if self.config.router_noise > 0:  # before any RouteCapture: captured routes are noisy
            self.router_noise = RouterNoise(
                self.model, self.config.router_noise, self.config.router_noise_seed
            )
        self.codec = RoutingCodec(
            num_routed_experts(hf), int(hf.num_experts_per_tok), self.config.routing_codec
        )
        self._version = self.config.initial_version
        self._lock = threading.RLock()
        self._gate = PauseGate(self._lock)  # pauses, aborts and admission per scope
        forward_args = inspect.signature(type(self.model).forward).parameters
        # transformers >= 5.2x calls the KV cache ``cache``; older ones ``past_key_values``.
        self._cache_kwarg = "cache" if "cache" in forward_args else "past_key_values"

    @classmethod
    def from_hf_config(
        cls, hf_config: HFConfig, config: InProcessEngineConfig | None = None, seed: int = 0
    ) -> InProcessEngine:
        """A randomly initialised model of ``hf_config``'s family (weights usually arrive by
        `update_weights` next), on its own copy of ``hf_config`` (the engine sets the copy's
        experts implementation)."""
        torch.manual_seed(seed)
        return cls(hf_causal_lm_class(hf_config)(copy.deepcopy(hf_config)), config)

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, config: InProcessEngineConfig | None = None
    ) -> InProcessEngine:
        model_class = hf_causal_lm_class(load_hf_config(os.fspath(path)))
        model = model_class.from_pretrained(os.fspath(path), dtype=torch.float32)
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
        """0: the in-process engine generates no sample again (a pause in ``abort`` mode or
        `abort_all` returns the partial samples with finish reason ``"abort"``)."""
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
        with self._paused_for_update(), self._lock:
            staged = hf_weights.stage_weights(self.model, named_tensors)
            hf_weights.apply_staged(staged)
            if self._fp8:
                fp8_weights.quantize_model_(self.model)
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
            if self._fp8:
                fp8_weights.quantize_model_(self.model)
        return len(staged)

    def set_version(self, version: int) -> None:
        with self._lock:
            self._version = int(version)

    # ------------------------------------------------------------------ pause / resume
    def pause(self, mode: str = "abort", *, scope: Hashable = None) -> None:
        """Pause the calls of ``scope`` at their next decode-step boundary (module docstring).

        Returns once none of them is computing: each is parked (``in_place``, ``retract``), has
        ended its unfinished rows (``abort``) or is done; calls of other scopes go on. Until
        `resume`, new calls of ``scope`` wait. Pausing again changes the mode (``abort`` also
        ends the calls parked so far, as SGLang's abort reaches retracted requests).
        """
        self._gate.pause(mode, scope)

    def resume(self, *, scope: Hashable = None) -> None:
        """End the pause of ``scope``: parked calls go on (``retract``: after recomputing their
        KV cache with the current weights), waiting calls start. A no-op when not paused."""
        self._gate.resume(scope)

    def abort_all(self, *, scope: Hashable = None) -> None:
        """End the unfinished rows of every running or parked call of ``scope`` at its next
        step boundary with finish reason ``"abort"`` (SGLang's ``abort_all``); returns at once
        and leaves the pause state as it is."""
        self._gate.abort_all(scope)

    def paused(self, scope: Hashable = None) -> str | None:
        """The pause mode of ``scope``, or None."""
        return self._gate.paused(scope)

    def parked(self, scope: Hashable = None) -> int:
        """How many calls of ``scope`` are parked by a pause right now."""
        return self._gate.parked(scope)

    @contextlib.contextmanager
    def _paused_for_update(self) -> Iterator[None]:
        """``config.pause_mode`` around an update, unless the caller already paused."""
        mode = self.config.pause_mode
        if mode is None or self.paused() is not None:
            yield
            return
        self.pause(mode)
        try:
            yield
        finally:
            self.resume()

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
        scope: Hashable = None,
    ) -> list[RolloutSample]:
        """``scope``: the pause scope of this call (`pause`)."""
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
                samples.extend(self._generate_chunk(chunk, params, return_routed_experts, scope))
        return samples

    def generate_one(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        sample_seed: int | None,
        return_routed_experts: bool = False,
        scope: Hashable = None,
    ) -> RolloutSample:
        """One sample drawn with generator seed ``sample_seed`` (SGLang's ``sampling_seed``).

        ``generate`` with batch seed ``s`` draws sample (i, j) with ``row_seed(s, i, j)``, so a
        server answering per-sample requests reproduces it exactly.
        """
        check_generate_args([prompt], 1, self.vocab_size)
        with self._lock:
            rows = [(0, 0, list(map(int, prompt)), sample_seed)]
            return self._generate_chunk(rows, params, return_routed_experts, scope)[0]

    # ------------------------------------------------------------------ internals
    def _generate_chunk(self, rows, params, want_routes: bool, scope: Hashable):
        """`_generate_rows` once ``scope`` is not paused, counted as computing meanwhile."""
        with self._gate.admitted(scope) as epoch:
            return self._generate_rows(rows, params, want_routes, scope, epoch)

    @torch.no_grad()
    def _generate_rows(
        self,
        rows: list[tuple[int, int, list[int], int | None]],
        params: SamplingParams,
        want_routes: bool,
        scope: Hashable = None,
        epoch: int = 0,
    ) -> list[RolloutSample]:
        device = self.config.device
        batch = len(rows)
        lengths = [len(row[2]) for row in rows]
        width = max(lengths)
        pad = self.config.pad_token_id
        # prompts padded on the left: one tensor from lists, not a write per row
        input_BT = torch.tensor(
            [[pad] * (width - n) + list(row[2]) for n, row in zip(lengths, rows, strict=True)]
        )
        mask_BT = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
        input_BT, mask_BT = input_BT.to(device), mask_BT.to(device)
        position_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
        generators = None
        if all(row[3] is not None for row in rows):
            generators = [torch.Generator().manual_seed(row[3]) for row in rows]
        cache = DynamicCache(config=self.model.config)
        stop = set(params.stop_token_ids)
        tokens: list[list[int]] = [[] for _ in rows]
        logprobs: list[list[float]] = [[] for _ in rows]
        supports: list[list[torch.Tensor]] = [[] for _ in rows]  # return_sampling_support
        reasons: list[str | None] = [None] * batch
        version = self._version
        changes: list[list[tuple[int, int]]] = [[] for _ in rows]  # (old version, tokens by then)
        fed: list[torch.Tensor] = []  # [B, 1] per decoding step: what retract recomputes
        capture = RouteCapture(self.model, batch) if want_routes else None
        noise_rows = contextlib.nullcontext()
        if self.router_noise is not None:  # a sample's noise follows its sampling seed
            noise_rows = self.router_noise.rows([row[3] for row in rows])
        live = LiveRows(batch, cache, generators, capture, self.router_noise)
        with noise_rows, capture if capture is not None else contextlib.nullcontext():
            step_ids, step_pos = input_BT, position_BT
            for _ in range(params.max_new_tokens):
                out = self.model(
                    input_ids=step_ids,
                    attention_mask=mask_BT,
                    position_ids=step_pos,
                    use_cache=True,
                    logits_to_keep=1,
                    **{self._cache_kwarg: live.cache},
                )
                logits_BV = out.logits[:, -1].float()
                if params.return_sampling_support:
                    next_B, lp_B, step_supports = sample_on_support(
                        logits_BV,
                        temperature=params.temperature,
                        top_k=params.top_k,
                        top_p=params.top_p,
                        generators=live.generators,
                    )
                    for b, ids in zip(live.rows.tolist(), step_supports, strict=True):
                        if reasons[b] is None:
                            supports[b].append(ids)
                else:
                    next_B = sample_next(
                        logits_BV,
                        temperature=params.temperature,
                        top_k=params.top_k,
                        top_p=params.top_p,
                        generators=live.generators,
                    )
                    lp_B = token_logprobs(
                        logits_BV, next_B, params.temperature, self.config.logprob_mode
                    )
                _record(
                    live.rows, next_B, lp_B, tokens, logprobs, reasons, stop, params.max_new_tokens
                )
                if all(r is not None for r in reasons):
                    break
                fed.append(live.scatter(next_B[:, None], self.config.pad_token_id))
                step_ids = next_B[:, None]
                step_pos = step_pos[:, -1:] + 1
                mask_BT = torch.cat([mask_BT, torch.ones_like(mask_BT[:, :1])], dim=1)
                keep = live.unfinished(reasons) if self.config.drop_finished_rows else None
                if keep is not None:  # finished rows leave the batch
                    step_ids, step_pos, mask_BT = step_ids[keep], step_pos[keep], mask_BT[keep]
                if self._gate.due(scope, epoch):  # a step boundary
                    held = self._gate.hold(scope, epoch)
                    if held == "abort":
                        reasons = [r or "abort" for r in reasons]
                        break
                    if self._version != version:  # as SGLang's record_weight_version_events
                        for b in range(batch):
                            changes[b].append((version, len(tokens[b])))
                        version = self._version
                    if held == "retract":
                        live.cache = self._recompute_cache(input_BT, fed, mask_BT, live)
        routes_BTLK = capture.routes_BTLK() if capture is not None else None
        samples = []
        for b, (i, j, prompt, _) in enumerate(rows):
            blob = None
            if routes_BTLK is not None:
                first = width - lengths[b]
                rows_TLK = routes_BTLK[b, first : width + len(tokens[b]) - 1]
                blob = self.codec.encode(rows_TLK)
            spans = version_spans(changes[b], version, len(tokens[b]))
            sample = RolloutSample(
                prompt_index=i,
                sample_index=j,
                prompt_ids_P=torch.tensor(prompt, dtype=torch.long),
                response_ids_R=torch.tensor(tokens[b], dtype=torch.long),
                logprobs_R=torch.tensor(logprobs[b], dtype=torch.float32),
                finish_reason=reasons[b] or "length",
                weight_version=spans[0][0],
                weight_versions=spans,
                routes=blob,
                support_RK=pad_supports(supports[b]) if params.return_sampling_support else None,
            )
            samples.append(sample)
        check_samples(samples, num_moe_layers=self.num_moe_layers)
        return samples

    def _recompute_cache(self, input_BT, fed, mask_BT, live: LiveRows) -> DynamicCache:
        """A new KV cache of every position the live rows were fed so far (the padded prompts
        and all decoding inputs but the pending one), computed with the current weights:
        retract's re-prefill.

        The live rows' routes captured so far are replaced by this forward's (SGLang records
        routes per KV slot, so a re-prefilled position reports the routing that computed its
        new KV); a row that finished before keeps its own, as a finished SGLang request does.
        """
        ids_BT = torch.cat([input_BT, *fed[:-1]], dim=1)[live.rows]
        mask_BT = mask_BT[:, :-1]
        cache = DynamicCache(config=self.model.config)
        if live.capture is not None:
            live.capture.restart()
        self.model(
            input_ids=ids_BT,
            attention_mask=mask_BT,
            position_ids=(mask_BT.cumsum(-1) - 1).clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        return cache


def version_spans(
    changes: Sequence[tuple[int, int]], current: int, num_tokens: int
) -> tuple[tuple[int, int, int], ...]:
    """``((version, start, end), ...)`` covering ``num_tokens`` response tokens in order.

    ``changes``: per weight-version change during the sample, ``(version before it, tokens
    generated by then)``; ``current``: the version at the end. Empty segments are dropped and
    adjacent equal versions merged: SGLang's ``compute_weight_version_spans``
    (``srt/utils/weight_versions.py``).
    """
    spans: list[list[int]] = []
    for version, end in [*changes, (current, num_tokens)]:
        end = min(end, num_tokens)
        if spans and end <= spans[-1][2]:
            continue
        if spans and version == spans[-1][0]:
            spans[-1][2] = end
            continue
        spans.append([version, spans[-1][2] if spans else 0, end])
    return tuple((v, start, end) for v, start, end in spans)


def _record(rows, next_B, lp_B, tokens, logprobs, reasons, stop, max_new_tokens) -> None:
    """Append each unfinished row's token and log-prob (``next_B[i]`` is batch row
    ``rows[i]``); set its finish reason when it ends."""
    for b, token, logprob in zip(rows.tolist(), next_B.tolist(), lp_B.tolist(), strict=True):
        if reasons[b] is not None:
            continue
        tokens[b].append(token)
        logprobs[b].append(logprob)
        if token in stop:
            reasons[b] = "stop"
        elif len(tokens[b]) >= max_new_tokens:
            reasons[b] = "length"
