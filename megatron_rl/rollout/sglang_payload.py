"""SGLang ``/generate`` payloads: build a request, decode and check an answer (pure functions).

Field names follow SGLang's ``GenerateReqInput`` (``srt/managers/io_struct.py``) and
``SamplingParams`` (``srt/sampling/sampling_params.py``); `GENERATE_FIELDS` and
`SAMPLING_FIELDS` list those this client sends, and ``tests/rollout/
test_sglang_contract_payload.py`` checks them against the pinned SGLang's source.

Routed experts (R3), as SGLang 0.5.23 returns them (``srt/state_capturer/base.py``,
``routed_experts.py``): ``meta_info["routed_experts"]`` is base64 of the raw native-endian
(little-endian on every supported GPU host) int32 tensor ``[P + R - 1, num_hidden_layers, K]``:
one row per position that went through a forward pass, **every** decoder layer (the capture
buffer is sized by the HF config's ``num_hidden_layers``; dense layers, whose gate never writes,
stay zero), ``K = num_experts_per_tok``. `decode_generate` views that sample's bytes in place,
checks the dense layers are all zero (else the server's model has another layer layout), keeps
the MoE layers (``moe_layer_pattern(hf_config)``), rejects positions whose MoE rows are all
zero (never captured) and encodes them straight into the `RoutingCodec`'s dtype, one sample at
a time, so no int32 copy of the batch ever exists.

Prefix (radix) cache: SGLang keeps routes per KV-cache slot and reads a request's routes through
its slot table (``base.py`` ``get_topk``: ``host_cache.buffer[req_to_token[...]]``), so prompt
tokens served from the radix cache return the routes recorded when their KV was computed (the n
samples of a prompt share them; weight syncs flush the cache, so they are the current weights'
routes). SGLang does not restore them for slots reloaded by ``--enable-hierarchical-cache``;
such rows come back stale or zero, and zero rows are rejected here, so do not combine HiCache
with R3. There is no per-request option to bypass the cache (``--disable-radix-cache`` is
server-wide).

SGLang floor: ``return_routed_experts`` exists from 0.5.7, but until 0.5.9 a server started
with ``--skip-tokenizer-init`` (which this client needs for ``output_ids``) put the raw tensor
in the answer instead of base64; 0.5.10 is the first that encodes it on that path.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence

import torch

from megatron_rl.rollout.sampling import row_seed
from megatron_rl.rollout.types import RolloutSample, SamplingParams, pad_supports
from megatron_rl.routing import RoutingCodec

GENERATE_FIELDS = (
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "return_routed_experts",
    "return_sampling_mask",
    "rid",
)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "n")
# Honoured only by a server started with ``--enable-deterministic-inference``: without it SGLang
# builds no seed tensor and samples unseeded (``srt/sampling/sampling_batch_info.py``, the
# ``enable_deterministic`` branch); with it, a request without a seed gets 42.
SEED_FIELD = "sampling_seed"


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
    if params.return_sampling_support:
        payload["return_sampling_mask"] = True
    return payload


def finish_reason(body: object) -> dict:
    """``meta_info.finish_reason`` of a ``/generate`` answer as a dict (``{}`` when absent).

    SGLang reports a request aborted by ``/abort_request``, a pause in ``abort`` mode or a
    weight update that aborts as an HTTP 200 answer with ``{"type": "abort", ...}`` and the
    tokens generated so far: never a sample to train on."""
    meta = body.get("meta_info") if isinstance(body, dict) else None
    reason = meta.get("finish_reason") if isinstance(meta, dict) else None
    if isinstance(reason, dict):
        return reason
    return {} if reason is None else {"type": str(reason)}


def parse_version_spans(spans: object, name: str, num_tokens: int) -> tuple:
    """SGLang's ``meta_info.weight_versions`` (``[{"version", "start", "end"}, ...]``, from
    ``srt/utils/weight_versions.py``) -> ``((version, start, end), ...)``, checked to cover the
    ``num_tokens`` response tokens in order; ``()`` when absent."""
    if spans is None:
        return ()
    try:
        out = tuple(
            (parse_version(s["version"], name), int(s["start"]), int(s["end"])) for s in spans
        )
    except (KeyError, TypeError, ValueError) as err:
        raise RuntimeError(f"{name}: bad weight_versions {str(spans)[:200]}: {err}") from None
    bounds = [0] + [end for _, _, end in out]
    if not out or [s for _, s, _ in out] != bounds[:-1] or bounds[-1] != num_tokens:
        raise RuntimeError(
            f"{name}: weight_versions {list(out)} do not cover its {num_tokens} response tokens"
        )
    return out


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
    layer_pattern: Sequence[int],
    want_support: bool = False,
) -> RolloutSample:
    """A checked `RolloutSample` from one ``/generate`` answer; RuntimeError names the sample.

    ``layer_pattern``: per HF decoder layer, 1 for a MoE layer and 0 for a dense one
    (`megatron_rl.moe_layers.moe_layer_pattern`); the routes keep the MoE layers only.
    ``want_support``: the request asked for ``return_sampling_mask``; the sample's log-probs are
    then the server's on the support (``output_token_sampling_logprobs``).
    """
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
    support = None
    if want_support:
        support, logprobs = _decode_support(meta, name, output_ids)
    reason = meta.get("finish_reason")
    reason = reason.get("type") if isinstance(reason, dict) else reason
    routes = None
    if codec is not None:
        routes = _decode_routes(
            meta.get("routed_experts"),
            name,
            len(prompt) + len(output_ids) - 1,
            layer_pattern,
            codec,
        )
    spans = parse_version_spans(meta.get("weight_versions"), name, len(output_ids))
    version = parse_version(meta.get("weight_version"), name)
    sample = RolloutSample(
        prompt_index=prompt_index,
        sample_index=sample_index,
        prompt_ids_P=torch.tensor(prompt, dtype=torch.long),
        response_ids_R=torch.tensor(output_ids, dtype=torch.long),
        logprobs_R=torch.tensor(logprobs, dtype=torch.float32),
        finish_reason=str(reason) if reason is not None else "abort",
        weight_version=min((v for v, _, _ in spans), default=version),
        weight_versions=spans,
        routes=routes,
        support_RK=support,
    )
    sample.check(num_moe_layers=sum(1 for sparse in layer_pattern if sparse))
    return sample


def _decode_support(meta: dict, name: str, output_ids: list) -> tuple[torch.Tensor, list]:
    """``meta_info``'s ``output_token_sampling_mask`` (per response token, the support's ids in
    descending weight) and ``output_token_sampling_logprobs`` (the sampled token's log-prob
    renormalised on it, SGLang's "selected" mode) -> (int32 ``[R, K]`` -1 padded, floats)."""
    masks = meta.get("output_token_sampling_mask")
    values = meta.get("output_token_sampling_logprobs")
    num = len(output_ids)
    if not isinstance(masks, list) or not isinstance(values, list):
        raise RuntimeError(
            f"{name}: the answer has no output_token_sampling_mask/_logprobs (SGLang >= 0.5.23 "
            "returns them for return_sampling_mask; a finite top_k is required)"
        )
    if len(masks) != num or len(values) != num:
        raise RuntimeError(
            f"{name}: {len(masks)} sampling masks and {len(values)} sampling log-probs for "
            f"{num} response tokens"
        )
    rows = []
    for k, ids in enumerate(masks):
        if not isinstance(ids, list) or not ids:
            raise RuntimeError(f"{name}: empty sampling mask at response token {k}")
        rows.append(torch.tensor(ids, dtype=torch.int32))
    logprobs = []
    for k, value in enumerate(values):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RuntimeError(f"{name}: sampling log-prob {value!r} of response token {k}")
        logprobs.append(float(value))
    return pad_supports(rows), logprobs


def _decode_routes(
    encoded: object, name: str, positions: int, layer_pattern: Sequence[int], codec: RoutingCodec
):
    """All-layer int32 ``[positions, num_hidden_layers, K]`` bytes -> MoE-layer `RoutingBlob`."""
    if encoded is None:
        raise RuntimeError(
            f"{name}: routed_experts missing (start SGLang with --enable-return-routed-experts)"
        )
    if not isinstance(encoded, str):
        raise RuntimeError(
            f"{name}: routed_experts is a {type(encoded).__name__}, not a base64 string (SGLang "
            "0.5.7-0.5.9 with --skip-tokenizer-init do not encode it; use SGLang >= 0.5.10)"
        )
    num_layers = len(layer_pattern)
    raw = base64.b64decode(encoded)
    row_bytes = num_layers * codec.topk * 4
    if len(raw) != positions * row_bytes:
        raise RuntimeError(
            f"{name}: routed_experts holds {len(raw)} bytes = {len(raw) / row_bytes:g} rows of "
            f"[{num_layers} layers (num_hidden_layers), top-{codec.topk}] int32; expected "
            f"{positions} rows (prompt + response - 1)"
        )
    # One sample's bytes, viewed (not converted) as int32 [positions, all layers, K].
    all_TLK = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(positions, num_layers, -1)
    moe = [i for i, sparse in enumerate(layer_pattern) if sparse]
    dense = [i for i, sparse in enumerate(layer_pattern) if not sparse]
    if dense:
        dense_TLK = all_TLK[:, dense]
        if bool(dense_TLK.any()):
            t, j = (int(x) for x in dense_TLK.any(dim=-1).nonzero()[0])
            raise RuntimeError(
                f"{name}: routed_experts has experts {dense_TLK[t, j].tolist()} at position {t} "
                f"of layer {dense[j]}, a dense layer by the HF config (mlp_only_layers / "
                "decoder_sparse_step): the server runs another model layout"
            )
        view_TLK = all_TLK[:, moe]  # this sample's MoE layers: one small int32 copy
    else:
        view_TLK = all_TLK
    if codec.topk > 1:  # an all-zero top-k set is impossible: SGLang never captured that row
        empty_T = (view_TLK == 0).all(dim=-1).any(dim=-1)
        if bool(empty_T.any()):
            where = empty_T.nonzero().flatten().tolist()
            raise RuntimeError(
                f"{name}: routed_experts rows at {len(where)} position(s) (first {where[:8]}) "
                "are all zeros in a MoE layer: SGLang returned no routes there (uncaptured "
                "positions, e.g. prefix-cache slots reloaded by --enable-hierarchical-cache); "
                "routing replay needs every position"
            )
    try:
        return codec.encode(view_TLK)
    except ValueError as err:
        raise RuntimeError(f"{name}: bad routed_experts: {err}") from err
