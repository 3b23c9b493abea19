"""The session records on SQLite and PostgreSQL: open (idempotent), a turn begun, done, retried
and given up, closing; the trajectory a session's turns make (mask, logprobs, versions); a
prompt given after opening (SGLang's sessions); and the listing."""

from __future__ import annotations

import grpc
import pytest

from tltd.domain import (
    AgentSession,
    FinishReason,
    Job,
    LogprobMode,
    Sample,
    SamplingParams,
    SessionStatus,
    SessionTurn,
    TurnStatus,
)
from tltd.errors import AlreadyExists, FailedPrecondition, NotFound

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, seed=2**64 - 1)


def _sample(turn: SessionTurn, tokens, spans=()) -> Sample:
    return Sample(
        turn.request_id,
        0,
        0,
        tuple(tokens),
        tuple(-0.5 - i for i in range(len(tokens))),
        FinishReason.LENGTH,
        policy_version=spans[0][1] if spans else 3,
        policy_spans=tuple(spans),
    )


@pytest.fixture
def job(store) -> Job:
    return store.jobs.create(Job(job_id="job", model_path="/m"))[0]


def test_a_session_is_opened_once_and_its_turns_recorded(store, job):
    opened, created = store.sessions.open(AgentSession("s", "job", (1, 2)))
    assert created and opened.status is SessionStatus.OPEN and opened.num_tokens == 2
    assert store.sessions.open(AgentSession("s", "job", (1, 2))) == (opened, False)
    with pytest.raises(AlreadyExists) as info:
        store.sessions.open(AgentSession("s", "job", (1,)))
    assert info.value.field == "prompt_token_ids"
    with pytest.raises(NotFound):
        store.sessions.open(AgentSession("t", "nope", (1,)))
    before, turn = store.sessions.begin_turn("s", 0, (), GREEDY)
    assert turn.status is TurnStatus.RUNNING and turn.request_id == "session:s:0:0"
    assert turn.sampling == GREEDY  # the uint64 seed kept whole
    assert store.sessions.begin_turn("s", 0, (), GREEDY)[1] == turn  # a retry attaches
    with pytest.raises(FailedPrecondition) as info:
        store.sessions.begin_turn("s", 1, (9,), GREEDY)
    assert info.value.field == "turn_index"
    session, done = store.sessions.complete_turn(turn, _sample(turn, [7, 8]))
    assert done.status is TurnStatus.DONE and done.token_ids == (7, 8)
    assert session.num_turns == 1 and session.num_tokens == 4
    assert store.sessions.complete_turn(turn, _sample(turn, [0]))[1] == done  # once only
    assert store.sessions.begin_turn("s", 0, (), GREEDY)[1] == done
    with pytest.raises(AlreadyExists) as info:
        store.sessions.begin_turn("s", 0, (), SamplingParams(max_new_tokens=4))
    assert info.value.field == "sampling.temperature"


def test_a_given_up_turn_runs_again_under_a_new_request(store, job):
    store.sessions.open(AgentSession("s", "job", (1,)))
    _, turn = store.sessions.begin_turn("s", 0, (), GREEDY)
    store.sessions.give_up_turn(turn)
    session = store.sessions.get("s")
    assert session.turns == () and session.attempts == 1 and session.num_turns == 0
    _, again = store.sessions.begin_turn("s", 0, (), GREEDY)
    assert again.request_id == "session:s:0:1"
    with pytest.raises(FailedPrecondition):  # the old attempt cannot complete it
        store.sessions.complete_turn(turn, _sample(turn, [5]))
    closed = store.sessions.close("s")  # drops the running turn
    assert closed.status is SessionStatus.CLOSED and closed.turns == ()
    with pytest.raises(FailedPrecondition) as info:
        store.sessions.begin_turn("s", 0, (), GREEDY)
    assert info.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.field == "session_id"
    assert store.sessions.close("s") == closed
    with pytest.raises(NotFound):
        store.sessions.get("nope")


def test_the_trajectory_masks_environment_tokens_and_expands_spans(store, job):
    store.sessions.open(AgentSession("s", "job", (1, 2, 3)))
    _, t0 = store.sessions.begin_turn("s", 0, (), GREEDY)
    store.sessions.complete_turn(t0, _sample(t0, [10, 11]))
    raw = SamplingParams(max_new_tokens=4, logprob_mode=LogprobMode.RAW)
    _, t1 = store.sessions.begin_turn("s", 1, (20,), raw)
    session, _ = store.sessions.complete_turn(t1, _sample(t1, [30, 31, 32], spans=[(0, 3), (2, 4)]))
    t = session.trajectory()
    assert t.token_ids == (1, 2, 3, 10, 11, 20, 30, 31, 32) and t.prompt_length == 3
    assert t.loss_mask == (0, 0, 0, 1, 1, 0, 1, 1, 1)
    assert t.policy_versions == (-1, -1, -1, 3, 3, -1, 3, 3, 4)
    assert t.logprobs == (0.0, 0.0, 0.0, -0.5, -1.5, 0.0, -0.5, -1.5, -2.5)
    assert session.context_before(1) == (1, 2, 3, 10, 11)
    assert session.turns[1].sampling == raw


def test_a_prompt_given_after_opening_and_the_listing(store, job):
    store.jobs.create(Job(job_id="other", model_path="/m"))
    opened, _ = store.sessions.open(AgentSession("sg", "job", (), streaming=True))
    assert opened.prompt_token_ids == () and opened.num_tokens == 0 and opened.streaming
    assert store.sessions.open(AgentSession("sg", "job", (), streaming=True))[1] is False
    with pytest.raises(AlreadyExists) as info:  # the same id opened as another kind
        store.sessions.open(AgentSession("sg", "job", ()))
    assert info.value.field == "streaming"
    given = store.sessions.set_prompt("sg", (1, 2, 3))
    assert given.prompt_token_ids == (1, 2, 3) and given.num_tokens == 3
    assert store.sessions.set_prompt("sg", (1, 2, 3)) == given  # again: a no-op
    with pytest.raises(AlreadyExists) as info:
        store.sessions.set_prompt("sg", (1, 2))
    assert info.value.field == "prompt_token_ids"
    store.sessions.open(AgentSession("b", "other", (4,)))
    store.sessions.begin_turn("b", 0, (), GREEDY)
    store.sessions.open(AgentSession("c", "job", (5,)))
    store.sessions.close("c")

    listed = {s.session_id: s for s in store.sessions.list()}
    assert set(listed) == {"sg", "b", "c"}
    assert (listed["b"].running_turn, listed["sg"].running_turn) == (0, -1)
    assert (listed["sg"].num_tokens, listed["b"].job_id) == (3, "other")
    assert [s.session_id for s in store.sessions.list("job", [SessionStatus.CLOSED])] == ["c"]
    assert {s.session_id for s in store.sessions.list(statuses=[SessionStatus.OPEN])} == {
        "sg",
        "b",
    }
    assert len(store.sessions.list(limit=2)) == 2
    with pytest.raises(FailedPrecondition):
        store.sessions.set_prompt("c", (1,))


def test_sessions_opened_together_are_each_opened_once(store, job):
    group = [AgentSession(f"g.{i}", "job", (1, 2)) for i in range(3)]
    store.sessions.open(group[1])  # one of them opened before
    opened = store.sessions.open_all(group)
    assert [s.session_id for s in opened] == ["g.0", "g.1", "g.2"]
    assert store.sessions.open_all(group) == opened  # again: the same sessions
    with pytest.raises(AlreadyExists) as info:
        store.sessions.open_all(
            [AgentSession("g.3", "job", (1, 2)), AgentSession("g.0", "job", (5,))]
        )
    assert info.value.field == "prompt_token_ids"
    with pytest.raises(NotFound):
        store.sessions.get("g.3")  # one transaction: nothing of the refused call was stored


def test_retention_deletes_closed_sessions_with_their_turns_only(store, job):
    from datetime import timedelta

    from tltd.store.tables import utcnow

    store.sessions.open(AgentSession("done", "job", (1, 2)))
    _, turn = store.sessions.begin_turn("done", 0, (), GREEDY)
    store.sessions.complete_turn(turn, _sample(turn, [7]))
    store.sessions.close("done")
    store.sessions.open(AgentSession("open", "job", (3,)))
    assert store.sessions.prune_closed(utcnow() - timedelta(hours=1)) == 0  # not old enough
    assert store.sessions.prune_closed(utcnow() + timedelta(seconds=1)) == 1
    with pytest.raises(NotFound):
        store.sessions.get("done")
    assert store.sessions.get("open").status is SessionStatus.OPEN  # never an open one
