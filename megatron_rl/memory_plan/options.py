"""The training choices besides the layout that decide memory (dtype, optimizer, recompute,
micro-batch, routing replay, reference model, attention spec)."""

from __future__ import annotations

import dataclasses

from megatron_rl.backend.grad_check import GRAD_CHECK_CHUNK_ELEMENTS
from megatron_rl.routing.codec import CODECS

DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
RECOMPUTE = ("full", "none")
REFERENCE = ("off", "gpu", "cpu")
REPLAY = ("off", "r2", "r3")
SYNC_SENDERS = ("every-stage", "first-stage", "every-rank")  # who holds the sync's staging
SPECS = ("te", "local")  # megatron layer spec: Transformer Engine (fused attention) or local


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """Training choices that decide memory besides the layout."""

    params_dtype: str = "bfloat16"
    distributed_optimizer: bool = True
    recompute: str = "full"  # "full" (uniform, 1 layer per checkpoint) or "none"
    micro_batch_tokens: int = 4096  # b * s of one micro-batch on one data-parallel rank
    logprob_chunk_tokens: int = 4096
    routing_replay: str = "off"  # off | r2 (recorded by the trainer) | r3 (by the engine)
    routing_codec: str = "auto"
    routing_tokens: int | None = None  # tokens of routing state held per rank, or:
    routing_responses: int | None = None  # responses per RL step (whole batch) ...
    routing_response_tokens: int | None = None  # ... of this many tokens each
    reference: str = "off"  # KL reference model: off | gpu | cpu (offloaded)
    moe_imbalance: float = 1.0  # expert tokens on the fullest GPU / the balanced share
    reserve_gib: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
    # megatron's --optimizer-cpu-offload: this share of each rank's optimizer shard lives (and is
    # updated) in host memory; 0: no offload (needs the distributed optimizer when > 0)
    optimizer_offload_fraction: float = 0.0
    # "te": Transformer Engine's fused attention (no [s, s] tensors) and its FusedAdam; "local":
    # megatron's unfused DotProductAttention and torch's AdamW (no TE installed), as the GPU smoke
    spec: str = "te"
    micro_batch_sequences: int = 1  # sequences packed in a micro-batch (attention is per sequence)
    # micro-batches per optimizer step on a data-parallel rank (the pipeline schedule's M: its
    # bubble, and the in-flight micro-batches; None: not known, as many as the schedule needs)
    micro_batches: int | None = None
    # elements of a grad buffer the trainer's finiteness check (`backend.grad_check.all_finite`)
    # looks at per call; None: a whole buffer at once (the trainer before it chunked)
    grad_check_chunk_elements: int | None = GRAD_CHECK_CHUNK_ELEMENTS
    # the weight sync's staging buffers, kept allocated between syncs on a sending GPU
    # (`rollout.weight_sync.staging`): the distributed transport packs into 2 of
    # ``sync_bucket_bytes`` (one on the wire, one being packed), CUDA IPC (tensor) into 1;
    # ``sync_senders`` says which GPUs hold them: "every-stage" (each pipeline stage's first
    # rank), "first-stage" (rank 0 only: --weight-sync-from-rank-0) or "every-rank" (tensor)
    sync_staging_buffers: int = 0
    sync_bucket_bytes: int = 512 * 1024**2
    sync_senders: str = "every-stage"
    # LoRA (`megatron_rl.lora`): rank 0 is full fine-tuning; else the base is frozen and only
    # the adapters of ``lora_targets`` have gradient buffers and optimizer state
    lora_rank: int = 0
    lora_targets: str = "attention"
    lora_experts: str = "per-expert"

    def __post_init__(self) -> None:
        self.lora()  # the LoRA fields checked as the trainer checks them
        choices = {
            "params_dtype": tuple(DTYPE_BYTES),
            "recompute": RECOMPUTE,
            "routing_replay": REPLAY,
            "routing_codec": CODECS,
            "reference": REFERENCE,
            "spec": SPECS,
            "sync_senders": SYNC_SENDERS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {allowed}")
        for name in ("micro_batch_tokens", "logprob_chunk_tokens", "micro_batch_sequences"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if self.micro_batches is not None and not (
            isinstance(self.micro_batches, int) and self.micro_batches >= 1
        ):
            raise ValueError(f"micro_batches={self.micro_batches!r}: must be None or >= 1")
        chunk = self.grad_check_chunk_elements
        if chunk is not None and not (isinstance(chunk, int) and chunk >= 1):
            raise ValueError(
                f"grad_check_chunk_elements={chunk!r}: must be None or an integer >= 1"
            )
        for name in ("sync_staging_buffers", "sync_bucket_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 0):
                raise ValueError(f"{name}={value!r}: must be an integer >= 0")
        if self.micro_batch_tokens % self.micro_batch_sequences:
            raise ValueError(
                f"micro_batch_tokens={self.micro_batch_tokens} is not a multiple of "
                f"micro_batch_sequences={self.micro_batch_sequences}"
            )
        if self.moe_imbalance < 1.0 or self.reserve_gib < 0:
            raise ValueError("moe_imbalance must be >= 1 and reserve_gib >= 0")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(
                f"optimizer_offload_fraction={self.optimizer_offload_fraction}: must be in [0, 1]"
            )
        if self.optimizer_offload_fraction and not self.distributed_optimizer:
            raise ValueError(
                "optimizer_offload_fraction > 0 needs distributed_optimizer (megatron offloads "
                "through its distributed, precision-aware optimizer)"
            )
        if self.routing_replay != "off":
            by_batch = (self.routing_responses, self.routing_response_tokens)
            if (self.routing_tokens is None) == (None in by_batch):
                raise ValueError(
                    "routing replay needs either routing_tokens (per rank) or both "
                    "routing_responses and routing_response_tokens (whole batch)"
                )

    def lora(self):
        """The `LoRAConfig` of these options (``enabled`` when ``lora_rank > 0``)."""
        from megatron_rl.lora.config import LoRAConfig

        return LoRAConfig(
            lora_rank=self.lora_rank, lora_targets=self.lora_targets, lora_experts=self.lora_experts
        )

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.params_dtype]
