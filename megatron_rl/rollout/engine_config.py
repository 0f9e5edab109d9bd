"""The rollout engine's configuration: the in-process engine or SGLang servers, and weight sync."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rl.flags import bad_value, check_choice, check_positive_ints, derived, option
from megatron_rl.rollout.types import BF16_MATMULS
from megatron_rl.routing.codec import CODECS

ENGINES = ("local", "sglang")
SGLANG_HEALTH_CHECK_S = 20.0  # SGLang's /health waits this long before a 503 (its default)
WEIGHT_SYNC_TRANSPORTS = ("distributed", "tensor", "disk")
SGLANG_PAUSE_MODES = ("abort", "retract", "in_place")  # /pause_generation's mode
ROLLOUT_DTYPES = ("float32", "bfloat16", "float8")  # the in-process engine's (float8: FP8 serving)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """The rollout engine: in-process (the embedded default) or SGLang servers over HTTP."""

    kind: str = option(
        "local",
        name="rollout-engine",
        choices=ENGINES,
        help="local: the in-process engine; sglang: SGLang servers (--sglang-url)",
    )
    rollout_dtype: str = option(
        "float32",
        choices=ROLLOUT_DTYPES,
        help="the in-process engine's dtype (float8: e4m3 weights, bf16 compute: FP8 serving)",
    )
    rollout_bf16_matmul: str = option(
        "auto",
        choices=BF16_MATMULS,
        help="in-process engine, bf16/float8 serving: fp32 multiplies the bf16 operands with "
        "fp32 kernels and rounds once (the bf16 kernels' result up to their addition order, "
        "2-6x faster on a CPU without native bf16); native: torch's bf16 kernels; auto: fp32 "
        "on the CPU",
    )
    rollout_router_noise: float = option(
        0.0,
        help="in-process engine: Gaussian noise in each router's logits, relative to the "
        "token's logit spread (0: none); a routing mismatch that persists at trained weights",
    )
    sglang_url: tuple[str, ...] = option(
        (), help="an SGLang worker (repeat for each); control calls and weight sync go to each"
    )
    sglang_router_url: str | None = option(
        None, help="sglang-router: generation goes through it (R3 generation: the workers)"
    )
    sglang_min_servers: int = option(
        1,
        help="a dead server is dropped and rejoins after a full weight sync; the run stops only "
        "when fewer than this many are left",
    )
    sglang_return_routed_experts: bool = option(
        False,
        help="the servers run with --enable-return-routed-experts (needed by --routing-replay r3)",
    )
    weight_sync_transport: str = option(
        "distributed",
        choices=WEIGHT_SYNC_TRANSPORTS,
        help="distributed (NCCL/gloo broadcast), tensor (shared memory, same host) or disk",
    )
    per_stage_senders: bool = option(
        True,
        name="weight-sync-from-rank-0",
        help="with pipeline parallelism and the distributed transport, send every stage's "
        "tensors from global rank 0 (over the pipeline group first) instead of from each "
        "stage's first rank over a weight group of its own",
    )
    weight_sync_fp8_blocks: bool = option(
        False,
        help="every weight sync sends the linear weights block-FP8 quantised (float8_e4m3fn "
        "plus a float32 weight_scale_inv per 128x128 block), for SGLang servers started on a "
        "checkpoint whose quantization_config is fp8 with weight_block_size [128, 128]; the "
        "disk transport also writes that quantization_config",
    )
    sglang_engine_ranks: int = option(1, help="TP ranks of each SGLang server (weight-sync group)")
    sglang_request_timeout: float | None = option(
        None,
        help="read timeout (s) of one SGLang request; default none (a timed-out request is "
        "aborted and retried elsewhere, the server is not marked down)",
    )
    sglang_health_timeout: float = option(
        30.0,
        help="seconds one /health probe or one /server_info or /model_info answer may take "
        "(more than SGLang's own 20-s health check); raise it for servers on a loaded host",
    )
    sglang_startup_timeout: float = option(
        3600.0,
        help="seconds to wait for every SGLang server's /health before the first weight sync "
        "(servers listen only once their model is loaded)",
    )
    sglang_reprobe_interval: float = option(
        10.0,
        help="seconds from a server's drop to its first background /health probe; the wait "
        "doubles after each failed probe (up to --sglang-reprobe-max-interval); no weight sync "
        "waits for a probe, and a server that answers rejoins after a full sync",
    )
    sglang_reprobe_max_interval: float = option(
        300.0, help="the longest wait between two background probes of a dropped server"
    )
    sglang_liveness_interval: float | None = option(
        30.0,
        help="an SGLang request without a read timeout checks its server's /model_info after "
        "every this many seconds without an answer; a server silent to both is marked down and "
        "the request retried elsewhere (none: wait forever)",
    )
    weight_sync_failure_timeout: float = option(
        30.0,
        help="seconds a server may take on a weight sync's control calls (pause, continue, "
        "version, sessions) before it leaves the sync and is dropped: what a stalled server "
        "costs, once",
    )
    sglang_pause_mode: str = option(
        "abort",
        choices=SGLANG_PAUSE_MODES,
        help="how a weight sync pauses the servers' running requests: abort (they end and are "
        "generated again), retract (kept; their KV is recomputed with the new weights after "
        "the sync) or in_place (kept with their old KV cache; no cache flush); with retract "
        "and in_place a sample that outlives a sync records each segment's weight version",
    )
    weight_sync_min_gbps: float = option(
        1.0,
        help="the slowest weight push (GB/s) that is still healthy: the other ranks wait for "
        "rank 0's push at most 300 s + 2 x model bytes / this (not the process group's timeout)",
    )
    colocate: bool = option(
        False,
        help="trainer ranks and SGLang servers share the GPUs: around each rollout the trainer "
        "offloads its parameters, gradient buffers and optimizer state to host memory and the "
        "servers resume their KV cache and CUDA graphs; before the update the servers release "
        "all their memory and the trainer onloads; before the weight sync the servers resume "
        "their weights (needs --rollout-engine sglang, --weight-sync-transport tensor; see "
        "docs/rollout-and-sglang.md)",
    )
    routing_dtype: str = derived("auto", source="replay.dtype")  # codec of the engine's routes
    # a sync pauses running generations instead of waiting for them (the in-process engine too)
    partial_rollout: bool = derived(False, source="rollout.partial_rollout")
    weight_sync_dir: str = derived("runs/latest/weight_sync", source="logging.run_dir")  # disk

    def __post_init__(self) -> None:
        check_choice(self, "kind", ENGINES)
        check_choice(self, "weight_sync_transport", WEIGHT_SYNC_TRANSPORTS)
        check_choice(self, "sglang_pause_mode", SGLANG_PAUSE_MODES)
        check_choice(self, "rollout_dtype", ROLLOUT_DTYPES)
        check_choice(self, "rollout_bf16_matmul", BF16_MATMULS)
        if self.rollout_bf16_matmul != "auto" and self.kind != "local":
            raise bad_value(
                self, "rollout_bf16_matmul", "only the in-process engine (--rollout-engine local)"
            )
        if not (0 <= self.rollout_router_noise < math.inf):
            raise bad_value(self, "rollout_router_noise", "must be >= 0 (0: no noise)")
        if self.rollout_router_noise > 0 and self.kind != "local":
            raise bad_value(
                self, "rollout_router_noise", "only the in-process engine (--rollout-engine local)"
            )
        check_choice(self, "routing_dtype", CODECS)
        check_positive_ints(self, "sglang_engine_ranks", "sglang_min_servers")
        if self.kind == "sglang" and not self.sglang_url:
            raise ValueError("--rollout-engine sglang needs at least one --sglang-url")
        if self.colocate and (self.kind != "sglang" or self.weight_sync_transport != "tensor"):
            raise bad_value(
                self,
                "colocate",
                "needs --rollout-engine sglang and --weight-sync-transport tensor (servers on "
                f"the trainer's GPUs; got --rollout-engine {self.kind} and "
                f"--weight-sync-transport {self.weight_sync_transport})",
            )
        self._check_sglang_only()
        if not (math.isfinite(self.weight_sync_min_gbps) and self.weight_sync_min_gbps > 0):
            raise bad_value(self, "weight_sync_min_gbps", "must be a number > 0 (GB/s)")
        if not self.sglang_health_timeout > SGLANG_HEALTH_CHECK_S:
            raise bad_value(
                self, "sglang_health_timeout", f"must be > {SGLANG_HEALTH_CHECK_S:g} seconds"
            )
        if not self.sglang_startup_timeout > 0:
            raise bad_value(self, "sglang_startup_timeout", "must be > 0 seconds")
        if self.sglang_request_timeout is not None and not self.sglang_request_timeout > 0:
            raise bad_value(self, "sglang_request_timeout", "must be > 0 (or none)")
        if self.sglang_liveness_interval is not None and not self.sglang_liveness_interval > 0:
            raise bad_value(self, "sglang_liveness_interval", "must be > 0 seconds (or none)")
        for name in ("sglang_reprobe_interval", "weight_sync_failure_timeout"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise bad_value(self, name, "must be a number of seconds > 0")
        if not self.sglang_reprobe_max_interval >= self.sglang_reprobe_interval:
            raise bad_value(
                self,
                "sglang_reprobe_max_interval",
                f"must be >= --sglang-reprobe-interval {self.sglang_reprobe_interval}",
            )

    def _check_sglang_only(self) -> None:
        """What SGLang servers would ignore or cannot do: the in-process engine's dtype, and a
        router or a partial server set under ``--colocate``."""
        if self.weight_sync_fp8_blocks and self.kind != "sglang":
            raise bad_value(
                self,
                "weight_sync_fp8_blocks",
                "quantises what a weight sync sends to SGLang servers; the in-process engine "
                "takes full-precision weights (its FP8 serving is --rollout-dtype float8)",
            )
        if self.kind == "sglang" and self.rollout_dtype != "float32":
            raise bad_value(
                self,
                "rollout_dtype",
                "sets the in-process engine's dtype only; SGLang servers serve in the dtype they "
                "were started with. Drop --rollout-dtype and start the servers with --dtype "
                "bfloat16, or --quantization fp8 for FP8 serving",
            )
        if not self.colocate:
            return
        if self.sglang_router_url is not None:
            raise ValueError(
                f"--sglang-router-url {self.sglang_router_url} with --colocate: colocated servers "
                "are driven one by one on the trainer's GPUs (their memory hand-over, each rank's "
                "weights to its own server); drop --sglang-router-url"
            )
        if self.sglang_min_servers not in (1, len(self.sglang_url)):
            raise bad_value(
                self,
                "sglang_min_servers",
                f"--colocate needs every one of the {len(self.sglang_url)} servers (a server "
                "failure stops the run: a dropped one would keep its memory on the trainer's "
                "GPUs); leave --sglang-min-servers unset",
            )

    @property
    def remote(self) -> bool:
        """The engine runs outside the trainer's processes (SGLang servers behind HTTP).

        Remote servers receive the whole model from global rank 0 while the other ranks finish
        their part of the stream and wait for rank 0's result (`SyncWait`, which also shares
        the servers' membership metrics); every rank holds a client. The in-process engine is
        built on, and receives its weights on, every generator rank (each model-parallel
        group's source rank).
        """
        return self.kind == "sglang"
