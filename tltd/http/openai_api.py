"""OpenAI-compatible `POST /v1/completions` and `GET /v1/models` (with vLLM's token-id
extensions), translated to and from the domain's rollout request and samples."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from tltd.domain import (
    MAX_TOP_LOGPROBS,
    FinishReason,
    Job,
    JobStatus,
    PromptLogprobs,
    RolloutRequest,
    Sample,
    SamplingParams,
    TopLogprobs,
)
from tltd.errors import InvalidArgument
from tltd.http import door
from tltd.http.errors import failure_body
from tltd.http.vocab import Vocab, vocab_for
from tltd.services import Services

log = logging.getLogger(__name__)

# Domain field paths as this API spells them.
RENAMES = (
    (r"^job_id$", "model"),
    (r"^prompts\[(\d+)\]\.token_ids", r"prompt[\1]"),
    (r"^prompts$", "prompt"),
    (r"^sampling\.max_new_tokens$", "max_tokens"),
    (r"^sampling\.top_logprobs$", "logprobs"),
    (r"^sampling\.", ""),
)
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}  # others: vLLM's "abort"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """vLLM's completion request fields (OpenAI's and vLLM's extensions): those tltd runs, and
    the rest at the values that change nothing (`_NO_OP`); any other field or value is refused
    by name (docs/http.md)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    prompt: Any = None  # checked by _prompts, which names the bad element
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    request_id: str | None = None
    # How the answer is written, all honoured.
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    # Identity and routing only: they change no token. (tltd keeps no KV cache across
    # requests, so a cache salt is honoured trivially; whole samples are streamed, so a
    # stream interval changes nothing; offsets and multimodal kwargs concern vLLM's render
    # endpoints only, as in vLLM.)
    user: str | None = None
    session_id: str | None = None
    cache_salt: str | None = None
    stream_interval: int | None = None
    return_token_offsets: bool | None = None
    return_mm_kwargs: bool = True
    length_penalty: float = 1.0  # beam search only, as in vLLM
    # Accepted at their no-op values only (_NO_OP).
    echo: bool | None = None
    best_of: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    use_beam_search: bool = False
    watermarking: bool | None = None
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_embeds: Any = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: int = 0
    routed_experts_prompt_start: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None


# field -> (the values that change nothing, why another is refused)
_NO_OP: dict[str, tuple[tuple[Any, ...], str]] = {
    "echo": ((None, False), "the prompt is the caller's already"),
    "frequency_penalty": ((None, 0.0), "penalties are not run by the engine"),
    "presence_penalty": ((None, 0.0), "penalties are not run by the engine"),
    "repetition_penalty": ((None, 1.0), "penalties are not run by the engine"),
    "min_p": ((None, 0.0), "min-p filtering is not run by the engine"),
    "min_tokens": ((0,), "the engine has no minimum length"),
    "logit_bias": ((None, {}), "the engine takes no logit bias"),
    "suffix": ((None, ""), "no insertion after the completion"),
    "use_beam_search": ((False,), "the engine samples; no beam search"),
    "watermarking": ((None, False), "no watermarking"),
    "spaces_between_special_tokens": ((True,), "text is decoded by the job's tokenizer"),
    "allowed_token_ids": ((None,), "the engine samples from the whole vocabulary"),
    "logprob_token_ids": ((None,), "only the sampled token's logprob is computed"),
    "bad_words": ((None, []), "the engine bans no words"),
    "prompt_embeds": ((None,), "prompts are token ids or text"),
    "response_format": ((None, {"type": "text"}), "no structured output"),
    "structured_outputs": ((None,), "no structured output"),
    "guided_json": ((None,), "no structured output"),
    "guided_regex": ((None,), "no structured output"),
    "guided_choice": ((None,), "no structured output"),
    "guided_grammar": ((None,), "no structured output"),
    "priority": ((0,), "a job's priority is set on the job"),
    "routed_experts_prompt_start": ((0,), "no routed-expert data"),
    "kv_transfer_params": ((None,), "no disaggregated serving"),
    "ec_transfer_params": ((None,), "no disaggregated serving"),
    "vllm_xargs": ((None, {}), "no custom extensions"),
    "repetition_detection": ((None,), "no repetition detection"),
    "thinking_token_budget": ((None, -1), "no thinking budget"),
}


def _refuse_unsupported(body: CompletionRequest) -> None:
    for name, (no_op, why) in _NO_OP.items():
        if getattr(body, name) not in no_op:
            allowed = " or ".join(repr(v) for v in no_op if v is not None) or "unset"
            raise InvalidArgument(f"{why}: only {allowed}", field=name)
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidArgument("only best_of = n (or unset) is supported", field="best_of")
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(body, name)
        if n is not None and not 0 <= n <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(
                f"must be in [0, {MAX_TOP_LOGPROBS}] (tltd's cap on alternatives per position; "
                f"-1, the whole vocabulary, is not served), got {n}",
                field=name,
            )
    if body.stream_options is not None and not body.stream:
        raise InvalidArgument("only with stream=true", field="stream_options")
    if body.truncate_prompt_tokens is not None and body.truncate_prompt_tokens < 1:
        raise InvalidArgument("must be >= 1 (or unset)", field="truncate_prompt_tokens")
    if body.truncation_side not in (None, "left", "right"):
        raise InvalidArgument("must be left or right", field="truncation_side")


def _prompts(body: CompletionRequest, vocab: Vocab) -> tuple[tuple[int, ...], ...]:
    """Token-id prompts, truncated as vLLM does when asked (left by default: the last N)."""
    prompts = _prompt_ids(body.prompt, vocab, body.add_special_tokens)
    keep = body.truncate_prompt_tokens
    if keep is None:
        return prompts
    if body.truncation_side == "right":
        return tuple(p[:keep] for p in prompts)
    return tuple(p[-keep:] for p in prompts)


def _prompt_ids(prompt: Any, vocab: Vocab, special: bool) -> tuple[tuple[int, ...], ...]:
    """A string, a list of token ids, or a list of either -> token-id prompts."""
    if isinstance(prompt, str):
        return (vocab.encode(prompt, "prompt", special),)
    if isinstance(prompt, list) and prompt:
        if all(_is_token(t) for t in prompt):
            return (tuple(prompt),)
        out = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                out.append(vocab.encode(p, f"prompt[{i}]", special))
            elif isinstance(p, list) and p and all(_is_token(t) for t in p):
                out.append(tuple(p))
            else:
                raise InvalidArgument(
                    "must be a string or a non-empty list of integer token ids",
                    field=f"prompt[{i}]",
                )
        return tuple(out)
    raise InvalidArgument(
        "must be a string, a list of token ids, or a non-empty list of either", field="prompt"
    )


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def to_rollout(body: CompletionRequest, job: Job, vocab: Vocab, request_id: str) -> RolloutRequest:
    """The domain request: stop strings become their single tokens, the model's end-of-sequence
    ids stop a sample unless ignore_eos (as vLLM does)."""
    _refuse_unsupported(body)
    prompts = _prompts(body, vocab)
    stops = [*(body.stop_token_ids or ())]
    texts = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    stops += [vocab.stop_token(s, f"stop[{i}]") for i, s in enumerate(texts)]
    if not body.ignore_eos:
        stops += vocab.eos_ids
    return RolloutRequest(
        request_id=request_id,
        job_id=job.job_id,
        prompts=prompts,
        sampling=SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k in (None, 0, -1) else body.top_k,
            max_new_tokens=16 if body.max_tokens is None else body.max_tokens,  # OpenAI's default
            stop_token_ids=tuple(dict.fromkeys(stops)),
            seed=body.seed,
            top_logprobs=body.logprobs or 0,  # 0: the sampled token's logprob alone
            prompt_logprobs=body.prompt_logprobs,
        ),
    )


def choice(body: CompletionRequest, req: RolloutRequest, s: Sample, vocab: Vocab) -> dict:
    """One sample as a completion choice; index = prompt_index * n + sample_index (vLLM's)."""
    ids = s.token_ids
    stopped = (
        s.finish_reason is FinishReason.STOP and ids and ids[-1] in req.sampling.stop_token_ids
    )
    trim = stopped and not body.include_stop_str_in_output
    out: dict[str, Any] = {
        "index": s.prompt_index * req.sampling.n + s.sample_index,
        "text": vocab.decode(ids[:-1] if trim else ids, body.skip_special_tokens),
        "logprobs": None if body.logprobs is None else logprobs(body, s, vocab),
        "finish_reason": _FINISH.get(s.finish_reason, "abort"),
        "stop_reason": ids[-1] if stopped else None,  # vLLM's: the stop token matched
        "prompt_logprobs": prompt_logprobs(body, req.prompts[s.prompt_index], s, vocab),
        "token_ids": list(ids) if body.return_token_ids else None,
        "prompt_token_ids": list(req.prompts[s.prompt_index]) if body.return_token_ids else None,
    }
    out["tltd"] = _tltd_fields(s)
    return out


def floor(lp: float) -> float:
    """vLLM's floor for -inf (JSON has no infinity)."""
    return max(lp, -9999.0)


def entries(token: int, lp: float, top: TopLogprobs | None) -> list[tuple[int, float]]:
    """One position as vLLM's engine reports it: the token itself first, then the top
    alternatives in rank order, each token once."""
    out = {token: lp}
    for t, v in zip(top.token_ids, top.logprobs, strict=True) if top else ():
        out.setdefault(t, v)
    return list(out.items())


def token_text(body: CompletionRequest, vocab: Vocab):
    """How a token is written in logprobs: its text, or `token_id:N`."""
    as_ids = body.return_tokens_as_token_ids or vocab.tokenizer is None
    return (lambda t: f"token_id:{t}") if as_ids else vocab.piece


def logprobs(body: CompletionRequest, s: Sample, vocab: Vocab) -> dict:
    """vLLM's completion logprobs: per position the token, its logprob (floored at -9999 as
    vLLM floors -inf) and the top alternatives: the sampled token and the `logprobs` most
    likely (logprobs + 1 entries, or logprobs when the sampled token is among them; the
    sampled token alone for logprobs=0), keyed by their text; text offsets are the
    cumulative lengths of the token strings."""
    text = token_text(body, vocab)
    tokens = [text(t) for t in s.token_ids]
    tops = s.top_logprobs or [None] * len(tokens)
    top_dicts = [
        {text(t): floor(v) for t, v in entries(tok, lp, top)[: (body.logprobs or 0) + 1]}
        for tok, lp, top in zip(s.token_ids, s.logprobs, tops, strict=True)
    ]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "text_offset": offsets,
        "token_logprobs": [floor(lp) for lp in s.logprobs],
        "tokens": tokens,
        "top_logprobs": top_dicts,
    }


def prompt_logprobs(
    body: CompletionRequest, prompt: tuple[int, ...], s: Sample, vocab: Vocab
) -> list[dict | None] | None:
    """vLLM's prompt logprobs: None for the first position, then per position the prompt
    token and the `prompt_logprobs` most likely, keyed by token id, each with its logprob,
    rank and text."""
    p = s.prompt_logprobs
    if body.prompt_logprobs is None or p is None:
        return None
    return [None, *ranked_positions(prompt, p, token_text(body, vocab))]


def ranked_positions(prompt: tuple[int, ...], p: PromptLogprobs, text) -> list[dict]:
    """Prompt positions 1.. as vLLM's {token id: {logprob, rank, decoded_token}} dicts."""
    out = []
    for j, (tok, lp, rank) in enumerate(zip(prompt[1:], p.logprobs, p.ranks, strict=True)):
        top = p.top[j] if p.top else None
        ranks = {t: r + 1 for r, t in enumerate(top.token_ids if top else ())} | {tok: rank}
        out.append(
            {
                str(t): {"logprob": floor(v), "rank": ranks[t], "decoded_token": text(t)}
                for t, v in entries(tok, lp, top)
            }
        )
    return out


def _tltd_fields(s: Sample) -> dict:
    """What a gRPC sample also carries: versions and speculative statistics."""
    st = s.speculative
    return {
        "policy_version": s.policy_version,
        "drafter_version": s.drafter_version,
        "partial": s.partial,
        "draft_steps": st.draft_steps,
        "plain_steps": st.plain_steps,
        "accepted_tokens": st.accepted_tokens,
        "drafted_tokens": st.drafted_tokens,
    }


def usage(req: RolloutRequest, samples: list[Sample]) -> dict:
    prompt = sum(len(p) for p in req.prompts)
    completion = sum(len(s.token_ids) for s in samples)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def completions(
    services: Services, request: Request, body: CompletionRequest
) -> JSONResponse | StreamingResponse:
    """A completion without X-Session-ID (the route: openai_sessions.completions)."""
    rid = door.request_id(
        request.headers.get(door.REQUEST_ID_HEADER), body.request_id, "request_id"
    )
    job = await door.get_job(services, body.model)  # NotFound -> 404 naming `model`
    vocab = await asyncio.to_thread(vocab_for, job.model_path)  # reads tokenizer.json once
    req = to_rollout(body, job, vocab, rid)
    created = int(time.time())
    head = {"object": "text_completion", "created": created, "model": body.model}
    if body.stream:
        req, samples = await door.open_stream(services, req)
        return StreamingResponse(
            _events(body, req, samples, vocab, head), media_type="text/event-stream"
        )
    done = await door.collect(services, req)
    return JSONResponse(
        {
            "id": done[0].request_id,
            **head,
            "choices": [choice(body, req, s, vocab) for s in done],
            "usage": usage(req, done),
        }
    )


async def _events(body, req, samples, vocab, head):
    """One chunk per finished sample (the whole choice), then usage if asked, then [DONE]. An
    error after the headers arrives as an event in OpenAI's error shape."""
    done: list[Sample] = []
    try:
        async for s in samples:
            done.append(s)
            yield door.sse({"id": req.request_id, **head, "choices": [choice(body, req, s, vocab)]})
        if body.stream_options and body.stream_options.include_usage:
            yield door.sse(
                {"id": req.request_id, **head, "choices": [], "usage": usage(req, done)}
            )
    except Exception as raised:  # noqa: BLE001 - the stream must end with an error, not silently
        yield door.sse(failure_body(raised, RENAMES, "a completions stream")[1])
    yield door.sse("[DONE]")


async def models(services: Services, request: Request) -> JSONResponse:
    """Active jobs, as models: `model` in a completion names one."""
    jobs = await asyncio.to_thread(services.jobs.list, [JobStatus.ACTIVE], 0)
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": j.job_id,
                    "object": "model",
                    "created": int(j.created_at.timestamp()) if j.created_at else 0,
                    "owned_by": "tltd",
                    "root": j.model_path,
                }
                for j in jobs
            ],
        }
    )
