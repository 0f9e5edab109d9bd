"""Command line -> one validated `TrainConfig`.

Flags follow Megatron-LM's names where Megatron has one (``--tensor-model-parallel-size``,
``--micro-batch-size``, ``--global-batch-size``, ``--lr``, ``--train-iters``, ``--save``, ...), so
launch arguments carry over. RL flags are grouped. Every loss hyperparameter of every registered
loss is a flag (``--clip-high``, ``--c1-pos``, ``--delta-low``, ...); giving one that the chosen
``--loss`` does not have is an error.

Staleness is explicit: one rollout holds ``rollout_batch_size * n_samples_per_prompt`` samples and
is consumed by ``N = samples / global_batch_size`` sequential optimizer steps (the VESPO/EPIC
papers' N = 8 is 8 updates per rollout).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass

from megatron_rl.losses import (
    AGGREGATION_MODES,
    ROLLOUT_CORRECTIONS,
    available_losses,
    get_loss_spec,
)
from megatron_rl.losses.kl import KL_ESTIMATORS
from megatron_rl.parallel import ParallelConfig
from megatron_rl.routing import CODECS
from megatron_rl.routing.modes import REPLAY_MODES, ReplayConfig
from megatron_rl.train.advantages import ADVANTAGE_ESTIMATORS
from megatron_rl.train.engines import ENGINES, WEIGHT_SYNC_TRANSPORTS, EngineConfig
from megatron_rl.train.objective import ObjectiveConfig

TRANSFORMER_IMPLS = ("auto", "transformer_engine", "local")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    # model and parallelism
    model: str = "tiny"  # a preset name or a HF Qwen3-MoE checkpoint folder
    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # uneven pipeline stages (megatron's names): layers of the first / last stage; None: even
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    device: str = "auto"
    torch_threads: int | None = None  # intra-op threads; None: OMP_NUM_THREADS or auto
    bf16: bool = False
    recompute_granularity: str | None = None
    transformer_impl: str = "auto"  # auto: Transformer Engine on CUDA, local on CPU
    # optimisation
    train_iters: int = 80  # RL steps, one rollout each
    micro_batch_size: int = 32
    global_batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False  # shard Adam state over data-parallel ranks
    overlap_grad_reduce: bool = False  # reduce gradients during the last micro-batch's backward
    optimizer_cpu_offload: bool = False  # megatron's HybridDeviceOptimizer (Adam state on host)
    optimizer_offload_fraction: float = 1.0  # share of the Adam state and update on the CPU
    # token balancing (see megatron_rl/train/balance.py): micro-batches by a padded-token budget
    # instead of --micro-batch-size rows (None or 0: off), and every mini-batch's samples
    # re-split over the data-parallel ranks by token count (Karmarkar-Karp, equal counts)
    max_tokens_per_gpu: int | None = None
    balance_data: bool = False
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    seed: int = 1234
    # RL objective
    loss: str = "grpo"
    loss_params: tuple[tuple[str, object], ...] = ()  # (name, value): float or str
    loss_agg_mode: str | None = None
    advantage_estimator: str = "grpo"
    filter_zero_variance_groups: bool = False
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    reference_offload: bool = True  # CUDA: the KL reference's weights wait in host memory
    rollout_correction: str = "none"
    behavior_logprobs: str = "trainer"  # the loss's old log-probs: trainer recompute or engine
    routing_replay: str = "off"
    routing_dtype: str = "auto"
    routing_record_only: bool = False
    # rollout
    rollout_engine: str = "local"
    sglang_url: tuple[str, ...] = ()
    sglang_router_url: str | None = None  # generation through sglang-router; control: workers
    sglang_min_servers: int = 1  # fewer live SGLang servers than this stops the run
    sglang_return_routed_experts: bool = False
    weight_sync_transport: str = "distributed"
    sglang_engine_ranks: int = 1  # GPUs (TP ranks) of each SGLang server, for weight sync
    sglang_request_timeout: float | None = None  # /generate read timeout (s); None: none
    sglang_startup_timeout: float = 3600.0  # how long rank 0 waits for the servers at start
    weight_sync_min_gbps: float = 1.0  # slowest healthy push (GB/s): bounds the others' wait
    rollout_dtype: str = "float32"
    rollout_batch_size: int = 16  # prompts per rollout
    n_samples_per_prompt: int = 8
    max_response_length: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # one-step-off-policy rollouts (see megatron_rl/train/async_rollout.py): rollout k + 1 is
    # generated while step k trains; a batch more than max_staleness versions behind the
    # trainer's weights is generated again
    async_rollout: bool = False
    max_staleness: int = 1
    # data and reward
    prompt_data: str | None = None  # None: the built-in task
    tokenizer: str | None = None
    max_prompt_length: int | None = None
    prompt_too_long: str = "error"  # or "drop", "truncate-left" (see --help)
    reward: str = "builtin"
    # output
    run_dir: str = "runs/latest"
    save: str | None = None
    load: str | None = None
    load_fallback: bool = False  # a corrupted checkpoint: load the newest older one that verifies
    ckpt_format: str = "torch"  # "torch_dist": reshardable (resume at another TP/EP/PP/DP layout)
    save_interval: int = 0
    async_save: bool = False  # torch_dist: write in the background, commit when it finishes
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_mode: str = "offline"
    progress: bool = True
    max_bad_steps: int = 3  # consecutive non-finite updates before the run stops

    def __post_init__(self) -> None:
        choices = {
            "loss": available_losses(),
            "advantage_estimator": ADVANTAGE_ESTIMATORS,
            "kl_estimator": KL_ESTIMATORS,
            "rollout_correction": ("none", *ROLLOUT_CORRECTIONS),
            "behavior_logprobs": ("trainer", "rollout"),
            "routing_replay": REPLAY_MODES,
            "routing_dtype": CODECS,
            "rollout_engine": ENGINES,
            "weight_sync_transport": WEIGHT_SYNC_TRANSPORTS,
            "rollout_dtype": ("float32", "bfloat16"),
            "device": ("auto", "cpu", "cuda"),
            "transformer_impl": TRANSFORMER_IMPLS,
            "wandb_mode": ("offline", "online", "disabled"),
            "prompt_too_long": ("error", "drop", "truncate-left"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"--{_flag(name)}={getattr(self, name)!r}: choose one of {allowed}"
                )
        if self.loss_agg_mode is not None and self.loss_agg_mode not in AGGREGATION_MODES:
            raise ValueError(
                f"--loss-agg-mode={self.loss_agg_mode!r}: choose one of {AGGREGATION_MODES}"
            )
        if self.recompute_granularity not in (None, "full"):
            raise ValueError("--recompute-granularity: only 'full' is supported")
        positive = (
            "tensor_model_parallel_size",
            "expert_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "train_iters",
            "micro_batch_size",
            "global_batch_size",
            "rollout_batch_size",
            "n_samples_per_prompt",
            "max_response_length",
            "max_bad_steps",
            "sglang_engine_ranks",
            "sglang_min_servers",
        )
        for name in positive:
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"--{_flag(name)}={value!r}: must be an integer >= 1")
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ValueError(f"--max-prompt-length={self.max_prompt_length}: must be >= 1")
        if self.max_tokens_per_gpu is not None and not (
            isinstance(self.max_tokens_per_gpu, int) and self.max_tokens_per_gpu >= 0
        ):
            raise ValueError(
                f"--max-tokens-per-gpu={self.max_tokens_per_gpu!r}: must be an integer >= 1 "
                "(padded tokens per micro-batch), or 0 to keep --micro-batch-size rows"
            )
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"--torch-threads={self.torch_threads}: must be >= 1")
        if not (math.isfinite(self.weight_sync_min_gbps) and self.weight_sync_min_gbps > 0):
            raise ValueError(
                f"--weight-sync-min-gbps={self.weight_sync_min_gbps}: must be a number > 0 (GB/s)"
            )
        if not self.sglang_startup_timeout > 0:
            raise ValueError(
                f"--sglang-startup-timeout={self.sglang_startup_timeout}: must be > 0 seconds"
            )
        if self.sglang_request_timeout is not None and not self.sglang_request_timeout > 0:
            raise ValueError(
                f"--sglang-request-timeout={self.sglang_request_timeout}: must be > 0 (or none)"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr={self.lr}: must be a finite number > 0")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"--kl-coef={self.kl_coef}: must be a finite number >= 0")
        if self.save_interval < 0:
            raise ValueError(f"--save-interval={self.save_interval}: must be >= 0")
        if self.ckpt_format not in ("torch", "torch_dist"):
            raise ValueError(f"--ckpt-format={self.ckpt_format}: choose torch or torch_dist")
        if self.async_save and self.ckpt_format != "torch_dist":
            raise ValueError(
                "--async-save needs --ckpt-format torch_dist (megatron dist_checkpointing's "
                "asynchronous writer); add it or drop --async-save"
            )
        if self.save_interval and not self.save:
            raise ValueError(
                f"--save-interval {self.save_interval} without --save: nothing would be saved; "
                "give --save DIR or drop --save-interval"
            )
        self._check_sampling()
        self._check_loss_params()
        self._check_combinations()

    def _check_sampling(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(
                f"--temperature={self.temperature}: must be > 0 (at 0 every sample of a prompt is "
                "the same, every group has zero variance and nothing is learned)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p={self.top_p}: must be in (0, 1] (1 keeps every token)")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"--top-k={self.top_k}: must be -1 (no limit) or >= 1")

    def _check_loss_params(self) -> None:
        spec = get_loss_spec(self.loss)
        known = [f.name for f in dataclasses.fields(spec.config_cls)]
        for name, _ in self.loss_params:
            if name not in known:
                theirs = ", ".join(f"--{_flag(k)}" for k in known) or "none"
                raise ValueError(
                    f"--{_flag(name)} is not a hyperparameter of --loss {self.loss} (its "
                    f"hyperparameters: {theirs}); drop the flag or choose the loss that has it"
                )
        spec.make_config(dict(self.loss_params))  # value checks of the loss's own config

    def _check_combinations(self) -> None:
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(
                f"--optimizer-offload-fraction={self.optimizer_offload_fraction}: must be in [0, 1]"
            )
        if self.optimizer_cpu_offload and not self.use_distributed_optimizer:
            raise ValueError(
                "--optimizer-cpu-offload needs --use-distributed-optimizer (megatron offloads "
                "through its distributed, precision-aware optimizer)"
            )
        if self.context_parallel_size > 1:
            raise ValueError(
                "--context-parallel-size > 1 is not supported by the trainer yet (its attention "
                "needs Transformer Engine; the sharding and the losses' CP reductions are in "
                "megatron_rl/train/context_parallel.py); use tensor/pipeline/expert parallelism"
            )
        uneven = (self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers)
        for name, value in zip(("first", "last"), uneven, strict=True):
            if value is not None and (self.pipeline_model_parallel_size == 1 or value < 1):
                raise ValueError(
                    f"--decoder-{name}-pipeline-num-layers={value}: needs "
                    "--pipeline-model-parallel-size > 1 and a value >= 1"
                )
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        if self.rollout_engine == "sglang" and not self.sglang_url:
            raise ValueError("--rollout-engine sglang needs at least one --sglang-url")
        if (
            self.routing_replay == "r3"
            and self.rollout_engine == "sglang"
            and not self.sglang_return_routed_experts
        ):
            raise ValueError(
                "--routing-replay r3 needs routes from the engine: launch the SGLang servers with "
                "--enable-return-routed-experts and pass --sglang-return-routed-experts, or use "
                "--routing-replay r2"
            )
        if self.routing_record_only and self.routing_replay == "off":
            raise ValueError("--routing-record-only needs --routing-replay r2 or r3")
        if not self.token_budget and self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} is not a multiple of "
                f"--micro-batch-size {self.micro_batch_size}"
            )
        if not (isinstance(self.max_staleness, int) and self.max_staleness >= 1):
            raise ValueError(
                f"--max-staleness={self.max_staleness!r}: must be an integer >= 1 (weight "
                "versions a batch may lag behind the trainer; with --async-rollout one batch is "
                "in flight, so its samples are 1 version behind)"
            )
        if self.max_staleness != 1 and not self.async_rollout:
            raise ValueError(
                f"--max-staleness {self.max_staleness} without --async-rollout: synchronous "
                "rollouts are never stale; add --async-rollout or drop --max-staleness"
            )
        samples = self.samples_per_rollout
        if samples % self.global_batch_size:
            raise ValueError(
                f"a rollout holds --rollout-batch-size x --n-samples-per-prompt = {samples} "
                f"samples, not a multiple of --global-batch-size {self.global_batch_size}; "
                "choose them so that N = samples / global batch is an integer"
            )

    # ------------------------------------------------------------------ component configs
    # The one place where flags become the configs of the components they belong to; every
    # component (and function) takes only its own config.
    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel=self.tensor_model_parallel_size,
            expert_parallel=self.expert_model_parallel_size,
            pipeline_parallel=self.pipeline_model_parallel_size,
            sequence_parallel=self.sequence_parallel,
            seed=self.seed,
        )

    def model_options(self):
        """``ModelOptions`` of the policy (megatron-core side choices)."""
        from megatron_rl.model.config import ModelOptions

        return ModelOptions(
            dtype="bfloat16" if self.bf16 else "float32",
            routing_replay=self.routing_replay != "off",
            recompute=self.recompute_granularity == "full",
            spec={"transformer_engine": "te"}.get(self.transformer_impl, self.transformer_impl),
            first_stage_layers=self.decoder_first_pipeline_num_layers,
            last_stage_layers=self.decoder_last_pipeline_num_layers,
        )

    def replay_config(self) -> ReplayConfig:
        return ReplayConfig(
            mode=self.routing_replay,
            record_only=self.routing_record_only,
            dtype=self.routing_dtype,
        )

    def optimizer_config(self):
        """``OptimizerConfig`` of megatron's optimizer (the same on CPU and GPU)."""
        from megatron_rl.backend.optimizer import OptimizerConfig

        return OptimizerConfig(
            lr=self.lr,
            weight_decay=self.weight_decay,
            adam_beta1=self.adam_beta1,
            adam_beta2=self.adam_beta2,
            adam_eps=self.adam_eps,
            clip_grad=self.clip_grad,
            use_distributed_optimizer=self.use_distributed_optimizer,
            cpu_offload=self.optimizer_cpu_offload,
            offload_fraction=self.optimizer_offload_fraction,
        )

    def objective_config(self) -> ObjectiveConfig:
        return ObjectiveConfig(
            loss=self.loss,
            loss_params=self.loss_params,
            loss_agg_mode=self.loss_agg_mode,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            max_response_length=self.max_response_length,
        )

    def rollout_config(self):
        """``RolloutConfig``: sampling, samples per prompt, advantages."""
        from megatron_rl.train.rollout_phase import RolloutConfig

        return RolloutConfig(
            n_samples_per_prompt=self.n_samples_per_prompt,
            max_response_length=self.max_response_length,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            advantage_estimator=self.advantage_estimator,
            filter_zero_variance_groups=self.filter_zero_variance_groups,
        )

    def task_config(self):
        """``TaskConfig``: the policy checkpoint, prompts and reward."""
        from megatron_rl.train.setup import TaskConfig

        return TaskConfig(
            model=self.model,
            prompt_data=self.prompt_data,
            tokenizer=self.tokenizer,
            max_prompt_length=self.max_prompt_length,
            max_response_length=self.max_response_length,
            prompt_too_long=self.prompt_too_long,
            reward=self.reward,
            seed=self.seed,
            tensor_parallel=self.tensor_model_parallel_size,
        )

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            kind=self.rollout_engine,
            rollout_dtype=self.rollout_dtype,
            routing_dtype=self.routing_dtype,
            sglang_url=self.sglang_url,
            weight_sync_transport=self.weight_sync_transport,
            weight_sync_dir=os.path.join(self.run_dir, "weight_sync"),
            sglang_engine_ranks=self.sglang_engine_ranks,
            sglang_request_timeout=self.sglang_request_timeout,
            sglang_router_url=self.sglang_router_url,
            sglang_min_servers=self.sglang_min_servers,
            sglang_startup_timeout=self.sglang_startup_timeout,
        )

    def logger_config(self):
        """``RunLoggerConfig``: metrics file, wandb, progress bar."""
        from megatron_rl.train.run_logger import RunLoggerConfig

        return RunLoggerConfig(
            run_dir=self.run_dir,
            total_steps=self.train_iters,
            wandb_project=self.wandb_project,
            wandb_mode=self.wandb_mode if self.wandb_project else "disabled",
            wandb_run_name=self.wandb_exp_name,
            show_progress=self.progress,
        )

    # ------------------------------------------------------------------ derived
    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def token_budget(self) -> int | None:
        """Padded tokens per micro-batch (--max-tokens-per-gpu); None: fixed-row micro-batches."""
        return self.max_tokens_per_gpu or None

    @property
    def updates_per_rollout(self) -> int:
        """The staleness ratio N: sequential optimizer steps per rollout."""
        return self.samples_per_rollout // self.global_batch_size

    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """World size / model-parallel size, with the checks megatron would fail on later."""
        dense = self.model_parallel_size() * self.context_parallel_size
        if world_size % dense or world_size % (
            self.expert_model_parallel_size * self.pipeline_model_parallel_size
        ):
            raise ValueError(
                f"world size {world_size} is not divisible by tensor x pipeline x context = "
                f"{dense} or by expert x pipeline; change the parallel sizes or the rank count"
            )
        dp = world_size // dense
        if self.token_budget and self.global_batch_size % dp:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} does not split over {dp} "
                "data-parallel ranks; choose a multiple of the data-parallel size"
            )
        if not self.token_budget and self.global_batch_size % (self.micro_batch_size * dp):
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} is not divisible by "
                f"--micro-batch-size x data-parallel size = {self.micro_batch_size} x {dp}"
            )
        if self.rollout_batch_size % dp:
            raise ValueError(
                f"--rollout-batch-size {self.rollout_batch_size} prompts do not split over "
                f"{dp} data-parallel ranks (each rank keeps whole groups)"
            )
        return dp


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _loss_hyperparameters() -> dict[str, type]:
    """Every hyperparameter name of every registered loss (flag name -> field type)."""
    out: dict[str, type] = {}
    for name in available_losses():
        for f in dataclasses.fields(get_loss_spec(name).config_cls):
            out.setdefault(f.name, f.type)
    return out


def _optional_float(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def build_parser() -> argparse.ArgumentParser:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(
        prog="python -m megatron_rl.train",
        description="RL post-training of a Qwen3-MoE policy on megatron-core.",
    )

    def add(group, name: str, **kwargs):
        dest = name.replace("-", "_")
        if kwargs.get("action") not in ("store_true", "append"):
            kwargs.setdefault("type", type(getattr(defaults, dest)))
        group.add_argument(f"--{name}", dest=dest, default=getattr(defaults, dest), **kwargs)

    g = parser.add_argument_group("model and parallelism (Megatron names)")
    add(g, "model", help="a preset (tiny, tiny-dense-tied, qwen3-30b-a3b, ...) or HF checkpoint")
    for name in ("tensor", "expert", "pipeline"):
        add(g, f"{name}-model-parallel-size")
    for name in ("first", "last"):
        add(
            g,
            f"decoder-{name}-pipeline-num-layers",
            type=int,
            help=f"layers of the {name} pipeline stage (uneven stages); the rest are split evenly",
        )
    add(g, "context-parallel-size")
    add(g, "sequence-parallel", action="store_true")
    add(g, "device", choices=("auto", "cpu", "cuda"))
    add(g, "bf16", action="store_true")
    add(
        g,
        "torch-threads",
        type=int,
        help="torch intra-op threads per process (default: OMP_NUM_THREADS, else (cores - 1) / "
        "local ranks, at least 1)",
    )
    add(g, "recompute-granularity", type=str, choices=("full",))
    add(
        g,
        "transformer-impl",
        choices=TRANSFORMER_IMPLS,
        help="layer spec; auto: transformer_engine on CUDA (error if missing), local on CPU",
    )

    g = parser.add_argument_group("optimisation (Megatron names)")
    for name in ("train-iters", "micro-batch-size", "global-batch-size", "seed"):
        add(g, name)
    for name in ("lr", "weight-decay", "clip-grad", "adam-beta1", "adam-beta2", "adam-eps"):
        add(g, name)
    add(g, "use-distributed-optimizer", action="store_true", help="shard Adam state over DP ranks")
    add(g, "overlap-grad-reduce", action="store_true", help="overlap DP grad reduction, backward")
    add(
        g,
        "optimizer-cpu-offload",
        action="store_true",
        help="megatron's optimizer CPU offload: Adam state and update in host memory (CUDA only; "
        "needs --use-distributed-optimizer)",
    )
    add(g, "optimizer-offload-fraction", help="share of the offloaded optimizer state (0..1)")
    add(
        g,
        "max-tokens-per-gpu",
        type=int,
        help="micro-batches by token budget: rows sorted by length are grouped so that rows x "
        "longest row (padded) stays within this (a longer sample goes alone); replaces "
        "--micro-batch-size; 0 or unset: --micro-batch-size rows (padding, no THD packing)",
    )
    add(
        g,
        "balance-data",
        action="store_true",
        help="re-split every mini-batch's samples over the data-parallel ranks by token count "
        "(Karmarkar-Karp, equal sample counts); the optimizer step sees the same samples",
    )

    g = parser.add_argument_group("RL objective")
    add(g, "loss", choices=available_losses())
    add(g, "loss-agg-mode", type=str, choices=AGGREGATION_MODES)
    add(g, "advantage-estimator", choices=ADVANTAGE_ESTIMATORS)
    add(g, "filter-zero-variance-groups", action="store_true")
    add(g, "kl-coef")
    add(g, "kl-estimator", choices=KL_ESTIMATORS)
    g.add_argument(
        "--no-reference-offload",
        dest="reference_offload",
        action="store_false",
        help="keep the KL reference model on the GPU (default: host memory between uses)",
    )
    add(g, "rollout-correction", choices=("none", *ROLLOUT_CORRECTIONS))
    add(g, "behavior-logprobs", choices=("trainer", "rollout"))
    add(g, "routing-replay", choices=REPLAY_MODES)
    add(g, "routing-dtype", choices=CODECS)
    add(g, "routing-record-only", action="store_true")
    h = parser.add_argument_group("loss hyperparameters (each belongs to some --loss)")
    for name, kind in _loss_hyperparameters().items():
        parse = str if kind in (str, "str") else _optional_float
        h.add_argument(f"--{_flag(name)}", dest=f"lossparam_{name}", type=parse)

    g = parser.add_argument_group("rollout")
    add(g, "rollout-engine", choices=("local", "sglang"))
    g.add_argument(
        "--sglang-url",
        dest="sglang_url",
        action="append",
        default=[],
        help="an SGLang worker (repeat for each); control calls and weight sync go to each",
    )
    add(g, "sglang-router-url", type=str, help="sglang-router: generation goes through it")
    add(
        g,
        "sglang-min-servers",
        help="a dead server is dropped and rejoins after a full weight sync; the run stops only "
        "when fewer than this many are left",
    )
    add(g, "sglang-return-routed-experts", action="store_true")
    add(g, "weight-sync-transport", choices=("distributed", "tensor", "disk"))
    add(g, "sglang-engine-ranks", help="TP ranks of each SGLang server (weight-sync group)")
    add(
        g,
        "sglang-request-timeout",
        type=_optional_float,
        help="read timeout (s) of one SGLang request; default none (a timed-out request is "
        "aborted and retried elsewhere, the server is not marked down)",
    )
    add(
        g,
        "sglang-startup-timeout",
        type=float,
        help="seconds to wait for every SGLang server's /health before the first weight sync "
        "(servers listen only once their model is loaded)",
    )
    add(
        g,
        "weight-sync-min-gbps",
        type=float,
        help="the slowest weight push (GB/s) that is still healthy: the other ranks wait for "
        "rank 0's push at most 300 s + 2 x model bytes / this (not the process group's timeout)",
    )
    add(g, "rollout-dtype", choices=("float32", "bfloat16"))
    for name in ("rollout-batch-size", "n-samples-per-prompt", "max-response-length"):
        add(g, name)
    for name in ("temperature", "top-p", "top-k"):
        add(g, name)
    add(
        g,
        "async-rollout",
        action="store_true",
        help="one-step-off-policy: generate rollout k+1 in the background while step k trains "
        "(samples are 1 weight version behind; see megatron_rl/train/async_rollout.py)",
    )
    add(
        g,
        "max-staleness",
        help="with --async-rollout: a batch more than this many weight versions behind the "
        "trainer is dropped and generated again (>= 1; default 1)",
    )

    g = parser.add_argument_group(
        "data and reward",
        "checked before the model is built; an error is one line naming the file, row and field "
        "(set MEGATRON_RL_DEBUG=1 for the traceback)",
    )
    add(g, "prompt-data", type=str, help="JSONL/Parquet prompts; default: the built-in task")
    add(g, "tokenizer", type=str, help="HF tokenizer folder (default: the --model folder)")
    add(
        g,
        "max-prompt-length",
        type=int,
        help="longest prompt in tokens (chat template included); default and upper bound: the "
        "model's max_position_embeddings - --max-response-length",
    )
    add(
        g,
        "prompt-too-long",
        choices=("error", "drop", "truncate-left"),
        help="a prompt over that limit: error (default; names the row), drop the row, or "
        "truncate-left (keep its last tokens)",
    )
    add(g, "reward", help="builtin, math, or module:function")

    g = parser.add_argument_group("output")
    for name in ("run-dir", "wandb-mode"):
        add(g, name)
    for name in ("save", "load", "wandb-project", "wandb-exp-name"):
        add(g, name, type=str)
    add(g, "save-interval")
    add(
        g,
        "load-fallback",
        action="store_true",
        help="when --load's checkpoint fails its checksums, load the newest older one instead",
    )
    add(
        g,
        "ckpt-format",
        choices=("torch", "torch_dist"),
        help="checkpoint format of --save: torch (per-rank files, resume at the same layout) or "
        "torch_dist (megatron dist_checkpointing: resume at another TP/EP/PP/DP layout); --load "
        "reads either",
    )
    add(
        g,
        "async-save",
        action="store_true",
        help="torch_dist: write checkpoints in the background; a step folder is committed "
        "(checksums, 'latest') only once its write has finished",
    )
    g.add_argument("--no-progress", dest="progress", action="store_false")
    add(g, "max-bad-steps")
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse and validate; a bad combination is a ``ValueError`` naming the flags."""
    namespace = vars(build_parser().parse_args(argv))
    loss_params = tuple(
        (key.removeprefix("lossparam_"), value)
        for key, value in sorted(namespace.items())
        if key.startswith("lossparam_") and value is not None
    )
    kwargs = {k: v for k, v in namespace.items() if not k.startswith("lossparam_")}
    kwargs["sglang_url"] = tuple(kwargs["sglang_url"])
    return TrainConfig(loss_params=loss_params, **kwargs)
