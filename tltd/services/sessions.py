"""Multi-turn sessions, token in and token out: open one, run its turns, read or close it.

A turn is a rollout request of the session's whole sequence so far (n = 1) with an id fixed by
the session and the turn (`turn_request_id`): it runs on the usual request path, so a retry of
the turn, also after a daemon restart, attaches to the same request and nothing runs twice.
Its sampled tokens, logprobs and policy spans are copied into the session once it is done.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from tltd.domain import (
    ENDED_STATUSES,
    MAX_GROUP_ID,
    MAX_GROUP_SESSIONS,
    MAX_SESSION_ID,
    AgentSession,
    JobStatus,
    RolloutRequest,
    Sample,
    SamplingParams,
    SessionStatus,
    SessionSummary,
    SessionTurn,
    TurnStatus,
    group_session_id,
)
from tltd.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, TltError
from tltd.services.checkpoints import model_limits
from tltd.services.validation import (
    check_id,
    check_tokens,
    context_limit,
    validate_rollout,
)
from tltd.settings import Settings

if TYPE_CHECKING:
    from tltd.services.rollouts import RolloutService
    from tltd.store import Store
    from tltd.supervisor.session_pins import SessionPins

_ID_CHARS = r"[A-Za-z0-9][A-Za-z0-9._:-]"


def check_session_id(value: str, field: str = "session_id", most: int = MAX_SESSION_ID) -> None:
    if not value:
        raise InvalidArgument("must not be empty", field=field)
    if not re.fullmatch(rf"{_ID_CHARS}{{0,{most - 1}}}", value):
        raise InvalidArgument(
            f"must be 1-{most} characters of letters, digits, '.', '_', ':' or '-' "
            "starting with a letter or digit",
            field=field,
        )


def _check_not_returned(sampling: SamplingParams) -> None:
    """What a turn does not return is refused rather than computed and dropped."""
    for name, asked in (
        ("return_provenance", sampling.return_provenance),
        ("top_logprobs", sampling.top_logprobs != 0),
        ("prompt_logprobs", sampling.prompt_logprobs is not None),
    ):
        if asked:
            raise InvalidArgument("a turn does not return it: leave it unset",
                                  field=f"sampling.{name}")  # fmt: skip


class SessionService:
    def __init__(
        self,
        store: Store,
        settings: Settings,
        rollouts: RolloutService,
        pins: SessionPins | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.rollouts = rollouts
        self.pins = pins  # this node's (None: it runs no workers)

    def open(
        self,
        job_id: str,
        session_id: str,
        prompt: tuple[int, ...],
        *,
        prompt_later: bool = False,
        streaming: bool = False,
    ) -> AgentSession:
        """Store a session of `job_id` starting from `prompt` (idempotent on session_id).
        With `prompt_later` (SGLang's /open_session) the prompt is empty until `set_prompt`."""
        check_id(job_id, "job_id")
        session_id = session_id or f"ses-{uuid.uuid4().hex}"
        check_session_id(session_id)
        job = self.store.jobs.get(job_id)
        if job.status is not JobStatus.ACTIVE:
            raise FailedPrecondition(f"job {job_id} is {job.status.value}", field="job_id")
        if not prompt_later:
            self._check_prompt(job.model_path, prompt)
        stored, _ = self.store.sessions.open(
            AgentSession(session_id, job_id, prompt, streaming=streaming)
        )
        return stored

    def open_group(
        self, job_id: str, group_id: str, prompt: tuple[int, ...], n: int
    ) -> tuple[str, list[AgentSession]]:
        """Open sessions `<group_id>.0` .. `<group_id>.<n-1>` of `prompt` (each idempotent as
        `open`; empty group id: the daemon assigns `grp-<uuid>`). They are sessions like any
        other; their first turns share the prompt's prefill on a worker (as the first turns of
        any sessions of one prompt do). Returns the group id and the sessions."""
        group_id = group_id or f"grp-{uuid.uuid4().hex}"
        check_session_id(group_id, "group_id", MAX_GROUP_ID)
        if not 1 <= n <= MAX_GROUP_SESSIONS:
            raise InvalidArgument(f"must be 1-{MAX_GROUP_SESSIONS}, got {n}", field="n")
        check_id(job_id, "job_id")
        job = self.store.jobs.get(job_id)
        if job.status is not JobStatus.ACTIVE:
            raise FailedPrecondition(f"job {job_id} is {job.status.value}", field="job_id")
        self._check_prompt(job.model_path, prompt)
        sessions = [AgentSession(group_session_id(group_id, i), job_id, prompt) for i in range(n)]
        return group_id, self.store.sessions.open_all(sessions)

    def set_prompt(self, session_id: str, prompt: tuple[int, ...]) -> AgentSession:
        """The prompt of a session opened without one (the same one again: a no-op)."""
        check_session_id(session_id)
        session = self.store.sessions.get(session_id)
        self._check_prompt(self.store.jobs.get(session.job_id).model_path, prompt)
        return self.store.sessions.set_prompt(session_id, prompt)

    def _check_prompt(self, model_path: str, prompt: tuple[int, ...]) -> None:
        field = "prompt_token_ids"
        if not prompt:
            raise InvalidArgument("must not be empty", field=field)
        limits = model_limits(model_path)
        context, holder = context_limit(self.settings, limits)
        most = min(self.settings.max_prompt_tokens, context - 1)
        if len(prompt) > most:
            raise InvalidArgument(
                f"{len(prompt)} tokens: at most {most} ({holder}, and one to generate)",
                field=field,
            )
        check_tokens(prompt, field, limits.vocab_size)

    def list(
        self, job_id: str = "", statuses: Sequence[SessionStatus] = (), limit: int = 100
    ) -> list[SessionSummary]:
        """Sessions, newest first (of one job when `job_id` is set), with where this node
        holds their KV and what their turns reused here."""
        if job_id:
            check_id(job_id, "job_id")
        found = self.store.sessions.list(job_id, statuses, limit)
        return found if self.pins is None else [self._pinned(s, self.pins) for s in found]

    def _pinned(self, summary: SessionSummary, pins: SessionPins) -> SessionSummary:
        pin = pins.get(summary.session_id)
        if pin is None:
            return summary
        return replace(
            summary,
            worker_id=pin.worker_id if pin.pinned else "",
            node_id=self.store.node_id if pin.pinned else "",
            reuse_hits=pin.hits,
            reused_tokens=pin.reused_tokens,
        )

    async def turn(
        self, session_id: str, turn_index: int, inputs: tuple[int, ...], sampling: SamplingParams
    ) -> tuple[AgentSession, SessionTurn]:
        """Run turn `turn_index` (the session's done turns so far; a lower index returns that
        turn as stored) and return the session after it with the turn. A retry attaches to
        the turn's request; a turn whose request ends without a sample is given up (ABORTED:
        send it again) and leaves the session as before it."""
        check_session_id(session_id)
        session = await asyncio.to_thread(self.store.sessions.get, session_id)
        await asyncio.to_thread(self._check_turn, session, turn_index, inputs, sampling)
        before, turn = await asyncio.to_thread(
            self.store.sessions.begin_turn, session_id, turn_index, inputs, sampling
        )
        if turn.status is TurnStatus.DONE:  # a retry of a done turn
            return await asyncio.to_thread(self.store.sessions.get, session_id), turn
        prompt = before.context_before(turn_index) + inputs
        sample = await self._run(turn, before.job_id, prompt)
        return await asyncio.to_thread(self.store.sessions.complete_turn, turn, sample)

    def _check_turn(
        self,
        session: AgentSession,
        turn_index: int,
        inputs: tuple[int, ...],
        sampling: SamplingParams,
    ) -> None:
        """The turn's own fields, named as the caller sent them, before anything is stored."""
        if session.status is SessionStatus.CLOSED:
            raise FailedPrecondition(f"session {session.session_id} is closed", field="session_id")
        if sampling.n != 1:
            raise InvalidArgument(f"a turn samples once: must be 0 or 1, got {sampling.n}",
                                  field="sampling.n")  # fmt: skip
        _check_not_returned(sampling)
        job = self.store.jobs.get(session.job_id)
        limits = model_limits(job.model_path)
        if inputs:
            check_tokens(inputs, "input_token_ids", limits.vocab_size)
        context, holder = context_limit(self.settings, limits)
        before = len(session.context_before(turn_index))
        if before + len(inputs) == 0:
            raise InvalidArgument(
                "the session has no prompt yet: its first turn needs input tokens",
                field="input_token_ids",
            )
        if before + len(inputs) > self.settings.max_prompt_tokens:
            raise InvalidArgument(
                f"{before} tokens of the session and {len(inputs)} new ones exceed the limit "
                f"of {self.settings.max_prompt_tokens} (max_prompt_tokens)",
                field="input_token_ids",
            )
        if before + len(inputs) >= context:
            raise InvalidArgument(
                f"{before} tokens of the session and {len(inputs)} new ones leave no room to "
                f"generate: {holder}",
                field="input_token_ids",
            )
        if before + len(inputs) + sampling.max_new_tokens > context:
            raise InvalidArgument(
                f"{sampling.max_new_tokens} new tokens after the session's "
                f"{before + len(inputs)} do not fit: {holder}, so at most "
                f"{context - before - len(inputs)} here",
                field="sampling.max_new_tokens",
            )
        # The rest of the sampling as any request's (the fields are named alike).
        probe = RolloutRequest("", session.job_id, ((0,),), sampling)
        validate_rollout(probe, self.settings, limits)

    async def _run(self, turn: SessionTurn, job_id: str, prompt: tuple[int, ...]) -> Sample:
        """The turn's one sample, from its request (created, or attached to), which prefers
        the node holding the session's KV (`_preferred_node`)."""
        node = await asyncio.to_thread(self._preferred_node, turn)
        req = RolloutRequest(
            turn.request_id, job_id, (prompt,), replace(turn.sampling, n=1), preferred_node=node
        )
        samples: list[Sample] = []
        try:
            async for sample in self.rollouts.generate(req):
                samples.append(sample)
        except TltError:
            await asyncio.to_thread(self._give_up_if_ended, turn)
            raise
        done = [s for s in samples if not s.partial]
        if done:
            return done[0]
        await asyncio.to_thread(self._give_up_if_ended, turn)
        reason = samples[0].finish_reason.value if samples else "without a sample"
        raise Aborted(
            f"turn {turn.turn_index} of session {turn.session_id} ended {reason}: "
            "nothing was added to the session; send the turn again"
        )

    def _preferred_node(self, turn: SessionTurn) -> str:
        """With sticky placement on a shared database (several nodes), the node that ran the
        previous turn: it holds the session's KV. Otherwise none."""
        sticky = self.settings.session_placement == "sticky"
        if turn.turn_index == 0 or not sticky or self.store.dialect != "postgresql":
            return ""
        return self.store.sessions.turn_node(turn.session_id, turn.turn_index - 1)

    def _give_up_if_ended(self, turn: SessionTurn) -> None:
        """A turn whose request was never stored (refused) or ended without its sample runs
        no more: drop it, so that the turn can be sent again. One still open (e.g. going on
        at another node) is kept: a retry attaches to it."""
        try:
            req = self.store.requests.get(turn.request_id)
        except NotFound:
            req = None
        if req is None or req.status in ENDED_STATUSES:
            self.store.sessions.give_up_turn(turn)

    def get(self, session_id: str) -> AgentSession:
        """The session; a running turn whose request is done meanwhile is counted in."""
        check_session_id(session_id)
        return self._settled(self.store.sessions.get(session_id))

    def close(self, session_id: str) -> AgentSession:
        """End the session and return it. A turn still running is dropped from it and its
        request cancelled; one whose request is done is counted in first."""
        check_session_id(session_id)
        session = self._settled(self.store.sessions.get(session_id))
        running = session.running_turn
        if running is not None and session.status is SessionStatus.OPEN:
            self._cancel(running.request_id)
        closed = self.store.sessions.close(session_id)
        if self.pins is not None:
            self.pins.release(session_id)  # (a close at another node leaves this node's pin)
        return closed

    def _settled(self, session: AgentSession) -> AgentSession:
        """Count in a running turn whose request has its sample (a caller that went away, a
        daemon restarted mid-turn), or drop one whose request ended without it."""
        turn = session.running_turn
        if turn is None:
            return session
        try:
            req = self.store.requests.get(turn.request_id)
        except NotFound:
            return session  # not stored yet: its Turn call is on its way
        done = [s for s in self.store.samples.list(turn.request_id) if not s.partial]
        if done:
            return self.store.sessions.complete_turn(turn, done[0])[0]
        if req.status in ENDED_STATUSES:
            self.store.sessions.give_up_turn(turn)
            return self.store.sessions.get(session.session_id)
        return session

    def _cancel(self, request_id: str) -> None:
        try:
            self.rollouts.cancel(request_id, "its session was closed")
        except (NotFound, FailedPrecondition):
            pass  # never stored, or ended meanwhile: nothing runs
