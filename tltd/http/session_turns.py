"""What both doors' session dialects share: a turn run through the session service, a done
turn as the sample the door's answer is written from, and the trajectory as JSON."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from tltd.domain import AgentSession, RolloutRequest, Sample, SamplingParams, SessionTurn
from tltd.http import door
from tltd.services import Services


async def run_turn(
    services: Services,
    session: AgentSession,
    turn_index: int,
    inputs: tuple[int, ...],
    sampling: SamplingParams,
) -> tuple[AgentSession, SessionTurn, RolloutRequest, Sample]:
    """Turn `turn_index` of `session` (a stored one is returned as it is), with the request
    and sample a door's answer is written from: the prompt is the whole context it saw."""
    after, turn = await services.sessions.turn(session.session_id, turn_index, inputs, sampling)
    prompt = after.context_before(turn.turn_index) + turn.input_token_ids
    req = RolloutRequest(turn.request_id, after.job_id, (prompt,), turn.sampling)
    sample = Sample(
        request_id=turn.request_id,
        prompt_index=0,
        sample_index=0,
        token_ids=turn.token_ids,
        logprobs=turn.logprobs,
        finish_reason=turn.finish_reason,
        policy_version=turn.policy_version,
        policy_spans=turn.policy_spans,
    )
    return after, turn, req, sample


async def get_session(services: Services, session_id: str) -> AgentSession:
    return await asyncio.to_thread(services.sessions.get, session_id)


def session_json(session: AgentSession) -> dict:
    """A session's counters and trajectory (the arrays parallel to token_ids)."""
    t = session.trajectory()
    return {
        "session_id": session.session_id,
        "job": session.job_id,
        "status": session.status.value,
        "num_turns": session.num_turns,
        "num_tokens": session.num_tokens,
        "trajectory": {
            "token_ids": list(t.token_ids),
            "loss_mask": list(t.loss_mask),
            "logprobs": list(t.logprobs),
            "policy_versions": list(t.policy_versions),
            "prompt_length": t.prompt_length,
        },
    }


def events_response(events: list[dict]) -> StreamingResponse:
    """A streamed answer of a turn already done: its events, then [DONE] (a turn is one
    sample; the dialects stream samples whole)."""

    async def body() -> AsyncIterator[str]:
        for event in events:
            yield door.sse(event)
        yield door.sse("[DONE]")

    return StreamingResponse(body(), media_type="text/event-stream")
