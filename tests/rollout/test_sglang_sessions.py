"""Sessions on the SGLang backend (two GPUs faked at NVML, the fake `sglang.Engine` in each
worker process): a session's turns all go to one engine, each submitted as the session's whole
sequence so far, so that SGLang's radix cache holds its prefix; the trajectory is what the
engine sampled, with the environment's tokens masked out."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from tests.api.support import make_settings, sampling
from tests.drafter.helpers import make_target_dir
from tests.rollout import fake_sglang
from tests.rollout.support import InProcessDaemon, wait_until
from tests.store.test_devices import FakeNvml, _gpu
from tltd.domain import Backend, Job

SESSIONS = {f"s{i}": [1 + i, 20 + i, 3, 40 - i] for i in range(6)}  # distinct first tokens
ENV = [[], [7, 8], [9], [11, 12, 13]]  # the environment's tokens before each turn
GREEDY = dict(temperature=0.0, max_new_tokens=5)


def _run_session(d: InProcessDaemon, sid: str) -> None:
    with d.client() as c:
        c.open_session("job", SESSIONS[sid], session_id=sid)
        for i, env in enumerate(ENV):
            c.turn(sid, i, env, sampling=sampling(**GREEDY), timeout=120)


def _submits(log) -> list[dict]:
    events = [json.loads(line) for line in log.read_text().splitlines()]
    return [e for e in events if e["event"] == "submit"]


def _longest_shared_prefix(ids: list[int], earlier: list[list[int]]) -> int:
    best = 0
    for other in earlier:
        n = 0
        for a, b in zip(ids, other, strict=False):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


def test_a_sessions_turns_reach_one_sglang_engine_as_its_whole_sequence(
    sqlite_store, tmp_path, monkeypatch
):
    # A vocabulary the fake engine's tokens fit in: a turn's output is the next turn's input.
    ckpt = make_target_dir(tmp_path / "policy", vocab=fake_sglang.VOCAB)
    log = tmp_path / "engine.jsonl"
    monkeypatch.setenv(fake_sglang.LOG_ENV, str(log))  # the worker processes inherit it
    settings = make_settings(
        tmp_path, worker_heartbeat_seconds=0.2, device_refresh_seconds=3600.0,
        drafter_training=False, default_backend="sglang", scheduler_tick_seconds=0.1,
        sglang_engine_factory="tests.rollout.fake_sglang:factory",
    )  # fmt: skip
    d = InProcessDaemon(settings, sqlite_store, nvml=FakeNvml([_gpu(0), _gpu(1)])).start()
    try:
        # As from a GPU node sharing the database: this host has no sglang to create it.
        d.store.jobs.create(Job("job", str(ckpt), backend=Backend.SGLANG))
        d.wait_workers_ready(2)
        handles = d.supervisor.handles.values()
        wait_until(lambda: all(h.job_id == "job" for h in handles), what="the job loaded")
        with ThreadPoolExecutor(len(SESSIONS)) as pool:  # all at once: both engines busy
            list(pool.map(lambda sid: _run_session(d, sid), SESSIONS))
        with d.client() as c:
            trajectories = {sid: c.close_session(sid) for sid in SESSIONS}
    finally:
        d.kill()

    submits = _submits(log)
    assert len({e["pid"] for e in submits}) == 2  # both engines served sessions
    for sid, prompt in SESSIONS.items():
        turns = [e for e in submits if e["input_ids"][: len(prompt)] == prompt]
        assert len(turns) == len(ENV), (sid, turns)
        # Pinned: every turn on the engine that ran the first (no re-pin at this load).
        assert {e["pid"] for e in turns} == {turns[0]["pid"]}, sid
        traj = trajectories[sid].trajectory
        tokens = list(traj.token_ids)
        # Each turn is the whole sequence so far: the previous turn's input, its output and
        # the environment's tokens; the last submit plus the last turn's output is the session.
        for before, after in zip(turns, turns[1:], strict=False):
            assert after["input_ids"][: len(before["input_ids"])] == before["input_ids"]
        assert tokens[: len(turns[-1]["input_ids"])] == turns[-1]["input_ids"]
        mask = list(traj.loss_mask)
        env_tokens = [t for t, m in zip(tokens[len(prompt) :], mask[len(prompt) :], strict=True)
                      if m == 0]  # fmt: skip
        assert env_tokens == [t for env in ENV for t in env]
        assert sum(mask) == len(ENV) * GREEDY["max_new_tokens"]
        # What SGLang's radix cache finds of each later turn on its engine: all of the earlier
        # turn's input (on another engine it would find none of the session's own tokens).
        for k, turn in enumerate(turns[1:], 1):
            here = [
                e["input_ids"] for e in submits[: submits.index(turn)] if e["pid"] == turn["pid"]
            ]
            assert _longest_shared_prefix(turn["input_ids"], here) >= len(turns[k - 1]["input_ids"])
