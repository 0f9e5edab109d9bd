"""Colocated mode (the trainer's ``--colocate``): trainer ranks and SGLang servers share the GPUs.

Per GPU, with ``C`` the GPU's memory, ``W = model bytes / server TP`` the server's weights share
and the trainer's plan (`plan_memory`) for the fullest pipeline stage:

    startup  trainer static terms            + W + server residue (released: context, NCCL, cache)
    train    trainer peak                    + residue
    sync     trainer static terms            + W + residue + one weight-sync bucket
    rollout  trainer resident after offload  + W + KV + SGLang's reserve  =  C

so the KV-cache budget is ``KV = C - resident - W - reserve``, and SGLang, which sizes its pool
as ``free memory at start x mem_fraction_static - W`` (``kv_cache_configurator.
_profile_available_bytes``), gets ``mem_fraction_static = floor((W + KV) / C, 2 digits)``.
Tokens: ``KV / (layers x 2 x max(1, kv_heads / TP) x head_dim x kv dtype bytes)`` (SGLang
replicates KV heads when TP exceeds them). The trainer's resident remainder is its on-GPU static
terms less what `megatron_rl.train.offload` moves (parameters, padding, grad buffers, optimizer
state): the reserve, GPU routing state, a GPU reference model, the scores buffer.

``startup``: the trainer releases the servers' KV cache and CUDA graphs
(`megatron_rl.train.colocate.release_generation_memory`) before it builds its model and optimizer
(train/trainer.py, slime's order), so the servers hold only their weights then: one bucket less
than ``sync``, and the rollout-optimal fraction is safe from the start.

Host, per node: ``gpus_per_node x`` (what offload pins per rank + the plan's host terms).
"""

from __future__ import annotations

import dataclasses
import math

from megatron_rl.memory_plan.plan import MemoryPlan
from megatron_rl.memory_plan.terms import GIB, Phase, Term

MIB = 1024**2
# what `TrainerOffload` moves to host memory (train/offload.py): the plan's terms of the same
OFFLOADED = (
    "parameters: dense",
    "parameters: experts",
    "parameter buffer padding",
    "gradient buffers",
    "optimizer: dense",
    "optimizer: experts",
)
PHASE_STARTUP = "startup: trainer built, servers' weights only"
PHASE_TRAIN = "train: trainer peak, servers released"
PHASE_SYNC = "weight sync: trainer static, servers' weights back"
PHASE_ROLLOUT = "rollout: trainer offloaded, servers resident"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ServerOptions:
    """The SGLang servers that share the trainer's GPUs (one TP group of ``tp`` GPUs each)."""

    tp: int = 8
    gpus_per_node: int = 8
    kv_dtype_bytes: int = 2  # bf16 KV cache (SGLang's --kv-cache-dtype auto)
    # a released server still holds: its CUDA context (~0.6 GiB), NCCL and custom all-reduce
    # buffers (~0.5 GiB) and torch's cache of its eager activations (SGLang empties no cache on
    # release_memory_occupation): assumed
    residue_gib: float = 3.0
    # SGLang's non-static share (activations, CUDA graphs); None: SGLang's own heuristic
    reserve_gib: float | None = None
    chunked_prefill_tokens: int = 8192  # SGLang's default on H100 / H200
    decode_max_bs: int = 512  # SGLang's default CUDA-graph batch at TP >= 4 on H100 / H200
    bucket_bytes: int = 512 * MIB  # the weight sync's staging bucket (WeightSyncConfig)
    host_gib: float = 2048.0  # host memory of a node

    def __post_init__(self) -> None:
        for name in ("tp", "gpus_per_node", "kv_dtype_bytes", "chunked_prefill_tokens"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"ServerOptions.{name}={value!r}: must be an integer >= 1")
        if self.gpus_per_node % self.tp:
            raise ValueError(
                f"ServerOptions.tp={self.tp} must divide gpus_per_node={self.gpus_per_node}: "
                "every GPU of a node holds one server rank"
            )
        if self.residue_gib < 0 or (self.reserve_gib is not None and self.reserve_gib < 0):
            raise ValueError("ServerOptions.residue_gib and reserve_gib must be >= 0")

    @property
    def reserve_bytes(self) -> int:
        """SGLang's non-static share (``arg_groups/memory_hook.py``, GPUs over 60 GB): 512 MB +
        1.5 MB x chunked-prefill tokens + 1 GB x TP / 8 + 2 MB x decode max batch, >= 10 GB."""
        if self.reserve_gib is not None:
            return int(self.reserve_gib * GIB)
        mib = 512 + 1.5 * self.chunked_prefill_tokens + 1024 * self.tp / 8
        mib += 2 * self.decode_max_bs
        return int(max(mib, 10 * 1024) * MIB)


def kv_bytes_per_token(shape, server: ServerOptions) -> int:
    """KV bytes one token takes on each GPU of a server: ``layers x 2 x max(1, kv_heads / TP) x
    head_dim x dtype bytes``; with multi-latent attention SGLang caches the compressed latent
    and the rope key on every GPU, ``layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes``."""
    if shape.mla:
        latent = shape.kv_lora_rank + shape.qk_rope_head_dim
        return shape.num_layers * latent * server.kv_dtype_bytes
    heads = max(1, shape.num_kv_heads // server.tp)
    return shape.num_layers * 2 * heads * shape.head_dim * server.kv_dtype_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class ColocatedPlan:
    """Per GPU: the four phases; the KV budget, its tokens and the ``--mem-fraction-static``;
    per node: the host copies. ``problems``: why the layout cannot run (empty: it can)."""

    plan: MemoryPlan
    server: ServerOptions
    phases: tuple[Phase, ...]
    weights_bytes: int  # the server's weights share per GPU
    kv_bytes: int
    kv_bytes_per_token: int
    mem_fraction_static: float
    host_bytes_per_node: int
    problems: tuple[str, ...]

    @property
    def kv_tokens(self) -> int:
        return self.kv_bytes // self.kv_bytes_per_token

    @property
    def fits(self) -> bool:
        return not self.problems

    def phase(self, name: str) -> Phase:
        return next(phase for phase in self.phases if phase.name == name)

    def to_dict(self) -> dict:
        return {
            "server": dataclasses.asdict(self.server),
            "phases": {
                phase.name: {
                    "gib": round(phase.nbytes / GIB, 4),
                    "terms": {t.name: round(t.gib, 4) for t in phase.terms},
                }
                for phase in self.phases
            },
            "server_weights_gib": round(self.weights_bytes / GIB, 4),
            "kv_cache_gib": round(self.kv_bytes / GIB, 4),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_tokens": self.kv_tokens,
            "mem_fraction_static": self.mem_fraction_static,
            "host_gib_per_node": round(self.host_bytes_per_node / GIB, 4),
            "fits": self.fits,
            "problems": list(self.problems),
        }


def _split(stage) -> tuple[int, int, list[Term]]:
    """(bytes offload moves to the host, bytes it leaves on the GPU, the terms left)."""
    on_gpu = [t for t in stage.static if t.on_gpu]
    kept = [t for t in on_gpu if t.name not in OFFLOADED]
    moved = sum(t.nbytes for t in on_gpu) - sum(t.nbytes for t in kept)
    return moved, sum(t.nbytes for t in kept), kept


def plan_colocated(plan: MemoryPlan, server: ServerOptions | None = None) -> ColocatedPlan:
    """The colocated view of a trainer's ``plan`` on its own GPUs (see the module docstring).

    The fullest stage (``plan.peak``) gives the trainer's terms; the resident remainder and the
    host copies are each the largest over the pipeline stages."""
    server = server or ServerOptions()
    capacity = int(plan.gpu_gib * GIB)
    weights = plan.shape.total_params() * plan.options.param_bytes // server.tp
    moved, _, kept = _split(plan.peak)
    resident = max(_split(stage)[1] for stage in plan.stages)
    kv_max = capacity - resident - weights - server.reserve_bytes
    fraction = math.floor(100 * (weights + kv_max) / capacity) / 100 if kv_max > 0 else 0.0
    kv = max(0, int(fraction * capacity) - weights)

    static = Term("trainer static", moved + _split(plan.peak)[1], True, note="no activations")
    residue = Term("server residue", int(server.residue_gib * GIB), False, note="released")
    w_term = Term("server weights", weights, True, note=f"model bytes / server TP {server.tp}")
    kv_term = Term("KV cache", kv, False, note=f"{fraction} x GPU - server weights")
    phases = (
        Phase(PHASE_STARTUP, (static, w_term, residue)),
        Phase(
            PHASE_TRAIN,
            (Term("trainer peak", plan.peak.gpu_bytes, False, plan.peak.peak_phase.name), residue),
        ),
        Phase(PHASE_SYNC, (static, w_term, residue, Term("bucket", server.bucket_bytes, True))),
        Phase(
            PHASE_ROLLOUT,
            (*kept, w_term, kv_term, Term("SGLang reserve", server.reserve_bytes, False)),
        ),
    )
    problems = []
    if kv <= 0:
        problems.append(
            f"no KV cache: the trainer's resident {resident / GIB:.2f} GiB + server weights "
            f"{weights / GIB:.2f} GiB + SGLang's reserve {server.reserve_bytes / GIB:.2f} GiB "
            f"leave {kv_max / GIB:.2f} GiB of {plan.gpu_gib:g}; use more GPUs or a larger server TP"
        )
    for phase in phases:  # the rollout fills the GPU by construction (or has no KV: above)
        if phase.name != PHASE_ROLLOUT and phase.nbytes > capacity:
            problems.append(f"{phase.name}: {phase.nbytes / GIB:.2f} > {plan.gpu_gib:g} GiB")
    host_terms = max(sum(t.nbytes for t in s.terms if not t.on_gpu) for s in plan.stages)
    host = server.gpus_per_node * (max(_split(s)[0] for s in plan.stages) + host_terms)
    if host > server.host_gib * GIB:
        problems.append(
            f"host: {host / GIB:.1f} GiB per node > {server.host_gib:g} GiB (every rank's "
            "offloaded parameters, gradients and optimizer state)"
        )
    per_token = kv_bytes_per_token(plan.shape, server)
    return ColocatedPlan(
        plan, server, phases, weights, kv, per_token, fraction, host, tuple(problems)
    )
