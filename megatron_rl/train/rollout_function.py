"""Custom rollout functions (``--rollout-function module:function``): the contract and its checks.

A rollout function turns a batch of prompts into samples. The built-in single-turn rollout
(`megatron_rl.train.rollouts.phase.single_turn_rollout`, the flag's default) is one; a multi-turn
tool-using one is another (`megatron_rl.train.tool_rollout.calculator_rollout`, what
``--task calculator`` selects). The contract::

    def my_rollout(request: RolloutRequest) -> list[RolloutOutput | RolloutSample]

- ``request.records``: ``B`` prompts (`megatron_rl.data.PromptRecord`: ``prompt_ids``,
  ``answer``); ``request.n``: samples per prompt; ``request.engine``: the run's
  `megatron_rl.rollout.RolloutEngine` (in-process or SGLang: ``engine.generate(prompts, params,
  n=, return_routed_experts=)`` returns `RolloutSample`s with per-token log-probs and, for R3,
  routes); ``request.params``: the run's `SamplingParams` (temperature, top-p/k, length limit,
  ``<eos>`` stop, ``seed``: use it, or seeds derived from it, for a reproducible run);
  ``request.return_routes``: R3 is on, so each sample must carry routes over
  ``P + R - 1`` positions; ``request.tokenizer``; ``request.rollout`` (this section's config) and
  ``request.config`` (the whole run's `TrainConfig`, None outside the trainer).
- It returns exactly ``B * n`` samples, prompt-major (prompt ``i``'s ``j``-th at ``i * n + j``).
  An engine `RolloutSample` as it is means: every response token is trained, the run's
  ``--reward`` scores it. A `RolloutOutput` adds ``loss_mask_R`` (bool ``[R]``; False on tokens
  the policy did not sample, e.g. a tool's answer: they leave the loss and their log-probs are
  never behaviour log-probs) and ``reward`` (a float, or None for the run's reward function).

Checked on every call (`check_outputs`), each failure a `RolloutFunctionError` naming the
function, the sample index and the field: the function raised; it returned a non-list or the
wrong number of samples; a sample of another type, with an empty prompt or response, a prompt
other than its record's, ids outside ``[0, vocab_size)``, log-probs of the wrong length or
non-finite (or positive on a trained token), a loss mask of another length than the response, a
non-finite reward, weight-version spans that do not cover the response, or routes over the
wrong number of positions.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from collections.abc import Callable, Sequence

import torch

from megatron_rl.rollout.types import RolloutSample, SamplingParams

DEFAULT_ROLLOUT_FUNCTION = "megatron_rl.train.rollouts.phase:single_turn_rollout"
"""The ``--rollout-function`` default: the built-in single-turn rollout (or, for a built-in
``--task`` that names its own, that task's function)."""


class RolloutFunctionError(RuntimeError):
    """A rollout function raised or returned samples that break the contract (module doc)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RolloutRequest:
    """What a rollout function receives (module docstring)."""

    records: Sequence  # B `PromptRecord`s
    n: int  # samples per prompt
    engine: object  # a `RolloutEngine`
    params: SamplingParams  # the run's sampling parameters, its seed included
    return_routes: bool  # R3: every sample must carry routes
    tokenizer: object
    rollout: object  # `RolloutConfig`
    config: object | None = None  # the run's `TrainConfig` (None outside the trainer)


@dataclasses.dataclass(kw_only=True, slots=True)
class RolloutOutput:
    """One sample of a rollout function: an engine sample plus its loss mask and reward.

    Attributes:
        sample: ids, per-token engine log-probs, finish reason, versions, routes
            (`RolloutSample`'s contract; ``logprobs_R`` is read on trained tokens only).
        loss_mask_R: bool ``[R]``, True where the response token is trained; None: every one.
        reward: the sample's reward; None: the run's ``--reward`` scores the decoded response.
    """

    sample: RolloutSample
    loss_mask_R: torch.Tensor | None = None
    reward: float | None = None


RolloutFunction = Callable[[RolloutRequest], list]


def resolve_rollout_function(name: str) -> RolloutFunction:
    """The function ``"package.module:function"`` (imported like ``--reward``'s user functions:
    the module must be on ``sys.path``); ValueError naming ``--rollout-function`` otherwise."""
    where = f"--rollout-function {name!r}"
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{where}: write it as 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"{where}: cannot import module {module_name!r} ({err}); make sure it is on sys.path "
            "(installed, or its folder in PYTHONPATH)"
        ) from err
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"{where}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{where}: {attr!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("request")
    except TypeError as err:
        raise ValueError(
            f"{where}: {attr}{inspect.signature(fn)} cannot be called as {attr}(request) ({err}); "
            "give it one positional parameter, the RolloutRequest"
        ) from err
    except ValueError:  # no signature (some C callables): accept
        pass
    return fn


def call_rollout_function(
    fn: RolloutFunction, name: str, request: RolloutRequest, *, vocab_size: int
) -> list[RolloutOutput]:
    """``fn(request)``, checked (`check_outputs`); its exception becomes a `RolloutFunctionError`
    naming ``name`` (the original chained)."""
    try:
        outputs = fn(request)
    except Exception as err:
        raise RolloutFunctionError(
            f"rollout function {name} raised {type(err).__name__}: {err}"
        ) from err
    return check_outputs(name, outputs, request, vocab_size=vocab_size)


def check_outputs(
    name: str, outputs, request: RolloutRequest, *, vocab_size: int
) -> list[RolloutOutput]:
    """``outputs`` as `RolloutOutput`s with a bool ``loss_mask_R`` each, or a
    `RolloutFunctionError` naming ``name``, the sample and the field (module docstring)."""
    expected = len(request.records) * request.n
    if not isinstance(outputs, (list, tuple)):
        raise RolloutFunctionError(
            f"rollout function {name} returned a {type(outputs).__name__}, not a list of samples"
        )
    if len(outputs) != expected:
        raise RolloutFunctionError(
            f"rollout function {name} returned {len(outputs)} samples for {len(request.records)} "
            f"prompts x {request.n} samples = {expected}"
        )
    where = [f"rollout function {name}: sample {i}" for i in range(len(outputs))]
    checked = [_check_one(where[i], out, request, i) for i, out in enumerate(outputs)]
    _fill_missing_masks(checked)
    if checked and not _values_valid(checked, vocab_size):  # find and name the first bad value
        for i, out in enumerate(checked):
            _check_values(where[i], out, vocab_size)
    return checked


def _check_one(where, out, request, index) -> RolloutOutput:
    """One output's types, shapes, prompt, spans, reward and routes (values: `_check_values`)."""
    if isinstance(out, RolloutSample):
        out = RolloutOutput(sample=out)
    if not isinstance(out, RolloutOutput):
        raise RolloutFunctionError(
            f"{where}: a {type(out).__name__}, not a RolloutOutput or RolloutSample"
        )
    s = out.sample
    record = request.records[index // request.n]
    prompt, response = (
        _ids(where, "prompt_ids_P", s.prompt_ids_P),
        _ids(where, "response_ids_R", s.response_ids_R),
    )
    if prompt.tolist() != list(record.prompt_ids):
        raise RolloutFunctionError(
            f"{where}: prompt_ids_P is not the prompt of its record {record.index} (samples are "
            f"prompt-major: prompt i's j-th sample at index i * n + j)"
        )
    num = response.numel()
    if num < 1:
        raise RolloutFunctionError(f"{where}: response_ids_R is empty")
    mask = _mask(where, out.loss_mask_R, num)
    if not isinstance(s.logprobs_R, torch.Tensor) or s.logprobs_R.shape != (num,):
        shape = tuple(getattr(s.logprobs_R, "shape", ()))
        raise RolloutFunctionError(
            f"{where}: logprobs_R has shape {shape}, expected ({num},), one per response token"
        )
    _check_versions(where, s.weight_versions, num)
    if out.reward is not None and not (
        isinstance(out.reward, (int, float)) and math.isfinite(out.reward)
    ):
        raise RolloutFunctionError(f"{where}: reward {out.reward!r} is not a finite number")
    if request.return_routes and (
        s.routes is None or s.routes.num_tokens != num + prompt.numel() - 1
    ):
        got = None if s.routes is None else s.routes.num_tokens
        raise RolloutFunctionError(
            f"{where}: routes cover {got} positions; R3 needs prompt {prompt.numel()} + "
            f"response {num} - 1 = {prompt.numel() + num - 1}"
        )
    return RolloutOutput(sample=s, loss_mask_R=mask, reward=out.reward)


def _values_valid(outputs: list[RolloutOutput], vocab_size: int) -> bool:
    """Every token id in ``[0, vocab_size)`` and every log-prob finite (and <= 1e-4 on trained
    tokens), over all outputs at once (one pass per field instead of one per sample)."""
    ids = torch.cat([t for o in outputs for t in (o.sample.prompt_ids_P, o.sample.response_ids_R)])
    logprobs = torch.cat([o.sample.logprobs_R for o in outputs]).float()
    trained = torch.cat([o.loss_mask_R for o in outputs])
    bad_ids = (ids < 0) | (ids >= vocab_size)
    bad_logprobs = ~torch.isfinite(logprobs) | ((logprobs > 1e-4) & trained)
    return not bool(bad_ids.any() | bad_logprobs.any())


def _check_values(where: str, out: RolloutOutput, vocab_size: int) -> None:
    """`RolloutFunctionError` naming the first out-of-vocabulary id or bad log-prob of ``out``."""
    s, mask = out.sample, out.loss_mask_R
    prompt, response = s.prompt_ids_P, s.response_ids_R
    for field, ids in (("prompt_ids_P", prompt), ("response_ids_R", response)):
        bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
        if bad.numel():
            at = int(bad[0])
            raise RolloutFunctionError(
                f"{where}: {field}[{at}] = {int(ids[at])} is outside the vocabulary "
                f"[0, {vocab_size})"
            )
    logprobs = s.logprobs_R.float()
    bad = (~torch.isfinite(logprobs) | ((logprobs > 1e-4) & mask)).nonzero()
    if bad.numel():
        at = int(bad[0])
        raise RolloutFunctionError(
            f"{where}: logprobs_R[{at}] = {float(logprobs[at])}; engine log-probs must be "
            "finite (and <= 0 on trained tokens)"
        )


def _check_versions(where: str, spans, num: int) -> None:
    """``weight_versions``: empty, or ``(version, start, end)`` spans covering ``[0, num)`` in
    order (`megatron_rl.train.token_versions`)."""
    end = 0
    for span in spans:
        if len(span) != 3 or span[1] != end or span[2] <= span[1]:
            break
        end = span[2]
    else:
        if not spans or end == num:
            return
    raise RolloutFunctionError(
        f"{where}: weight_versions {list(spans)!r} do not cover the {num} response tokens in "
        "order; give (version, start, end) spans over [0, R), or () for one version"
    )


def _ids(where: str, field: str, ids) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point():
        raise RolloutFunctionError(f"{where}: {field} must be a 1-D integer tensor")
    return ids


def _fill_missing_masks(outputs: list[RolloutOutput]) -> None:
    """All-True loss masks for the outputs without one, as views of one tensor (one
    allocation for the batch, not one per sample)."""
    missing = [i for i, out in enumerate(outputs) if out.loss_mask_R is None]
    nums = [outputs[i].sample.response_ids_R.numel() for i in missing]
    for i, ones in zip(missing, torch.ones(sum(nums), dtype=torch.bool).split(nums), strict=True):
        outputs[i].loss_mask_R = ones


def _mask(where: str, mask, num: int) -> torch.Tensor | None:
    """The bool ``[num]`` loss mask (None stays None: `_fill_missing_masks` makes it)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 1:
        raise RolloutFunctionError(f"{where}: loss_mask_R must be a 1-D tensor")
    if mask.numel() != num:
        longer = "longer" if mask.numel() > num else "shorter"
        raise RolloutFunctionError(
            f"{where}: loss_mask_R has {mask.numel()} entries, {longer} than the "
            f"{num} response tokens"
        )
    return mask.to(torch.bool)
