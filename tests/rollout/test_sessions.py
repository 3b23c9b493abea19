"""Multi-turn sessions through a real daemon (gRPC on port 0, real workers, the torch engine):
a round trip whose trajectory is exactly the prompt, the environment's tokens and what each turn
sampled, a policy update between turns, and bad input named by field."""

from __future__ import annotations

import os
import signal
import threading

import grpc

from tests.api.support import fails, sampling
from tests.rollout.support import direct_outputs, wait_until
from tltd.domain import SamplingParams
from tltd.v1 import rollout_pb2, session_pb2

PROMPT = [1, 2, 3, 4]
ENV = [[5, 6, 7], [8, 9]]  # what the environment answers after turns 0 and 1
GREEDY = dict(temperature=0.0, max_new_tokens=12)


def _expected(path, context: list[int]) -> list[int]:
    """The greedy continuation of `context` computed by the engine in this process."""
    out = direct_outputs(path, [context], SamplingParams(n=1, temperature=0.0, max_new_tokens=12))
    return list(out[(0, 0)])


def _run_turns(c, session_id: str, inputs: list[list[int]]):
    return [
        c.turn(session_id, i, env, sampling=sampling(**GREEDY)).turn for i, env in enumerate(inputs)
    ]


def test_open_turns_close_round_trip(daemon, ckpt):
    with daemon.client() as c:
        c.create_job(str(ckpt), job_id="job")
        opened = c.open_session("job", PROMPT, session_id="s1")
        assert opened.status == session_pb2.SESSION_STATUS_OPEN and opened.num_turns == 0
        assert list(opened.trajectory.token_ids) == PROMPT
        turns = _run_turns(c, "s1", [[], *ENV])
        again = c.turn("s1", 1, ENV[0], sampling=sampling(**GREEDY)).turn  # a retry: stored
        closed = c.close_session("s1")
        req = c.get_request(turns[1].request_id, include_samples=True)
    assert again == turns[1] and len(req.samples) == 1  # the retry ran nothing
    context = list(PROMPT)
    for turn, env in zip(turns, [[], *ENV], strict=True):
        context += env
        assert list(turn.token_ids) == _expected(ckpt, context)  # the whole context, as sent
        assert len(turn.logprobs) == len(turn.token_ids) == 12
        assert turn.finish_reason == rollout_pb2.FINISH_REASON_LENGTH
        context += list(turn.token_ids)
    t = closed.trajectory
    assert closed.status == session_pb2.SESSION_STATUS_CLOSED and closed.num_turns == 3
    assert list(t.token_ids) == context and closed.num_tokens == len(context)
    assert t.prompt_length == len(PROMPT)
    mask = [0] * 4 + [1] * 12 + [0] * 3 + [1] * 12 + [0] * 2 + [1] * 12
    assert list(t.loss_mask) == mask
    assert list(t.policy_versions) == [0 if m else -1 for m in mask]
    sampled = [lp for turn in turns for lp in turn.logprobs]
    assert [lp for lp, m in zip(t.logprobs, mask, strict=True) if m] == sampled
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, mask, strict=True) if not m)


def test_a_policy_update_between_turns_runs_the_next_turn_on_it(daemon, ckpt, ckpt2):
    with daemon.client() as c:
        c.create_job(str(ckpt), job_id="job")
        c.open_session("job", PROMPT, session_id="s")
        first = c.turn("s", 0, sampling=sampling(**GREEDY)).turn
        assert c.update_policy("job", str(ckpt2)).version == 1
        second = c.turn("s", 1, ENV[0], sampling=sampling(**GREEDY)).turn
        session = c.get_session("s")
    assert (first.policy_version, second.policy_version) == (0, 1)
    context = PROMPT + list(first.token_ids) + ENV[0]
    assert list(second.token_ids) == _expected(ckpt2, context)  # the new weights' tokens
    versions = list(session.trajectory.policy_versions)
    assert versions == [-1] * 4 + [0] * 12 + [-1] * 3 + [1] * 12
    assert session.status == session_pb2.SESSION_STATUS_OPEN and session.num_turns == 2


def test_bad_input_gets_a_status_naming_the_field(daemon, ckpt):
    code = grpc.StatusCode
    with daemon.client() as c:
        c.create_job(str(ckpt), job_id="job")
        with fails(code.NOT_FOUND, "job_id"):
            c.open_session("nope", PROMPT)
        with fails(code.INVALID_ARGUMENT, "prompt_token_ids"):
            c.open_session("job", [])
        with fails(code.INVALID_ARGUMENT, "prompt_token_ids[1]"):
            c.open_session("job", [1, 4800])
        with fails(code.INVALID_ARGUMENT, "session_id"):
            c.open_session("job", PROMPT, session_id="x" * 97)
        c.open_session("job", PROMPT, session_id="s")
        assert c.open_session("job", PROMPT, session_id="s").session_id == "s"  # idempotent
        with fails(code.ALREADY_EXISTS, "prompt_token_ids"):
            c.open_session("job", [1], session_id="s")
        with fails(code.NOT_FOUND, "session_id"):
            c.turn("other", 0, sampling=sampling())
        with fails(code.FAILED_PRECONDITION, "turn_index"):
            c.turn("s", 1, sampling=sampling())
        with fails(code.INVALID_ARGUMENT, "sampling.n"):
            c.turn("s", 0, sampling=sampling(n=2))
        with fails(code.INVALID_ARGUMENT, "sampling.top_logprobs"):
            c.turn("s", 0, sampling=sampling(top_logprobs=2))
        with fails(code.INVALID_ARGUMENT, "sampling.temperature"):
            c.turn("s", 0, sampling=sampling(temperature=-1.0))
        with fails(code.INVALID_ARGUMENT, "input_token_ids[0]"):
            c.turn("s", 0, [-3], sampling=sampling())
        with fails(code.INVALID_ARGUMENT, "sampling.max_new_tokens", "at most 1020"):
            c.turn("s", 0, sampling=sampling(max_new_tokens=1021))  # a worker holds 1024
        with fails(code.INVALID_ARGUMENT, "input_token_ids"):
            c.turn("s", 0, [1] * 1020, sampling=sampling())
        c.turn("s", 0, sampling=sampling(**GREEDY))
        with fails(code.ALREADY_EXISTS, "input_token_ids"):
            c.turn("s", 0, [7], sampling=sampling(**GREEDY))  # turn 0 was sent none
        with fails(code.ALREADY_EXISTS, "sampling.max_new_tokens"):
            c.turn("s", 0, sampling=sampling(temperature=0.0, max_new_tokens=5))
        _turn_while_a_turn_runs(daemon, c)
        with fails(code.FAILED_PRECONDITION, "session_id", "closed"):
            c.turn("s", 1, sampling=sampling())
    assert daemon.supervisor is not None  # the daemon keeps running


def _turn_while_a_turn_runs(daemon, c) -> None:
    """Turn 1 runs long; another turn meanwhile is refused; closing the session drops turn 1
    (its request is cancelled) and its caller is told the turn ended."""
    code, errors = grpc.StatusCode, []
    long = sampling(temperature=0.0, max_new_tokens=900)

    def run() -> None:
        try:
            c.turn("s", 1, ENV[0], sampling=long)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    rid = "session:s:1:0"

    def worker_pid() -> int | None:
        live = daemon.supervisor.queue.get(rid)
        wids = set(live.running.values()) if live is not None else set()
        return daemon.supervisor.handles[wids.pop()].proc.pid if wids else None

    wait_until(lambda: worker_pid() is not None, what="turn 1 running")
    pid = worker_pid()
    os.kill(pid, signal.SIGSTOP)  # turn 1 surely runs while the calls below are made
    try:
        with fails(code.FAILED_PRECONDITION, "turn_index", "still running"):
            c.turn("s", 2, ENV[1], sampling=sampling())
        with fails(code.ALREADY_EXISTS, "input_token_ids"):
            c.turn("s", 1, ENV[1], sampling=long)
        closed = c.close_session("s")
    finally:
        os.kill(pid, signal.SIGCONT)
    t.join(60)
    assert not t.is_alive()
    assert closed.num_turns == 1 and [x.turn_index for x in closed.turns] == [0]
    assert len(errors) == 1 and errors[0].code in (code.ABORTED, code.FAILED_PRECONDITION)
    assert c.get_request(rid).request.status == rollout_pb2.REQUEST_STATUS_CANCELLED
    assert c.close_session("s") == c.get_session("s")  # closing again returns it
