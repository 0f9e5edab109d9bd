"""SGLang ``/generate`` payloads: build a request, decode and check an answer (pure functions).

Field names follow SGLang 0.5's ``GenerateReqInput`` / ``SamplingParams`` (``io_struct.py``,
``sampling_params.py``); `GENERATE_FIELDS` and `SAMPLING_FIELDS` list those this client sends,
so a test can compare them with SGLang's dataclasses where sglang is importable.

``routed_experts`` arrives as base64 of raw little-endian int32 ``[P + R - 1, L, K]``; it is
viewed in place over that sample's decoded bytes and encoded straight into the
`RoutingCodec`'s dtype, one sample at a time, so no int32 copy of the batch ever exists.
"""

from __future__ import annotations

import base64
import math

import torch

from megatron_rl.rollout.sampling import row_seed
from megatron_rl.rollout.types import RolloutSample, SamplingParams
from megatron_rl.routing import RoutingCodec

GENERATE_FIELDS = (
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "return_routed_experts",
    "rid",
)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "n")
SEED_FIELD = "sampling_seed"  # SGLang >= 0.5; needs deterministic sampling on the server


def generate_request(
    prompt: list[int],
    params: SamplingParams,
    *,
    prompt_index: int,
    sample_index: int,
    rid: str,
    return_routed_experts: bool,
) -> dict:
    """The JSON body of one ``/generate`` call (one sample, ``n = 1``)."""
    sampling = params.to_sglang()
    if params.seed is not None:  # per sample, so a retried sample draws the same tokens
        sampling[SEED_FIELD] = row_seed(params.seed, prompt_index, sample_index)
    payload = {
        "input_ids": prompt,
        "sampling_params": sampling,
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": rid,
    }
    if return_routed_experts:
        payload["return_routed_experts"] = True
    return payload


def parse_version(value: object, where: str) -> int:
    """SGLang's ``weight_version`` string -> int (``"default"``, never updated, is 0)."""
    if value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise RuntimeError(f"{where}: weight_version {value!r} is not an integer") from None


def decode_generate(
    body: object,
    *,
    prompt: list[int],
    prompt_index: int,
    sample_index: int,
    codec: RoutingCodec | None,
    num_moe_layers: int,
) -> RolloutSample:
    """A checked `RolloutSample` from one ``/generate`` answer; RuntimeError names the sample."""
    name = f"sample (prompt {prompt_index}, sample {sample_index})"
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise RuntimeError(f"{name}: answer has no meta_info: {str(body)[:200]}")
    meta = body["meta_info"]
    output_ids = body.get("output_ids")
    if not isinstance(output_ids, list) or not output_ids:
        raise RuntimeError(
            f"{name}: answer has no output_ids (start SGLang with --skip-tokenizer-init)"
        )
    token_logprobs = meta.get("output_token_logprobs")
    if not isinstance(token_logprobs, list) or len(token_logprobs) != len(output_ids):
        got = len(token_logprobs) if isinstance(token_logprobs, list) else token_logprobs
        raise RuntimeError(f"{name}: {got} output_token_logprobs for {len(output_ids)} tokens")
    logprobs = []
    for k, (entry, token) in enumerate(zip(token_logprobs, output_ids, strict=True)):
        value = entry[0] if isinstance(entry, (list, tuple)) and entry else None
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RuntimeError(f"{name}: logprob {value!r} of response token {k} is not finite")
        if len(entry) > 1 and entry[1] is not None and int(entry[1]) != int(token):
            raise RuntimeError(f"{name}: logprob entry {k} is for token {entry[1]}, not {token}")
        logprobs.append(float(value))
    reason = meta.get("finish_reason")
    reason = reason.get("type") if isinstance(reason, dict) else reason
    routes = None
    if codec is not None:
        routes = _decode_routes(
            meta.get("routed_experts"),
            name,
            len(prompt) + len(output_ids) - 1,
            num_moe_layers,
            codec,
        )
    sample = RolloutSample(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_ids_P=torch.tensor(prompt, dtype=torch.long),
        response_ids_R=torch.tensor(output_ids, dtype=torch.long),
        logprobs_R=torch.tensor(logprobs, dtype=torch.float32),
        finish_reason=str(reason) if reason is not None else "abort",
        weight_version=parse_version(meta.get("weight_version"), name),
        routes=routes,
    )
    sample.check(num_moe_layers=num_moe_layers)
    return sample


def _decode_routes(encoded: object, name: str, positions: int, layers: int, codec: RoutingCodec):
    if not isinstance(encoded, str):
        raise RuntimeError(
            f"{name}: routed_experts missing (start SGLang with --enable-return-routed-experts)"
        )
    raw = base64.b64decode(encoded)
    row_bytes = layers * codec.topk * 4
    if len(raw) != positions * row_bytes:
        raise RuntimeError(
            f"{name}: routed_experts holds {len(raw)} bytes = {len(raw) / row_bytes:g} rows of "
            f"[{layers} layers, top-{codec.topk}] int32; expected {positions} rows "
            "(prompt + response - 1)"
        )
    # One sample's bytes, viewed (not converted) as int32; the codec narrows it right away.
    view_TLK = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(positions, layers, -1)
    try:
        return codec.encode(view_TLK)
    except ValueError as err:
        raise RuntimeError(f"{name}: bad routed_experts: {err}") from err
