"""SGLang's session dialect on tltd sessions: `POST /open_session`, `POST /close_session`,
and `/generate` with `session_params`, each such request one turn of the session.

SGLang keeps a session as a tree of requests (`session_params.rid` names the node to continue,
`offset` cuts its context, `replace` drops its children); a tltd session is one line of turns.
What maps onto it is taken: the first request's ids are the prompt, and a request continuing
the last one (its `rid`, or none in a streaming session) appends its ids as the next turn's
input. A retry of a stored turn attaches to it. Other trees are refused naming the field."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tltd.domain import AgentSession, TurnStatus
from tltd.errors import FailedPrecondition, InvalidArgument
from tltd.http import door, sglang_api
from tltd.http.errors import from_validation
from tltd.http.session_turns import events_response, get_session, run_turn, session_json
from tltd.http.vocab import Vocab, vocab_for
from tltd.services import Services

# Domain fields as a session's /generate spells them (before sglang_api.RENAMES).
RENAMES = (
    (r"^session_id$", "session_params.id"),
    (r"^turn_index$", "session_params.rid"),
    (r"^input_token_ids$", "input_ids"),
    (r"^prompt_token_ids$", "input_ids"),
)


class OpenSessionRequest(BaseModel):
    """SGLang's OpenSessionReqInput."""

    model_config = ConfigDict(extra="forbid", strict=True)
    capacity_of_str_len: int  # SGLang's required size hint; a tltd session is unbounded
    session_id: str | None = None
    streaming: bool | None = None
    timeout: float | None = None


class CloseSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    session_id: str


class SessionParams(BaseModel):
    """SGLang's SessionParams."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str | None = None
    rid: str | None = None
    offset: int | None = None
    replace: bool | None = None
    drop_previous_output: bool | None = None


async def open_session(services: Services, request: Request) -> JSONResponse:
    """A session of the addressed job, prompt-less until its first request; answers its id
    (a JSON string, as SGLang). Opening an open session again returns it."""
    body = door.parse(OpenSessionRequest, await request.body())
    if body.timeout is not None:
        raise InvalidArgument("not supported: a session stays until closed", field="timeout")
    job = await door.addressed_job(services, request)
    session = await asyncio.to_thread(
        services.sessions.open,
        job.job_id,
        body.session_id or "",
        (),
        prompt_later=True,
        streaming=bool(body.streaming),
    )
    return JSONResponse(session.session_id)


async def close_session(services: Services, request: Request) -> JSONResponse:
    """Close the session; the answer (SGLang's is empty) is its trajectory."""
    body = door.parse(CloseSessionRequest, await request.body())
    session = await asyncio.to_thread(services.sessions.close, body.session_id)
    return JSONResponse(session_json(session))


async def generate(services: Services, request: Request) -> Response:
    """POST /generate: a session's turn when the body has session_params, else SGLang's
    plain generate."""
    body = door.parse(sglang_api.GenerateRequest, await request.body())
    if body.session_params is None:
        return await sglang_api.generate(services, request, body)
    params = _session_params(body.session_params)
    _refuse_for_a_turn(body)
    job = await door.addressed_job(services, request)
    session = await get_session(services, params.id)
    if session.job_id != job.job_id:
        raise InvalidArgument(
            f"session {session.session_id} is of job {session.job_id}, not {job.job_id}",
            field="session_params.id",
        )
    vocab = await asyncio.to_thread(vocab_for, job.model_path)
    sampling_params = sglang_api.parse_sampling(body.sampling_params)
    scores = body.return_logprob and body.logprob_start_len not in (None, -1)
    sampling = sglang_api.domain_sampling(body, sampling_params, vocab, scores)
    ids = _input_ids(body, vocab)
    index, inputs = plan_turn(session, params, ids, vocab.bos_id)
    if not session.prompt_token_ids:
        session = await asyncio.to_thread(services.sessions.set_prompt, session.session_id, ids)
    _, _, req, sample = await run_turn(services, session, index, inputs, sampling)
    out = sglang_api.output(body, sampling_params, req, sample, vocab)
    # Streamed as a plain /generate's sample is: the whole turn in one event once it is done.
    return events_response([out]) if body.stream else JSONResponse(out)


def _session_params(raw: Any) -> SessionParams:
    if not isinstance(raw, dict):
        raise InvalidArgument("must be one object (a session request has one prompt)",
                              field="session_params")  # fmt: skip
    try:
        params = SessionParams.model_validate(raw)
    except ValidationError as exc:
        raise from_validation(exc, prefix="session_params.") from None
    if not params.id:
        raise InvalidArgument("names the session: required", field="session_params.id")
    if params.drop_previous_output:
        raise InvalidArgument("not supported: a turn sees the whole session",
                              field="session_params.drop_previous_output")  # fmt: skip
    return params


def _refuse_for_a_turn(body: sglang_api.GenerateRequest) -> None:
    sglang_api.refuse_unsupported(body)
    if body.rid is not None:
        raise InvalidArgument(
            "a session's turn has the daemon's id (meta_info.id): leave it unset", field="rid"
        )


def _input_ids(body: sglang_api.GenerateRequest, vocab: Vocab) -> tuple[int, ...]:
    """The request's one prompt (empty: nothing new on a continuation, as SGLang allows)."""
    if (body.input_ids is None) == (body.text is None):
        raise InvalidArgument("give exactly one of input_ids and text", field="input_ids")
    if body.text is not None:
        if not isinstance(body.text, str):
            raise InvalidArgument("a session request has one prompt: a string", field="text")
        return vocab.encode(body.text, "text")
    ids = body.input_ids
    if not isinstance(ids, list) or not all(_is_token(t) for t in ids):
        raise InvalidArgument(
            "a session request has one prompt: a list of token ids", field="input_ids"
        )
    return tuple(ids)


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def plan_turn(
    session: AgentSession, p: SessionParams, ids: tuple[int, ...], bos: int | None
) -> tuple[int, tuple[int, ...]]:
    """(turn index, its input tokens) for a request `p` places in `session`. The first
    request (the session's prompt) is turn 0 with no input; a request continuing turn j is
    turn j + 1 with its ids, less a leading BOS (as SGLang strips it)."""
    if not session.prompt_token_ids or (
        p.rid is None and not (session.streaming and session.num_turns)
    ):
        return _first_request(session, p, ids), ()
    turns = session.turns  # done ones, then the running one
    j = _continued(session, p)
    if bos is not None and ids[:1] == (bos,):
        ids = ids[1:]
    end = len(session.context_before(j + 1))
    if p.offset not in (None, 0, end):
        raise InvalidArgument(
            f"only 0 or {end} (the end of the context continued): tltd appends to a session, "
            "it does not cut it",
            field="session_params.offset",
        )
    if j + 1 < len(turns) and turns[j + 1].input_token_ids != ids:
        raise InvalidArgument(
            f"request {turns[j].request_id} is continued already, by "
            f"{turns[j + 1].request_id} with other input: tltd keeps one line of turns, "
            f"continue from {turns[-1].request_id}",
            field="session_params.replace" if p.replace else "session_params.rid",
        )
    return j + 1, ids


def _first_request(session: AgentSession, p: SessionParams, ids: tuple[int, ...]) -> int:
    """Turn 0: the session's prompt is `ids` (given now, or a retry sending it again)."""
    if session.prompt_token_ids and session.prompt_token_ids != ids:
        last = session.turns[-1].request_id if session.turns else "its first request"
        raise InvalidArgument(
            f"session {session.session_id} has its first request: continue from its last "
            f"({last}); tltd keeps one line of turns",
            field="session_params.rid",
        )
    if not ids:
        raise InvalidArgument("the session's first request needs tokens", field="input_ids")
    if p.offset not in (None, 0):
        raise InvalidArgument("a first request has no context to cut: only 0",
                              field="session_params.offset")  # fmt: skip
    if p.replace and session.streaming:
        raise InvalidArgument("a streaming session does not replace (SGLang's rule)",
                              field="session_params.replace")  # fmt: skip
    return 0


def _continued(session: AgentSession, p: SessionParams) -> int:
    """The index of the done turn `p` continues: the one `rid` names, or the latest (a
    streaming session's request naming none)."""
    done = [t for t in session.turns if t.status is TurnStatus.DONE]
    if p.rid is None:
        return len(done) - 1
    j = next((i for i, t in enumerate(session.turns) if t.request_id == p.rid), None)
    if j is None:
        raise InvalidArgument(
            f"{p.rid!r} is no request of session {session.session_id}", field="session_params.rid"
        )
    if session.turns[j].status is not TurnStatus.DONE:
        raise FailedPrecondition(
            f"request {p.rid} is still running: continue it once it returns",
            field="session_params.rid",
        )
    if session.streaming and j != len(done) - 1:
        raise InvalidArgument(
            f"a streaming session continues its latest request ({done[-1].request_id})",
            field="session_params.rid",
        )
    if p.replace and session.streaming:
        raise InvalidArgument("a streaming session does not replace (SGLang's rule)",
                              field="session_params.replace")  # fmt: skip
    return j
