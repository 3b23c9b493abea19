"""Groups of sessions through a real daemon (gRPC, real workers, the torch engine): n sessions of
one prompt opened in one call sample, turn by turn, what each would alone (seeded, tokens equal
and logprobs within 1e-4 of an in-process engine that prefills in full), and their first turns
share one prefill of the prompt; bad input is named by field."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.api.support import fails, make_settings, sampling
from tests.rollout.support import InProcessDaemon, wait_until
from tltd.domain import SamplingParams
from tltd.v1 import common_pb2

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
SEEDS = [21, 22, 23, 24]
SAMPLED = dict(temperature=1.0, max_new_tokens=10)
OFF = common_pb2.SpeculativeConfig(mode=common_pb2.SPECULATIVE_MODE_OFF)  # seeded: bitwise


@pytest.fixture
def d(sqlite_store, tmp_path):
    settings = make_settings(
        tmp_path, cpu_slots=2, worker_max_batch=16, worker_max_seq_len=1024,
        worker_heartbeat_seconds=0.2, shutdown_grace_seconds=10.0,
        device_refresh_seconds=3600.0,
    )  # fmt: skip
    daemon = InProcessDaemon(settings, sqlite_store).start()
    yield daemon
    daemon.kill()


def _prefix(d: InProcessDaemon) -> dict[str, int]:
    """The workers' prefix cache counters (their last heartbeats), summed."""
    out = {"hits": 0, "misses": 0, "prefilled_tokens": 0}
    for stats in d.supervisor.worker_stats().values():
        for k in out:
            out[k] += int((stats.get("prefix_cache") or {}).get(k, 0))
    return out


def _first_turns(d, c, session_ids: list[str]) -> list:
    """Each session's first turn, all sent at once, each with its own seed; then the prefix
    cache counters once every worker has reported them."""

    def run(sid_seed):
        sid, seed = sid_seed
        return c.turn(sid, 0, sampling=sampling(**SAMPLED, seed=seed)).turn

    before = _prefix(d)["hits"] + _prefix(d)["misses"]
    with ThreadPoolExecutor(len(session_ids)) as pool:
        turns = list(pool.map(run, zip(session_ids, SEEDS, strict=True)))

    def looked_up() -> int:
        return _prefix(d)["hits"] + _prefix(d)["misses"]

    wait_until(lambda: looked_up() >= before + len(session_ids), what="lookups reported")
    return turns


def _alone(ckpt, prompt: list[int], seed: int):
    """The first turn of a session opened alone: the engine in this process, full prefill."""
    from tltd_workers.engine.engine import Engine, EngineConfig, Request

    engine = Engine(ckpt, EngineConfig(max_batch=16, max_seq_len=1024, spec_mode="off"))
    sp = SamplingParams(n=1, seed=seed, **SAMPLED)
    return engine.generate([Request("t", prompt, sp)])[0]


def test_a_group_samples_what_each_session_would_alone_and_prefills_the_prompt_once(d, ckpt):
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job", speculative=OFF)
        d.wait_workers_ready(2)
        group = c.open_session_group("job", PROMPT, 4, group_id="q7")
        ids = [s.session_id for s in group.sessions]
        assert group.group_id == "q7" and ids == ["q7.0", "q7.1", "q7.2", "q7.3"]
        assert all(list(s.trajectory.token_ids) == PROMPT for s in group.sessions)
        again = c.open_session_group("job", PROMPT, 4, group_id="q7")  # idempotent
        assert [s.session_id for s in again.sessions] == ids
        before = _prefix(d)
        turns = _first_turns(d, c, ids)
        after = _prefix(d)
        # Four sessions of four other prompts of the same length: each prefilled in full.
        others = [[(t + k) % 30 + 1 for t in PROMPT] for k in range(1, 5)]
        for k, prompt in enumerate(others):
            c.open_session("job", prompt, session_id=f"alone.{k}")
        _first_turns(d, c, [f"alone.{k}" for k in range(4)])
        last = _prefix(d)
        second = c.turn("q7.2", 1, [7, 7], sampling=sampling(**SAMPLED, seed=5)).turn
        _refusals(c)
    for turn, seed in zip(turns, SEEDS, strict=True):
        want = _alone(ckpt, PROMPT, seed)
        assert list(turn.token_ids) == want.token_ids
        assert turn.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert len({tuple(t.token_ids) for t in turns}) > 1  # their own seeds: other answers
    # One prefill of the prompt; the three others fed only its last token.
    assert after["prefilled_tokens"] - before["prefilled_tokens"] == len(PROMPT) + 3
    assert after["hits"] - before["hits"] == 3
    assert last["prefilled_tokens"] - after["prefilled_tokens"] == 4 * len(PROMPT)
    # A later turn goes on from its own session's KV, as any session's.
    context = PROMPT + list(turns[2].token_ids) + [7, 7]
    assert list(second.token_ids) == _alone(ckpt, context, 5).token_ids


def _refusals(c) -> None:
    """Bad input, named by field."""
    with fails(grpc.StatusCode.NOT_FOUND, "job_id"):
        c.open_session_group("nope", PROMPT, 2)
    with fails(grpc.StatusCode.ALREADY_EXISTS, "prompt_token_ids"):
        c.open_session_group("job", [1, 2], 2, group_id="q7")  # another prompt
    for group_id in ("bad id", "g" * 93):
        with fails(grpc.StatusCode.INVALID_ARGUMENT, "group_id"):
            c.open_session_group("job", PROMPT, 2, group_id=group_id)
    for n in (0, 257):
        with fails(grpc.StatusCode.INVALID_ARGUMENT, "n"):
            c.open_session_group("job", PROMPT, n)
    with fails(grpc.StatusCode.INVALID_ARGUMENT, "prompt_token_ids"):
        c.open_session_group("job", [], 2)
