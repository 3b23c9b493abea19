"""Validation of caller input (rollout requests, ids, numbers, text): every rejection names the
offending field (proto path)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from tltd.domain import MAX_TOP_LOGPROBS, RolloutRequest, SamplingParams
from tltd.errors import InvalidArgument, ResourceExhausted
from tltd.settings import Settings

# Caller-chosen ids end up in logs, paths and SQL: keep them boring. Used with fullmatch:
# `$` would also match before a trailing newline ("job\n").
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")

# Below this a temperature is greedy in all but name, and logits / T overflows float32 for
# temperatures near 1e-38 (NaN logprobs); 1e-4 turns a 0.01 logit gap into 100 nats.
MIN_TEMPERATURE = 1e-4

# Bounds on caller text (see check_text).
MAX_NAME = 256  # the jobs.name column
MAX_REASON = 1024  # reasons and notes: CancelJob copies its reason into every open request
MAX_PATH = 4096  # PATH_MAX on Linux


def check_id(value: str, field: str, *, required: bool = True) -> None:
    """Reject empty (when required) or odd-looking ids."""
    if not value:
        if required:
            raise InvalidArgument("must not be empty", field=field)
        return
    if not _ID_RE.fullmatch(value):
        raise InvalidArgument(
            "must be 1-128 characters of letters, digits, '.', '_', ':' or '-' "
            "starting with a letter or digit",
            field=field,
        )


@dataclass(frozen=True)
class ModelLimits:
    """What a job's model allows a request: None where its config.json does not say."""

    vocab_size: int | None = None
    max_positions: int | None = None  # max_position_embeddings: prompt + generated tokens


def check_text(value: str, field: str, max_chars: int) -> None:
    """Reject caller text that would fail later, and differently per database: a NUL character
    (valid in a proto3 string and stored by SQLite, but refused by PostgreSQL text and by file
    paths) or more than `max_chars` characters."""
    if len(value) > max_chars:
        raise InvalidArgument(
            f"must be at most {max_chars} characters, got {len(value)}", field=field
        )
    if "\x00" in value:
        raise InvalidArgument("must not contain a NUL character (\\x00)", field=field)


def check_tokens(tokens: tuple[int, ...], field: str, vocab_size: int | None) -> None:
    # min/max run in C, so a 1024 x 8192 request costs milliseconds; the loop runs only to
    # find the index of a token already known to be bad.
    if min(tokens) < 0 or (vocab_size is not None and max(tokens) >= vocab_size):
        for j, tok in enumerate(tokens):
            if tok < 0:
                raise InvalidArgument(f"token id {tok} is negative", field=f"{field}[{j}]")
            if vocab_size is not None and tok >= vocab_size:
                raise InvalidArgument(
                    f"token id {tok} is outside the model's vocabulary (size {vocab_size})",
                    field=f"{field}[{j}]",
                )


def validate_rollout(
    req: RolloutRequest, settings: Settings, model: ModelLimits | None = None
) -> None:
    """Raise InvalidArgument / ResourceExhausted for the first bad field of a rollout request.

    Sampling values arrive already normalised by the converter (n 0 -> 1, top_p unset -> 1,
    top_k -1 -> 0), so what is checked here is what the engine would run.

    A sample's context (prompt + max_new_tokens) must fit both the model's positions
    (`max_position_embeddings`, known once the job's model is: `model`) and a worker's
    sequence (`worker_max_seq_len`): every sample then ends by a stop token or by reaching
    max_new_tokens (LENGTH), never cut short by a limit the caller did not set.
    """
    # One check per field, in the order the caller's message names them.
    check_id(req.job_id, "job_id")
    check_id(req.request_id, "request_id", required=False)
    _check_sizes(req, settings)
    _check_prompts(req, settings, model)
    _check_sampling(req.sampling, model.vocab_size if model else None)
    _check_bound(req, settings)


def _check_bound(req: RolloutRequest, settings: Settings) -> None:
    """A step bound sends whole groups: at least one, and no more than can come (the
    request's own prompts, or with carried groups the most one request may hold)."""
    for name, set_ in (("carried", req.carried), ("park", req.bound_park),
                       ("deadline_ms", req.bound_deadline_ms),
                       ("max_tokens", req.bound_tokens)):  # fmt: skip
        if set_ and not req.bound_groups:
            raise InvalidArgument("needs bound.groups >= 1", field=f"bound.{name}")
    most = settings.max_prompts_per_request if req.carried else len(req.prompts)
    if req.bound_groups > most:
        raise InvalidArgument(
            f"{req.bound_groups} groups: at most {most} "
            + ("(max_prompts_per_request)" if req.carried else "(the request's prompts)"),
            field="bound.groups",
        )


def _check_sizes(req: RolloutRequest, settings: Settings) -> None:
    """How many prompts and samples, and how many new tokens each, against the daemon's
    limits."""
    s = req.sampling
    if not req.prompts:
        raise InvalidArgument("at least one prompt is required", field="prompts")
    if len(req.prompts) > settings.max_prompts_per_request:
        raise ResourceExhausted(
            f"{len(req.prompts)} prompts exceed the limit of {settings.max_prompts_per_request}",
            field="prompts",
        )
    if s.n < 1:
        raise InvalidArgument(f"must be >= 1, got {s.n}", field="sampling.n")
    if len(req.prompts) * s.n > settings.max_samples_per_request:
        raise ResourceExhausted(
            f"{len(req.prompts)} prompts x n={s.n} = {len(req.prompts) * s.n} samples exceed "
            f"the limit of {settings.max_samples_per_request} per request",
            field="sampling.n",
        )
    if s.max_new_tokens <= 0:
        raise InvalidArgument("must be > 0", field="sampling.max_new_tokens")
    if s.max_new_tokens > settings.max_new_tokens_limit:
        raise InvalidArgument(
            f"{s.max_new_tokens} exceeds the limit of {settings.max_new_tokens_limit}",
            field="sampling.max_new_tokens",
        )


def _check_sampling(s: SamplingParams, vocab: int | None) -> None:
    """The sampling values the engine runs: temperature, top-p/k, seed, stop tokens, logprobs."""
    if math.isnan(s.temperature) or math.isinf(s.temperature) or s.temperature < 0:
        raise InvalidArgument(
            f"must be a finite number >= 0 (0 = greedy), got {s.temperature}",
            field="sampling.temperature",
        )
    if 0 < s.temperature < MIN_TEMPERATURE:
        raise InvalidArgument(
            f"must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {s.temperature}",
            field="sampling.temperature",
        )
    if math.isnan(s.top_p) or not 0.0 < s.top_p <= 1.0:
        raise InvalidArgument(f"must be in (0, 1], got {s.top_p}", field="sampling.top_p")
    if s.top_k < -1:
        raise InvalidArgument(
            f"must be >= 1, or 0 / -1 to disable, got {s.top_k}", field="sampling.top_k"
        )
    if s.seed is not None and not 0 <= s.seed < 2**64:
        raise InvalidArgument(
            f"must be a 64-bit unsigned integer, got {s.seed}", field="sampling.seed"
        )
    if s.stop_token_ids:
        check_tokens(s.stop_token_ids, "sampling.stop_token_ids", vocab)
    for name, n in (("top_logprobs", s.top_logprobs), ("prompt_logprobs", s.prompt_logprobs)):
        if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(
                f"must be in [0, {MAX_TOP_LOGPROBS}], got {n}", field=f"sampling.{name}"
            )


def _check_prompts(req: RolloutRequest, settings: Settings, model: ModelLimits | None) -> None:
    """Each prompt's tokens, and each sample's context (prompt + max_new_tokens) against the
    model's positions and a worker's sequence."""
    s, vocab = req.sampling, model.vocab_size if model else None
    context, holder = context_limit(settings, model)
    for i, prompt in enumerate(req.prompts):
        field = f"prompts[{i}].token_ids"
        if not prompt:
            raise InvalidArgument("must not be empty", field=field)
        if len(prompt) > settings.max_prompt_tokens:
            raise InvalidArgument(
                f"{len(prompt)} tokens exceed the limit of {settings.max_prompt_tokens}",
                field=field,
            )
        if len(prompt) >= context:
            raise InvalidArgument(
                f"{len(prompt)} tokens leave no room to generate: {holder} per sample "
                "(prompt + generated)",
                field=field,
            )
        check_tokens(prompt, field, vocab)
    longest = max(len(p) for p in req.prompts)
    if longest + s.max_new_tokens > context:
        raise InvalidArgument(
            f"{s.max_new_tokens} new tokens after a prompt of {longest} tokens do not fit: "
            f"{holder} per sample (prompt + generated), so at most {context - longest} here",
            field="sampling.max_new_tokens",
        )


def context_limit(settings: Settings, model: ModelLimits | None) -> tuple[int, str]:
    """Tokens one sample may hold (prompt + generated), and what sets that (for messages)."""
    worker = settings.worker_max_seq_len
    if model is not None and model.max_positions is not None and model.max_positions < worker:
        return (
            model.max_positions,
            f"the job's model has positions for {model.max_positions} tokens",
        )
    return worker, f"a worker holds {worker} tokens"
