"""Command line -> one validated `TrainConfig`, whose sections are the components' own configs.

Each section validates itself at construction; `TrainConfig` checks only what spans sections and
fills the `derived` fields (one value, one owner: e.g. ``task.seed`` is ``parallel.seed``). The
flags are generated from the sections' fields (`megatron_rl.flags`): adding a flag is adding one
field with its help text. Flags follow Megatron-LM's names where Megatron has one
(``--tensor-model-parallel-size``, ``--micro-batch-size``, ``--lr``, ``--save``, ...), so launch
arguments carry over. Every loss hyperparameter of every registered loss is a flag as well
(``--clip-high``, ``--c1-pos``, ``--delta-low``, ...); giving one that the chosen ``--loss`` does
not have is an error.

In Python, ``TrainConfig.from_flags(train_iters=3, loss="gspo")`` takes the flags' names (with
underscores) and puts each value in its section.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from functools import partial

from megatron_rl.backend.optimizer_config import OptimizerConfig
from megatron_rl.flags import add_section, derived_fields, flat_names, section_values
from megatron_rl.lora.config import LoRAConfig
from megatron_rl.losses import available_losses, get_loss_spec
from megatron_rl.model.options import ModelOptions
from megatron_rl.parallel import ParallelConfig
from megatron_rl.rollout.engine_config import EngineConfig
from megatron_rl.routing.modes import ReplayConfig
from megatron_rl.runtime import RuntimeConfig
from megatron_rl.train.checkpoint.config import CheckpointConfig
from megatron_rl.train.eval_config import EvalConfig
from megatron_rl.train.objective import ObjectiveConfig
from megatron_rl.train.rollouts.config import RolloutConfig
from megatron_rl.train.run_logger import RunLoggerConfig
from megatron_rl.train.schedule import ScheduleConfig
from megatron_rl.train.task_config import TaskConfig
from megatron_rl.train.teacher import TeacherConfig

# section -> (its title in --help, its class, the CLI's defaults where they differ from the
# component's own: the optimizer's learning rate and distributed-optimizer default, and sequence
# parallelism, which the trainer turns on only when asked)
SECTIONS = {
    "runtime": ("runtime", RuntimeConfig, {}),
    "parallel": ("parallelism (Megatron names)", ParallelConfig, {"sequence_parallel": False}),
    "model": ("model (megatron-core side)", ModelOptions, {}),
    "schedule": ("steps and batches (Megatron names)", ScheduleConfig, {}),
    "optimizer": (
        "optimisation (Megatron names)",
        OptimizerConfig,
        {"lr": 3e-3, "use_distributed_optimizer": False},
    ),
    "objective": ("RL objective", ObjectiveConfig, {}),
    "teacher": ("on-policy distillation", TeacherConfig, {}),
    "lora": ("low-rank adapters (LoRA)", LoRAConfig, {}),
    "replay": ("routing replay", ReplayConfig, {}),
    "rollout": ("rollout", RolloutConfig, {}),
    "engine": ("rollout engine and weight sync", EngineConfig, {}),
    "task": ("data and reward", TaskConfig, {}),
    "eval": ("evaluation on held-out prompts", EvalConfig, {}),
    "checkpoint": ("checkpoints (Megatron names)", CheckpointConfig, {}),
    "logging": ("output", RunLoggerConfig, {}),
}


def _section(name: str, **values):
    """Section ``name`` built from the CLI's defaults and ``values``."""
    _, cls, defaults = SECTIONS[name]
    return cls(**{**defaults, **values})


def _cli_defaults() -> dict:
    return {name: _section(name) for name in SECTIONS}


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    runtime: RuntimeConfig = field(default_factory=partial(_section, "runtime"))
    parallel: ParallelConfig = field(default_factory=partial(_section, "parallel"))
    model: ModelOptions = field(default_factory=partial(_section, "model"))
    schedule: ScheduleConfig = field(default_factory=partial(_section, "schedule"))
    optimizer: OptimizerConfig = field(default_factory=partial(_section, "optimizer"))
    objective: ObjectiveConfig = field(default_factory=partial(_section, "objective"))
    teacher: TeacherConfig = field(default_factory=partial(_section, "teacher"))
    lora: LoRAConfig = field(default_factory=partial(_section, "lora"))
    replay: ReplayConfig = field(default_factory=partial(_section, "replay"))
    rollout: RolloutConfig = field(default_factory=partial(_section, "rollout"))
    engine: EngineConfig = field(default_factory=partial(_section, "engine"))
    task: TaskConfig = field(default_factory=partial(_section, "task"))
    eval: EvalConfig = field(default_factory=partial(_section, "eval"))
    checkpoint: CheckpointConfig = field(default_factory=partial(_section, "checkpoint"))
    logging: RunLoggerConfig = field(default_factory=partial(_section, "logging"))

    def __post_init__(self) -> None:
        for name in SECTIONS:
            section = getattr(self, name)
            expected = SECTIONS[name][1]
            if not isinstance(section, expected):
                raise TypeError(
                    f"TrainConfig.{name}: expected {expected.__name__}, got {section!r}"
                )
        self._fill_derived()
        self._check_across_sections()

    def _fill_derived(self) -> None:
        """Each derived field gets its owner's value (see `megatron_rl.flags.derived`)."""
        values = {
            "replay.mode != 'off'": self.replay.mode != "off",
            "rollout.max_response_length": self.rollout.max_response_length,
            "parallel.seed": self.parallel.seed,
            "parallel.tensor_parallel": self.parallel.tensor_parallel,
            "replay.dtype": self.replay.dtype,
            "rollout.partial_rollout": self.rollout.partial_rollout,
            "logging.run_dir": os.path.join(self.logging.run_dir, "weight_sync"),
            "schedule.train_iters": self.schedule.train_iters,
            "rollout.temperature": self.rollout.temperature,
            "rollout.top_p": self.rollout.top_p,
            "rollout.top_k": self.rollout.top_k,
            "task.reward": self.task.reward,
            "task.prompt_data is None": self.task.prompt_data is None,
        }
        for name in SECTIONS:
            section = getattr(self, name)
            wanted = {f: values[source] for f, source in derived_fields(type(section)).items()}
            if any(getattr(section, f) != v for f, v in wanted.items()):
                object.__setattr__(self, name, dataclasses.replace(section, **wanted))

    def _check_interleaving(self) -> None:
        """The virtual pipeline flags' refusals that need no model config (the layer split is
        checked where the model config is known: `megatron_rl.model.config`)."""
        model, pp = self.model, self.parallel.pipeline_parallel
        if model.interleaved:
            from megatron_rl.model.stages import check_virtual_flags

            check_virtual_flags(
                pp, model.virtual_stages, model.layers_per_virtual_stage, model.uneven_stages
            )
            if self.lora.enabled:
                raise ValueError(
                    "--lora-rank with an interleaved pipeline (--virtual-pipeline-model-parallel-"
                    "size / --num-layers-per-virtual-pipeline-stage): not supported yet; use "
                    "plain pipeline stages"
                )

    def _check_across_sections(self) -> None:
        if self.parallel.context_parallel > 1:
            raise ValueError(
                "--context-parallel-size > 1 is not supported by the trainer yet (context "
                "parallelism needs Transformer Engine's attention); use tensor/pipeline/expert "
                "parallelism"
            )
        self._check_interleaving()
        stages = {"first": self.model.first_stage_layers, "last": self.model.last_stage_layers}
        for name, value in stages.items():
            if value is not None and self.parallel.pipeline_parallel == 1:
                raise ValueError(
                    f"--decoder-{name}-pipeline-num-layers={value}: needs "
                    "--pipeline-model-parallel-size > 1 and a value >= 1"
                )
        if (
            self.replay.mode == "r3"
            and self.engine.kind == "sglang"
            and not self.engine.sglang_return_routed_experts
        ):
            raise ValueError(
                "--routing-replay r3 needs routes from the engine: launch the SGLang servers with "
                "--enable-return-routed-experts and pass --sglang-return-routed-experts, or use "
                "--routing-replay r2"
            )
        objective = self.objective
        schedule = self.rollout.schedule
        spanning = {
            "--partial-rollout": schedule.partial,
            "--carry-over-groups": schedule.carry_over,
        }
        flag = next((name for name, on in spanning.items() if on), None)
        if (
            flag is not None
            and objective.behavior_logprobs == "trainer"
            and objective.rollout_correction == "none"
        ):
            raise ValueError(
                f"{flag}: a sample spanning weight updates has no single trainer-side "
                "behaviour policy; the engine's per-token log-probs are it. Pass "
                "--behavior-logprobs rollout, or a --rollout-correction (e.g. tis-token) with "
                "--behavior-logprobs trainer"
            )
        if (
            schedule.partial
            and self.engine.kind == "sglang"
            and self.engine.sglang_pause_mode == "abort"
        ):
            raise ValueError(
                "--partial-rollout with --rollout-engine sglang needs the servers to keep their "
                "requests across a weight sync: pass --sglang-pause-mode retract (KV recomputed "
                "with the new weights) or in_place (old KV kept), not abort"
            )
        self._check_colocate()
        self._check_teacher()
        self._check_adapter_sync()
        if self.lora.enabled and self.checkpoint.ckpt_format == "torch_dist":
            raise ValueError(
                "--lora-rank with --ckpt-format torch_dist: the adapters have no sharded "
                "checkpoint layout yet (issue 54); use --ckpt-format torch (resume at the same "
                "layout)"
            )
        samples, batch = self.rollout.samples_per_rollout, self.schedule.global_batch_size
        if samples % batch:
            raise ValueError(
                f"a rollout holds --rollout-batch-size x --n-samples-per-prompt = {samples} "
                f"samples, not a multiple of --global-batch-size {batch}; choose them so that "
                "N = samples / global batch is an integer"
            )
        world = os.environ.get("WORLD_SIZE")  # torchrun's: the layout is checked before start
        if world:
            try:
                self.data_parallel_size(int(world))
            except ValueError as err:
                raise ValueError(f"{err} (WORLD_SIZE={world}, set by torchrun)") from None

    def _check_teacher(self) -> None:
        """``--loss-teacher``: per-token advantages, compared at temperature 1 on the full
        vocabulary (megatron_rl/train/teacher.py)."""
        if not self.teacher.enabled:
            return
        spec = get_loss_spec(self.objective.loss)
        refusals = {
            "--temperature": self.rollout.temperature != 1.0,
            "--logprobs-on-sampling-support": self.rollout.logprobs_on_sampling_support,
            # the sampled token's KL makes the advantage per token; the top-K KL is a loss term
            "--opsm-delta": self.objective.opsm_delta is not None and not self.teacher.teacher_topk,
            f"--loss {self.objective.loss}": spec.sequence_advantages
            and not self.teacher.teacher_topk,
        }
        why = {
            "--temperature": "the teacher scores at temperature 1; sample at --temperature 1",
            "--logprobs-on-sampling-support": "the teacher's log-probs are on the full "
            "vocabulary; drop --logprobs-on-sampling-support",
            "--opsm-delta": "OPSM masks by the sign of a sequence's advantage, which "
            "distillation makes per token; drop --opsm-delta",
            f"--loss {self.objective.loss}": "it takes one advantage per sequence; "
            "distillation gives one per token (use gspo_token, grpo, ... or --teacher-topk K)",
        }
        for flag, refused in refusals.items():
            if refused:
                raise ValueError(f"--loss-teacher with {flag}: {why[flag]}")

    def _check_adapter_sync(self) -> None:
        """``--lora-sync adapter``: SGLang servers that load adapters by tensor or folder."""
        if self.lora.lora_sync != "adapter":
            return
        engine = self.engine
        why = None
        if engine.kind != "sglang":
            why = "needs --rollout-engine sglang (the in-process engine takes merged weights)"
        elif engine.weight_sync_transport not in ("tensor", "disk"):
            why = (
                f"over --weight-sync-transport {engine.weight_sync_transport}: SGLang loads "
                "adapters from tensors (tensor) or a folder (disk)"
            )
        elif engine.colocate:
            why = "with --colocate: the colocated sync hands over merged weights per GPU"
        elif engine.weight_sync_fp8_blocks:
            why = "with --weight-sync-fp8-blocks: adapters are sent unquantised"
        if why is not None:
            raise ValueError(f"--lora-sync adapter {why}; or use --lora-sync merged")

    def _check_colocate(self) -> None:
        """``--colocate``: one phase holds the GPUs at a time (train/colocate.py)."""
        if not self.engine.colocate:
            return
        if self.rollout.schedule.overlap:
            raise ValueError(
                "--colocate with --async-rollout: the next rollout would generate while the "
                "trainer holds the GPUs; drop one of them"
            )
        if self.eval.enabled:
            raise ValueError(
                "--colocate with evaluation (--eval-interval / --eval-before-train): between "
                "steps the servers hold only their weights (KV cache released) and cannot "
                "generate; drop the evaluation flags"
            )

    @classmethod
    def from_flags(cls, **flags) -> TrainConfig:
        """A config from flag names with underscores (``train_iters=3``, ``loss="gspo"``,
        ``tensor_model_parallel_size=2``, ``delta_high=3e-3`` for a loss hyperparameter)."""
        values = _by_section(flags)
        return cls(**{name: _section(name, **values.get(name, {})) for name in SECTIONS})

    def with_flags(self, **flags) -> TrainConfig:
        """This config with some flags changed (names as in `from_flags`; loss hyperparameters
        given here replace the whole set)."""
        values = _by_section(flags)
        return TrainConfig(
            **{
                name: dataclasses.replace(getattr(self, name), **values[name])
                if name in values
                else getattr(self, name)
                for name in SECTIONS
            }
        )

    # ------------------------------------------------------------------ derived
    @property
    def samples_per_rollout(self) -> int:
        return self.rollout.samples_per_rollout

    @property
    def updates_per_rollout(self) -> int:
        """The staleness ratio N: sequential optimizer steps per rollout."""
        return self.samples_per_rollout // self.schedule.global_batch_size

    def data_parallel_size(self, world_size: int) -> int:
        """World size / model-parallel size, with the checks megatron would fail on later.

        Checked at parse time too when torchrun's ``WORLD_SIZE`` is set (`_check_across_sections`).
        """
        p, schedule = self.parallel, self.schedule
        dense = p.tensor_parallel * p.pipeline_parallel * p.context_parallel
        expert = p.expert_parallel * p.expert_tensor_parallel * p.pipeline_parallel
        for names, size in (
            (
                "--tensor-model-parallel-size x --pipeline-model-parallel-size x "
                "--context-parallel-size",
                dense,
            ),
            (
                "--expert-model-parallel-size x expert tensor parallel x "
                "--pipeline-model-parallel-size",
                expert,
            ),
        ):
            if world_size % size:
                raise ValueError(
                    f"world size {world_size} is not divisible by {names} = {size}: change "
                    "these sizes or the number of ranks (torchrun --nproc-per-node x --nnodes)"
                )
        dp = world_size // dense
        if schedule.token_budget and schedule.global_batch_size % dp:
            raise ValueError(
                f"--global-batch-size {schedule.global_batch_size} does not split over {dp} "
                "data-parallel ranks; choose a multiple of the data-parallel size"
            )
        micro = schedule.micro_batch_size
        if not schedule.token_budget and schedule.global_batch_size % (micro * dp):
            raise ValueError(
                f"--global-batch-size {schedule.global_batch_size} is not divisible by "
                f"--micro-batch-size x data-parallel size = {micro} x {dp}"
            )
        interleaved = self.model.interleaved
        per_rank = schedule.global_batch_size // dp
        if interleaved and per_rank < p.pipeline_parallel:
            raise ValueError(
                f"the interleaved pipeline schedule needs >= PP={p.pipeline_parallel} "
                f"micro-batches per update and a data-parallel rank holds {per_rank} samples "
                "of one: raise --global-batch-size or lower the data-parallel size"
            )
        if interleaved and not schedule.token_budget and per_rank // micro < p.pipeline_parallel:
            raise ValueError(
                f"the interleaved pipeline schedule needs >= PP={p.pipeline_parallel} "
                f"micro-batches per update, got --global-batch-size {schedule.global_batch_size}"
                f" / (data-parallel size {dp} x --micro-batch-size {micro}) = {per_rank // micro}:"
                " lower --micro-batch-size or raise --global-batch-size"
            )
        if self.rollout.rollout_batch_size % dp:
            raise ValueError(
                f"--rollout-batch-size {self.rollout.rollout_batch_size} prompts do not split "
                f"over {dp} data-parallel ranks (each rank keeps whole groups)"
            )
        return dp


def _by_section(flags: dict) -> dict[str, dict]:
    """``{section: {field: value}}`` of flag names with underscores and the values the flags
    take (``bf16=True``, ``no_progress=True``, ``transformer_impl="local"``); loss
    hyperparameters go to ``objective.loss_params``."""
    names = flat_names(_cli_defaults())
    hyper = _loss_hyperparameters()
    values: dict[str, dict] = {}
    loss_params = []
    for name, value in flags.items():
        if name in names:
            section, field_name, to_value = names[name]
            values.setdefault(section, {})[field_name] = to_value(value)
        elif name in hyper:
            loss_params.append((name, value))
        else:
            raise TypeError(f"TrainConfig: no flag --{name.replace('_', '-')}")
    if loss_params:
        values.setdefault("objective", {})["loss_params"] = tuple(sorted(loss_params))
    return values


def _loss_hyperparameters() -> dict[str, type]:
    """Every hyperparameter name of every registered loss (field name -> field type)."""
    out: dict[str, type] = {}
    for name in available_losses():
        for f in dataclasses.fields(get_loss_spec(name).config_cls):
            out.setdefault(f.name, f.type)
    return out


def _optional_float(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def _program() -> str:
    """The usage line's program: as run (``megatron-rl train``, ``megatron-rl-train``), or
    ``python -m megatron_rl.train`` where ``sys.argv[0]`` is the module's ``__main__.py``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.startswith("megatron-rl") else "python -m megatron_rl.train"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_program(),
        description="RL post-training of a MoE policy (Qwen3-MoE, DeepSeek-V3) on megatron-core.",
    )
    for name, defaults in _cli_defaults().items():
        add_section(parser, name, defaults, SECTIONS[name][0])
    group = parser.add_argument_group("loss hyperparameters (each belongs to some --loss)")
    for name, kind in _loss_hyperparameters().items():
        parse = str if kind in (str, "str") else _optional_float
        group.add_argument(f"--{name.replace('_', '-')}", dest=f"lossparam_{name}", type=parse)
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse and validate; a bad value or combination is a ``ValueError`` naming the flags."""
    namespace = build_parser().parse_args(argv)
    loss_params = tuple(
        (key.removeprefix("lossparam_"), value)
        for key, value in sorted(vars(namespace).items())
        if key.startswith("lossparam_") and value is not None
    )
    values = section_values(namespace, _cli_defaults())
    values["objective"]["loss_params"] = loss_params
    return TrainConfig(**{name: _section(name, **values.get(name, {})) for name in SECTIONS})
