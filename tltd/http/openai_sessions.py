"""A conversation keyed by `X-Session-ID` on `POST /v1/completions`, and `POST /finish_session`.

The header is how vllm-router, SkyRL and prime-rl pin a conversation; each request carries
the whole conversation so far. tltd keeps it as a session: the first request's prompt opens it,
and each later one must extend the tokens stored (the last answer included): the new suffix is
the next turn's input, the environment's, and only the suffix is new work. A request repeating
a stored turn's prompt is a retry of that turn (nothing runs twice)."""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tltd.domain import AgentSession, Job
from tltd.errors import InvalidArgument, NotFound
from tltd.http import door, openai_api
from tltd.http.session_turns import events_response, get_session, run_turn, session_json
from tltd.http.vocab import vocab_for
from tltd.services import Services

SESSION_HEADER = "x-session-id"

# Domain fields as a session's completion spells them (before openai_api.RENAMES).
RENAMES = (
    (r"^session_id$", "X-Session-ID"),
    (r"^turn_index$", "X-Session-ID"),
    (r"^input_token_ids$", "prompt"),
    (r"^prompt_token_ids$", "prompt"),
)


class FinishSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    session_id: str | None = None  # else the X-Session-ID header


async def completions(services: Services, request: Request) -> Response:
    """POST /v1/completions: a turn of the conversation X-Session-ID names, else a plain
    completion."""
    body = door.parse(openai_api.CompletionRequest, await request.body())
    session_id = request.headers.get(SESSION_HEADER)
    if not session_id:
        return await openai_api.completions(services, request, body)
    if body.request_id or request.headers.get(door.REQUEST_ID_HEADER):
        raise InvalidArgument(
            "a conversation's turn has the daemon's id; a retry is the same prompt again",
            field="request_id",
        )
    job = await door.get_job(services, body.model)  # NotFound -> 404 naming `model`
    vocab = await asyncio.to_thread(vocab_for, job.model_path)
    asked = openai_api.to_rollout(body, job, vocab, "")
    if len(asked.prompts) != 1:
        raise InvalidArgument("a conversation's turn has one prompt: the whole conversation",
                              field="prompt")  # fmt: skip
    prompt = asked.prompts[0]
    session = await _session(services, job, session_id, prompt)
    index, inputs = place_turn(session, prompt)
    _, turn, req, sample = await run_turn(services, session, index, inputs, asked.sampling)
    with_ids = body.model_copy(update={"return_token_ids": True})  # the caller's next prompt
    choice = openai_api.choice(with_ids, req, sample, vocab)
    choice["tltd"] |= {"session_id": session.session_id, "turn_index": turn.turn_index}
    head = {"id": turn.request_id, "object": "text_completion", "created": int(time.time()),
            "model": body.model}  # fmt: skip
    usage = openai_api.usage(req, [sample])
    if not body.stream:
        return JSONResponse({**head, "choices": [choice], "usage": usage})
    # Streamed as a completion's sample is: the whole turn in one chunk once it is done.
    events = [{**head, "choices": [choice]}]
    if body.stream_options and body.stream_options.include_usage:
        events.append({**head, "choices": [], "usage": usage})
    return events_response(events)


async def _session(
    services: Services, job: Job, session_id: str, prompt: tuple[int, ...]
) -> AgentSession:
    """The conversation's session, opened with `prompt` on its first request."""
    try:
        session = await get_session(services, session_id)
    except NotFound:
        return await asyncio.to_thread(services.sessions.open, job.job_id, session_id, prompt)
    if session.job_id != job.job_id:
        raise InvalidArgument(
            f"session {session_id} is of job {session.job_id}, not {job.job_id}", field="model"
        )
    return session


def place_turn(session: AgentSession, prompt: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """(turn index, its input tokens) for a request sending the whole conversation `prompt`:
    a stored turn whose prompt it is (a retry), else the next turn with the suffix beyond the
    stored tokens; a prompt that does not extend them is refused."""
    for t in reversed(session.turns):
        if session.context_before(t.turn_index) + t.input_token_ids == prompt:
            return t.turn_index, t.input_token_ids
    stored = session.trajectory().token_ids
    if prompt[: len(stored)] != stored:
        at = next(
            (i for i, (a, b) in enumerate(zip(prompt, stored, strict=False)) if a != b),
            len(prompt),
        )
        raise InvalidArgument(
            f"does not extend the {len(stored)} tokens stored for session "
            f"{session.session_id} (it differs at position {at}): send the conversation so "
            "far, the last answer's token_ids included, then the new tokens",
            field="prompt",
        )
    return session.num_turns, prompt[len(stored) :]


async def finish_session(services: Services, request: Request) -> JSONResponse:
    """Close the conversation's session and answer its trajectory."""
    body = door.parse(FinishSessionRequest, await request.body() or b"{}")
    header = request.headers.get(SESSION_HEADER)
    if header and body.session_id and header != body.session_id:
        raise InvalidArgument(
            f"differs from the X-Session-ID header ({header!r} vs {body.session_id!r})",
            field="session_id",
        )
    session_id = body.session_id or header
    if not session_id:
        raise InvalidArgument("name the session (or send X-Session-ID)", field="session_id")
    session = await asyncio.to_thread(services.sessions.close, session_id)
    return JSONResponse(session_json(session))
