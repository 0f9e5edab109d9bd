"""`RolloutEngine` over SGLang servers (or an ``sglang-router`` URL) via HTTP.

Every sample is one ``/generate`` request (``n = 1``) with its own slot in the result list, run
by a pool of ``max_in_flight`` threads. A retried request (timeout, dropped connection, 5xx; see
`HttpPool`) carries a fresh ``rid`` and fills the same slot, so no sample is lost or duplicated:
the batch returns exactly ``len(prompts) * n`` samples or raises. Answers are checked and
decoded one by one (`sglang_payload.decode_generate`).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch

from megatron_rl.moe_layers import moe_layer_numbers
from megatron_rl.rollout.http_pool import HttpPool, HttpPoolConfig
from megatron_rl.rollout.protocol import check_generate_args
from megatron_rl.rollout.sglang_payload import decode_generate, generate_request, parse_version
from megatron_rl.rollout.types import EngineHealth, RolloutSample, SamplingParams
from megatron_rl.rollout.weight_sync import SyncReport, WeightSync, WeightSyncConfig
from megatron_rl.routing import CODECS, RoutingCodec

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, slots=True)
class SGLangEngineConfig:
    """Where the servers are and what the model looks like (for routed-expert decoding)."""

    http: HttpPoolConfig
    num_experts: int
    topk: int
    num_moe_layers: int
    routing_codec: str = "auto"
    max_in_flight: int = 64
    sync: WeightSyncConfig = dataclasses.field(default_factory=WeightSyncConfig)

    def __post_init__(self) -> None:
        if self.routing_codec not in CODECS:
            raise ValueError(
                f"SGLangEngineConfig.routing_codec={self.routing_codec!r}: choose one of {CODECS}"
            )
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(
                f"SGLangEngineConfig.max_in_flight={self.max_in_flight!r}: must be an int >= 1"
            )
        if self.num_moe_layers < 1:
            raise ValueError(f"SGLangEngineConfig.num_moe_layers={self.num_moe_layers!r}: >= 1")

    @classmethod
    def from_hf_config(cls, hf_config, **kwargs) -> SGLangEngineConfig:
        return cls(
            num_experts=int(hf_config.num_experts),
            topk=int(hf_config.num_experts_per_tok),
            num_moe_layers=len(moe_layer_numbers(hf_config)),
            **kwargs,
        )


class SGLangEngine:
    """HTTP client engine; see the module docstring. Call `close` (or use ``with``) when done."""

    def __init__(self, config: SGLangEngineConfig, hf_config=None) -> None:
        self.config = config
        self.pool = HttpPool(config.http)
        self.codec = RoutingCodec(config.num_experts, config.topk, config.routing_codec)
        self.weight_sync = WeightSync(self.pool, config.sync, hf_config)
        self._threads = ThreadPoolExecutor(max_workers=config.max_in_flight)
        self._version = 0
        self.last_sync: SyncReport | None = None

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.weight_sync.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ protocol
    @property
    def weight_version(self) -> int:
        return self._version

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        n: int = 1,
        return_routed_experts: bool = False,
    ) -> list[RolloutSample]:
        check_generate_args(prompts, n, None)
        batch = uuid.uuid4().hex[:12]
        futures = [
            self._threads.submit(
                self._one, [int(t) for t in prompt], params, i, j, batch, return_routed_experts
            )
            for i, prompt in enumerate(prompts)
            for j in range(n)
        ]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for future in pending:
            future.cancel()
        for future in futures:
            if future in done and future.exception() is not None:
                raise future.exception()
        samples = [f.result() for f in futures]
        assert [(s.prompt_index, s.sample_index) for s in samples] == [
            (i, j) for i in range(len(prompts)) for j in range(n)
        ]
        return samples

    def _one(self, prompt, params, i, j, batch, routes) -> RolloutSample:
        attempt = iter(range(1 << 30))

        def payload() -> dict:  # a fresh rid per attempt: servers reject duplicate ids
            return generate_request(
                prompt,
                params,
                prompt_index=i,
                sample_index=j,
                return_routed_experts=routes,
                rid=f"{batch}-{i}-{j}-{next(attempt)}",
            )

        body = self.pool.post("/generate", payload, what=f"sample (prompt {i}, sample {j})")
        return decode_generate(
            body,
            prompt=prompt,
            prompt_index=i,
            sample_index=j,
            codec=self.codec if routes else None,
            num_moe_layers=self.config.num_moe_layers,
        )

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Sync over the configured transport (`WeightSync.sync`); WeightSyncError on failure."""
        self.last_sync = self.weight_sync.sync(named_tensors, version)
        self._version = version

    def flush_cache(self) -> None:
        for url in self.config.http.urls:
            self.pool.call_on(url, "POST", "/flush_cache", {})

    def health(self) -> EngineHealth:
        """Healthy when at least one server answers /health and all healthy ones agree on the
        weight version."""
        up = [u for u in self.config.http.urls if self.pool.probe(u)]
        if not up:
            return EngineHealth(healthy=False, weight_version=self._version, detail="no server up")
        versions = {
            u: parse_version(
                (self.pool.call_on(u, "GET", "/get_model_info", None) or {}).get("weight_version"),
                u,
            )
            for u in up
        }
        agree = len(set(versions.values())) == 1
        detail = f"{len(up)}/{len(self.config.http.urls)} servers up; versions {versions}"
        return EngineHealth(
            healthy=agree, weight_version=next(iter(versions.values())), detail=detail
        )

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 [S - 1]: the server's prompt log-probs (``input_token_logprobs``, T = 1)."""
        payload = {
            "input_ids": [int(t) for t in token_ids],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        body = self.pool.post("/generate", payload, what="score")
        entries = body["meta_info"]["input_token_logprobs"]
        if len(entries) != len(token_ids):
            raise RuntimeError(f"score: {len(entries)} input logprobs for {len(token_ids)} tokens")
        return torch.tensor([float(e[0]) for e in entries[1:]], dtype=torch.float32)
