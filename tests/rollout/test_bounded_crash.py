"""Bounded requests (asynchronous RL) across a daemon kill -9: the groups a stream did not send
and the units still running survive it (running samples go on from their checkpoints, paused
ones from their stored tokens), every group is sent once, and each stream's retry re-sends
exactly what it sent before."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest
from sqlalchemy import text

from tests.api.support import sampling
from tests.rollout.support import ServeProcess, direct_outputs, wait_until
from tests.rollout.test_rollouts import Stream
from tltd.domain import Sample, SamplingParams
from tltd.store import Store
from tltd.v1 import common_pb2, job_pb2, rollout_pb2
from tltd_clients.errors import UnavailableError

SHORT = dict(n=2, temperature=0.0, max_new_tokens=16)
LONG = dict(n=2, temperature=0.0, max_new_tokens=1000)
FIRST = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
RUNNING = [[10, 11, 12], [3, 1, 4, 1, 5]]
LATER = [[2, 7, 1]]
OFF = common_pb2.SPECULATIVE_MODE_OFF  # a token a step: long samples take a while


def _bound(groups: int, carried: bool = False) -> rollout_pb2.StepBound:
    return rollout_pb2.StepBound(groups=groups, carried=carried)


def _park(groups: int) -> rollout_pb2.StepBound:
    return rollout_pb2.StepBound(groups=groups, park=True)


def _groups(samples) -> dict[tuple[str, int], tuple]:
    out: dict[tuple[str, int], list] = {}
    for s in samples:
        out.setdefault((s.request_id, s.prompt_index), []).append(s)
    return {k: tuple(sorted(tuple(s.token_ids) for s in v)) for k, v in out.items()}


def _sql(migrated_db_url: str, query: str) -> list:
    store = Store(migrated_db_url)
    try:
        with store._tx(write=False) as s:
            return [tuple(r) for r in s.execute(text(query)).all()]
    finally:
        store.close()


@pytest.mark.slow
def test_groups_unsent_and_running_at_a_kill9_are_each_sent_once_after(
    migrated_db_url, tmp_path, ckpt
):
    """Running samples go on from their checkpoints after a kill -9 and a restart: lost 0,
    duplicated 0; a checkpoint made to differ from what the policy would sample (its last
    token changed) shows that what was stored is what the sample went on from."""
    a = ServeProcess(tmp_path, migrated_db_url, "a", sample_checkpoint_seconds="0.2")
    try:
        with a.client() as c:
            c.create_job(str(ckpt), job_id="job")
            short = sampling(**SHORT)
            r1 = list(c.generate("job", FIRST, sampling=short, request_id="r1", bound=_bound(1)))
            # r2's units run long: they are still leased (running) when the daemon dies.
            s2 = Stream(c, "job", RUNNING, sampling=sampling(**LONG), request_id="r2",
                        bound=_bound(2), speculative=OFF)  # fmt: skip
            saved = "SELECT count(*) FROM sample_checkpoints WHERE request_id = 'r2'"
            wait_until(lambda: _sql(migrated_db_url, saved) == [(4,)], what="r2 checkpointed")
            a.proc.send_signal(signal.SIGKILL)
            a.wait()
            s2.result(30)
            assert isinstance(s2.error, UnavailableError), s2.error
    finally:
        a.kill()
    done = "SELECT count(*) FROM samples WHERE request_id = 'r2' AND NOT partial"
    assert _sql(migrated_db_url, done) == [(0,)]  # all four were running
    altered = alter_a_checkpoint(migrated_db_url, "r2", [0, 1])
    b = ServeProcess(tmp_path, migrated_db_url, "b")
    try:
        with b.client() as c:
            again = list(c.generate("job", FIRST, sampling=short, request_id="r1", bound=_bound(1)))
            r2 = list(c.generate("job", RUNNING, sampling=sampling(**LONG), request_id="r2",
                                 bound=_bound(2), speculative=OFF))  # fmt: skip
            r3 = list(c.generate("job", LATER, sampling=short, request_id="r3",
                                 bound=_bound(3, carried=True)))  # fmt: skip
    finally:
        b.kill()
    g1, g2, g3 = _groups(r1), _groups(r2), _groups(r3)
    assert len(g1) == 1 and _groups(again) == g1  # the retry re-sends what r1 sent
    assert set(g2) == {("r2", 0), ("r2", 1)}
    # r1's two unsent groups (done before the kill) and r3's own: lost 0, duplicated 0.
    assert set(g3) == ({("r1", p) for p in range(3)} - set(g1)) | {("r3", 0)}
    sent = _sql(migrated_db_url, "SELECT request_id, prompt_index, delivered_to FROM work_units")
    assert sorted(sent) == sorted(
        [(rid, p, to) for (rid, p), to in [*((k, "r1") for k in g1), *((k, "r2") for k in g2),
                                           *((k, "r3") for k in g3)]]
    )  # fmt: skip
    check_resumed(ckpt, r2, altered, RUNNING, LONG)
    # The other tokens are the engine's own (greedy: going on from a checkpoint reproduces
    # an uninterrupted run).
    refs = {"r1": (FIRST, SHORT), "r2": (RUNNING, LONG), "r3": (LATER, SHORT)}
    key = (altered.prompt_index, altered.sample_index)
    for s in [*r1, *r2, *r3]:
        if (s.request_id, s.prompt_index, s.sample_index) == ("r2", *key):
            continue
        prompts, params = refs[s.request_id]
        ref = direct_outputs(ckpt, prompts, SamplingParams(**params))
        assert tuple(s.token_ids) == ref[(s.prompt_index, s.sample_index)]


def alter_a_checkpoint(db_url: str, request_id: str, prompts: list[int]) -> Sample:
    """Change the last stored token of one checkpoint of these units (to a token the policy
    did not sample there); returns the checkpoint as altered."""
    store = Store(db_url)
    try:
        saved = store.checkpoints.of_units(request_id, prompts)
        assert saved and all(x.token_ids for x in saved)
        x = saved[0]
        last = x.token_ids[-1]
        altered = replace(x, token_ids=(*x.token_ids[:-1], 3 if last != 3 else 4))
        with store._tx() as s:
            s.execute(
                text("DELETE FROM sample_checkpoints WHERE request_id = :r "
                     "AND prompt_index = :p AND sample_index = :i"),
                {"r": request_id, "p": x.prompt_index, "i": x.sample_index},
            )  # fmt: skip
        assert store.checkpoints.save([altered]) == 1
        return altered
    finally:
        store.close()


def check_resumed(ckpt, samples, altered: Sample, prompts, params: dict) -> None:
    """The altered sample starts with the stored tokens, then goes on greedily from them."""
    (s,) = [
        x for x in samples
        if (x.request_id, x.prompt_index, x.sample_index)
        == (altered.request_id, altered.prompt_index, altered.sample_index)
    ]  # fmt: skip
    k = len(altered.token_ids)
    assert tuple(s.token_ids[:k]) == altered.token_ids
    assert tuple(s.logprobs[:k]) == pytest.approx(altered.logprobs)
    prompt = [*prompts[s.prompt_index], *altered.token_ids]
    rest = {**params, "n": 1, "max_new_tokens": params["max_new_tokens"] - k}
    assert tuple(s.token_ids[k:]) == direct_outputs(ckpt, [prompt], SamplingParams(**rest))[(0, 0)]


# Token 16 ends prompt 0 after ~34 tokens (greedy, the tiny checkpoint); the others run on.
PARKING = dict(n=2, temperature=0.0, max_new_tokens=1000, stop_token_ids=[16])
PARK_PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.slow
def test_parked_samples_survive_a_kill9_and_go_on_from_their_tokens(
    migrated_db_url, tmp_path, ckpt, ckpt2
):
    """Paused samples and parked prompts are in the store only: after kill -9 and a restart a
    retry re-sends what was sent, and a carried request on the new policy version goes on
    from the stored tokens (spans: the old version's tokens, then the new one's), each group
    once, nothing lost."""
    a = ServeProcess(tmp_path, migrated_db_url, "a")
    try:
        with a.client() as c:
            c.create_job(str(ckpt), job_id="job", policy_switch=job_pb2.POLICY_SWITCH_NEXT_STEP,
                         max_staleness=4)  # fmt: skip
            first = list(c.generate("job", PARK_PROMPTS, sampling=sampling(**PARKING),
                                    request_id="p1", bound=_park(1), speculative=OFF))  # fmt: skip
            paused = c.get_request("p1", True).samples
        a.proc.send_signal(signal.SIGKILL)
        a.wait()
    finally:
        a.kill()
    paused = {(s.prompt_index, s.sample_index): s for s in paused if s.partial}
    parked = _sql(migrated_db_url, "SELECT prompt_index FROM work_units WHERE state = 'parked'")
    assert paused and {p for p, _ in paused} <= {p for (p,) in parked}
    b = ServeProcess(tmp_path, migrated_db_url, "b")
    try:
        with b.client() as c:
            again = list(c.generate("job", PARK_PROMPTS, sampling=sampling(**PARKING),
                                    request_id="p1", bound=_park(1), speculative=OFF))  # fmt: skip
            c.update_policy("job", str(ckpt2))
            later = list(c.generate("job", LATER, sampling=sampling(**PARKING), request_id="p2",
                                    bound=_bound(3, carried=True), speculative=OFF))  # fmt: skip
    finally:
        b.kill()
    g1, g2 = _groups(first), _groups(later)
    assert len(g1) == 1 and _groups(again) == g1
    assert set(g2) == ({("p1", p) for p in range(3)} - set(g1)) | {("p2", 0)}  # lost 0, dup 0
    # Version 0's own tokens (greedy): what the paused samples hold, and what a resumed one
    # adds before its worker has loaded version 1 (the switch is in flight: spans say where).
    v0_params = SamplingParams(**{**PARKING, "max_new_tokens": 200, "stop_token_ids": (16,)})
    v0 = direct_outputs(ckpt, PARK_PROMPTS, v0_params)
    resumed = 0
    for s in later:
        if (s.prompt_index, s.sample_index) in paused and s.request_id == "p1":
            before = paused[(s.prompt_index, s.sample_index)]
            k = len(before.token_ids)
            assert k and tuple(s.token_ids[:k]) == tuple(before.token_ids)
            spans = [(x.first_token, x.policy_version) for x in s.policy_spans]
            assert len(spans) == 2 and spans[0] == (0, 0) and spans[1][1] == 1, spans
            j = spans[1][0]
            assert k <= j < len(s.token_ids) and j < 200, (k, j)
            assert tuple(s.token_ids[:j]) == v0[(s.prompt_index, 0)][:j]
            resumed += 1
    assert resumed == len(paused)
