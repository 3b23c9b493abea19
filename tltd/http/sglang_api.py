"""SGLang-compatible `POST /generate`, `POST /update_weights_from_disk`, `GET /health` and
`GET /get_model_info`, on the job the URL names (/jobs/<job_id>/...) or the only active one."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tltd.domain import (
    MAX_TOP_LOGPROBS,
    FinishReason,
    Job,
    RolloutRequest,
    Sample,
    SamplingParams,
    TopLogprobs,
)
from tltd.errors import InvalidArgument, Unavailable
from tltd.http import door
from tltd.http.errors import failure_body, from_validation
from tltd.http.vocab import Vocab, vocab_for
from tltd.services import PauseMode, Services

log = logging.getLogger(__name__)

RENAMES = (
    (r"^job_id$", "job"),
    (r"^request_id$", "rid"),
    (r"^prompts\[(\d+)\]\.token_ids", r"input_ids[\1]"),
    (r"^prompts$", "input_ids"),
    (r"^sampling\.seed$", "sampling_params.sampling_seed"),
    (r"^sampling\.top_logprobs$", "top_logprobs_num"),
    (r"^sampling\.prompt_logprobs$", "logprob_start_len"),
    (r"^sampling\.", "sampling_params."),
    (r"^checkpoint\.path$", "model_path"),
    (r"^note$", "weight_version"),
)


class SglangSampling(BaseModel):
    """SGLang's SamplingParams fields tltd runs; others are refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True)
    n: int = 1
    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    sampling_seed: int | None = None
    # Text-side only: how `text` is made from the output ids.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # Arguments of a custom logit processor, which tltd never runs (nor does SGLang without
    # one): slime sends them whenever top_p < 1.
    custom_params: dict[str, Any] | None = None
    # Accepted at their no-op values only.
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0


_NO_OP = {
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
}


class GenerateRequest(BaseModel):
    """GenerateReqInput's fields tltd takes (a subset: every body it accepts is a valid
    GenerateReqInput for SGLang itself)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    input_ids: Any = None  # one list of token ids, or a batch of them
    text: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | None = None
    log_metrics: bool = True
    # Accepted at their no-op values only (refuse_unsupported): AReaL sends image_data: []
    # with every text-only request.
    image_data: Any = None
    custom_logit_processor: str | None = None
    return_hidden_states: bool = False
    lora_path: Any = None
    # A turn of a session opened by /open_session (tltd/http/sglang_sessions.py).
    session_params: Any = None


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    keep_pause: bool = False  # True: the job is paused (keep) once the version is recorded
    flush_cache: bool = True  # tltd keeps no KV across requests: nothing to flush
    # No effect in tltd: the version is recorded at once and workers load it beside their
    # work (is_async either way); no CUDA cache or graphs to reset; the step is the caller's.
    is_async: bool = False
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    rid: str | None = None
    manifest: dict[str, Any] | None = None


def parse_sampling(raw: dict | list | None) -> SglangSampling:
    """One set of parameters: a batch's per-prompt list must repeat the same one (a tltd
    request runs its prompts alike)."""
    if isinstance(raw, list):
        if not raw or any(r != raw[0] for r in raw):
            raise InvalidArgument(
                "a list must hold the same parameters for every prompt", field="sampling_params"
            )
        raw = raw[0]
    try:
        params = SglangSampling.model_validate(raw or {})
    except ValidationError as exc:
        raise from_validation(exc, prefix="sampling_params.") from None
    for name, value in _NO_OP.items():
        if getattr(params, name) != value:
            raise InvalidArgument(f"not supported: only {value}", field=f"sampling_params.{name}")
    return params


def _prompts(body: GenerateRequest, vocab: Vocab) -> tuple[tuple[tuple[int, ...], ...], bool]:
    """(token-id prompts, whether the input was a single prompt)."""
    if (body.input_ids is None) == (body.text is None):
        raise InvalidArgument("give exactly one of input_ids and text", field="input_ids")
    if body.text is not None:
        if isinstance(body.text, str):
            return (vocab.encode(body.text, "text"),), True
        if not body.text:
            raise InvalidArgument("must not be empty", field="text")
        return tuple(vocab.encode(t, f"text[{i}]") for i, t in enumerate(body.text)), False
    ids = body.input_ids
    if isinstance(ids, list) and ids and all(_is_token(t) for t in ids):
        return (tuple(ids),), True
    if isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
        for i, p in enumerate(ids):
            if not p or not all(_is_token(t) for t in p):
                raise InvalidArgument(
                    "must be a non-empty list of integer token ids", field=f"input_ids[{i}]"
                )
        return tuple(tuple(p) for p in ids), False
    raise InvalidArgument(
        "must be a non-empty list of token ids or a list of them", field="input_ids"
    )


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _no_images(value: Any) -> bool:
    """None, [], or a batch's list of those: no image anywhere."""
    if value is None or value == []:
        return True
    return isinstance(value, list) and all(v is None or v == [] for v in value)


def refuse_unsupported(body: GenerateRequest) -> None:
    if not _no_images(body.image_data):
        raise InvalidArgument("images are not supported: only none or []", field="image_data")
    for name in ("custom_logit_processor", "lora_path"):
        if getattr(body, name) is not None:
            raise InvalidArgument("not supported: only null", field=name)
    if body.return_hidden_states:
        raise InvalidArgument("not supported: only false", field="return_hidden_states")
    n = body.top_logprobs_num
    if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(
            f"must be in [0, {MAX_TOP_LOGPROBS}] (tltd's cap), got {n}", field="top_logprobs_num"
        )
    if body.logprob_start_len is not None and body.logprob_start_len < -1:
        raise InvalidArgument(
            "must be >= 0, or -1 for the last prompt token only", field="logprob_start_len"
        )


def _scores_prompt(body: GenerateRequest, prompts: tuple[tuple[int, ...], ...]) -> bool:
    """Whether input logprobs need the engine: SGLang's default start (-1: the last prompt
    token, whose entry has no logprob) needs nothing computed."""
    start = body.logprob_start_len
    if not body.return_logprob or start is None or start == -1:
        return False
    for i, p in enumerate(prompts):
        if start >= len(p):
            field = "logprob_start_len" if len(prompts) == 1 else f"input_ids[{i}]"
            raise InvalidArgument(
                f"logprob_start_len {start} is not below the prompt's {len(p)} tokens",
                field=field,
            )
    return any(start < len(p) - 1 for p in prompts)


def to_rollout(body: GenerateRequest, job: Job, vocab: Vocab, request_id: str):
    """(domain request, text-side parameters, whether the input was single)."""
    refuse_unsupported(body)
    params = parse_sampling(body.sampling_params)
    prompts, single = _prompts(body, vocab)
    sampling = domain_sampling(body, params, vocab, _scores_prompt(body, prompts))
    req = RolloutRequest(request_id, job.job_id, prompts, sampling)
    return req, params, single and params.n == 1


def domain_sampling(
    body: GenerateRequest, params: SglangSampling, vocab: Vocab, scores_prompt: bool
) -> SamplingParams:
    """The domain's sampling: stop strings as their tokens, the model's EOS unless
    ignore_eos (SGLang stops there), alternatives and prompt logprobs when asked."""
    top_n = (body.top_logprobs_num or 0) if body.return_logprob else 0
    stops = [*(params.stop_token_ids or ())]
    texts = [params.stop] if isinstance(params.stop, str) else (params.stop or [])
    stops += [vocab.stop_token(s, f"sampling_params.stop[{i}]") for i, s in enumerate(texts)]
    if not params.ignore_eos:
        stops += vocab.eos_ids
    return SamplingParams(
        n=params.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0 if params.top_k in (0, -1) else params.top_k,
        max_new_tokens=128 if params.max_new_tokens is None else params.max_new_tokens,
        stop_token_ids=tuple(dict.fromkeys(stops)),
        seed=params.sampling_seed,
        top_logprobs=top_n,
        prompt_logprobs=top_n if scores_prompt else None,
    )


def output(body, params, req: RolloutRequest, s: Sample, vocab: Vocab) -> dict:
    """One sample in SGLang's /generate output shape."""
    ids = s.token_ids
    stopped = (
        s.finish_reason is FinishReason.STOP and ids and ids[-1] in req.sampling.stop_token_ids
    )
    if s.finish_reason is FinishReason.STOP:
        finish: dict[str, Any] = {"type": "stop", "matched": ids[-1] if ids else None}
    elif s.finish_reason is FinishReason.LENGTH:
        finish = {"type": "length", "length": len(ids)}
    else:
        finish = {"type": "abort", "message": s.error or s.finish_reason.value}
    st = s.speculative
    meta: dict[str, Any] = {
        "id": s.request_id,
        "finish_reason": finish,
        "prompt_tokens": len(req.prompts[s.prompt_index]),
        "completion_tokens": len(ids),
        "cached_tokens": 0,
        # SGLang's: the version of the last token, and a span per version the sample ran on
        "weight_version": str((s.policy_spans or ((0, s.policy_version),))[-1][1]),
        "weight_versions": weight_spans(s),
        # SGLang's speculative statistics; a verify step is one that checked >= 1 draft
        "spec_verify_ct": st.draft_steps,
        "spec_draft_token_num": st.drafted_tokens,
        "spec_accept_token_num": st.accepted_tokens,
        "spec_accept_rate": st.acceptance_rate,
        "spec_accept_length": st.mean_accepted_length,
        # tltd's own
        "drafter_version": s.drafter_version,
        "spec_plain_steps": st.plain_steps,
        "partial": s.partial,
    }
    if body.return_logprob:
        meta.update(_logprobs(body, req.prompts[s.prompt_index], s, vocab))
    trim = stopped and not params.no_stop_trim
    return {
        "text": vocab.decode(ids[:-1] if trim else ids, params.skip_special_tokens),
        "output_ids": list(ids),
        "meta_info": meta,
        "index": s.prompt_index * req.sampling.n + s.sample_index,
    }


def _logprobs(body: GenerateRequest, prompt: tuple[int, ...], s: Sample, vocab: Vocab) -> dict:
    """SGLang's meta_info logprobs: [logprob, token id, text or None] per output token and
    per input token from logprob_start_len (-1: the last prompt token; the first entry has
    no logprob: None), and with top_logprobs_num > 0 the top alternatives of each position
    as such lists (None where the input entry has none). -inf (a token top-k / top-p
    excluded) is null, as SGLang's JSON encoder writes it."""
    text = vocab.piece if body.return_text_in_logprobs else (lambda t: None)
    start = body.logprob_start_len
    start = len(prompt) - 1 if start is None or start == -1 else start
    p = s.prompt_logprobs
    # entry j of p is prompt position j + 1
    scored = list(zip(prompt[start + 1 :], p.logprobs[start:], strict=True)) if p else []
    out: dict[str, Any] = {
        "input_token_logprobs": [[None, prompt[start], text(prompt[start])]]
        + [[_finite(lp), t, text(t)] for t, lp in scored],
        "output_token_logprobs": [
            [_finite(lp), t, text(t)] for lp, t in zip(s.logprobs, s.token_ids, strict=True)
        ],
        # The policy version that sampled each output token (AReaL's ModelResponse shape).
        "output_versions": token_versions(s),
    }
    if body.top_logprobs_num:

        def listed(top: TopLogprobs) -> list:
            pairs = zip(top.token_ids, top.logprobs, strict=True)
            return [[_finite(v), t, text(t)] for t, v in pairs]

        out["input_top_logprobs"] = [None] + [listed(t) for t in (p.top[start:] if p else ())]
        out["output_top_logprobs"] = [listed(t) for t in s.top_logprobs or ()]
    return out


def weight_spans(s: Sample) -> list[dict[str, Any]]:
    """SGLang's `meta_info.weight_versions`: {"version", "start", "end"} per version the
    sample's tokens came from, in order (end exclusive; versions as strings, as SGLang's)."""
    spans = s.policy_spans or ((0, s.policy_version),)
    n = len(s.token_ids)
    ends = [first for first, _ in spans[1:]] + [n]
    return [
        {"version": str(v), "start": first, "end": min(end, n)}
        for (first, v), end in zip(spans, ends, strict=True)
        if first < n or first == 0
    ]


def token_versions(s: Sample) -> list[int]:
    """One policy version per output token, from the sample's spans [(first token, version),
    ...] (none: every token is `policy_version`'s)."""
    spans = s.policy_spans or ((0, s.policy_version),)
    n = len(s.token_ids)
    ends = [first for first, _ in spans[1:]] + [n]
    out: list[int] = []
    for (first, version), end in zip(spans, ends, strict=True):
        out.extend([version] * max(0, min(end, n) - first))
    return out


def _finite(lp: float) -> float | None:
    return None if math.isinf(lp) else lp


_job = door.addressed_job


async def generate(services: Services, request: Request, body: GenerateRequest) -> Response:
    """A /generate without session_params (the route: sglang_sessions.generate)."""
    rid = door.request_id(request.headers.get(door.REQUEST_ID_HEADER), body.rid, "rid")
    job = await _job(services, request)
    vocab = await asyncio.to_thread(vocab_for, job.model_path)  # reads tokenizer.json once
    req, params, single = to_rollout(body, job, vocab, rid)
    if body.stream:
        req, samples = await door.open_stream(services, req)
        return StreamingResponse(
            _events(body, params, req, samples, vocab), media_type="text/event-stream"
        )
    done = await door.collect(services, req)
    outs = [output(body, params, req, s, vocab) for s in done]
    return JSONResponse(outs[0] if single else outs)


async def _events(body, params, req, samples, vocab):
    """One event per finished sample (its whole output; `index` says which), then [DONE]."""
    try:
        async for s in samples:
            yield door.sse(output(body, params, req, s, vocab))
    except Exception as raised:  # noqa: BLE001 - the stream must end with an error, not silently
        yield door.sse(failure_body(raised, RENAMES, "a /generate stream")[1])
    yield door.sse("[DONE]")


async def update_weights_from_disk(services: Services, request: Request) -> JSONResponse:
    """A new policy version from a checkpoint directory (PolicyService.update, as gRPC
    UpdatePolicy): requests accepted before keep their version, new ones run on it; with
    abort_all_requests the job's open requests are aborted first (finish reason abort, their
    tokens so far returned, as SGLang does). tltd keeps no KV cache across requests, so
    flush_cache has nothing to drop."""
    body = door.parse(UpdateWeightsRequest, await request.body())
    if body.load_format not in (None, "auto"):
        raise InvalidArgument(
            "only Hugging Face safetensors checkpoints (auto)", field="load_format"
        )
    if body.manifest is not None:
        raise InvalidArgument("not supported: the checkpoint's own files say", field="manifest")
    job = await _job(services, request)
    note = f"weight_version={body.weight_version}" if body.weight_version else ""
    aborted = 0
    if body.abort_all_requests:
        aborted = await asyncio.to_thread(
            services.pauses.abort_open, job.job_id, "aborted by a weight update"
        )
    version = await asyncio.to_thread(
        services.policy.update, job.job_id, "checkpoint", body.model_path, note
    )
    if body.keep_pause:
        await services.pauses.pause(job.job_id, PauseMode.KEEP)
    return JSONResponse(
        {
            "success": True,
            "message": f"job {job.job_id} is on policy version {version.version}",
            "num_paused_requests": aborted,
            "weight_version": str(version.version),
        }
    )


async def health(services: Services, request: Request) -> Response:
    """200 while serving rollouts; 503 once the node drains (new rollouts are refused)."""
    if services.node.draining:
        raise Unavailable("node is draining: not accepting new rollouts")
    return Response(status_code=200)


async def get_model_info(services: Services, request: Request) -> JSONResponse:
    job = await _job(services, request)
    vocab = await asyncio.to_thread(vocab_for, job.model_path)  # reads tokenizer.json once
    return JSONResponse(
        {
            "model_path": job.model_path,
            "tokenizer_path": job.model_path if vocab.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(job.policy_version),
            "job_id": job.job_id,
        }
    )
