"""Parking at a step bound (StepBound.park), through a real daemon and real workers: the
unfinished prompts pause, their tokens stored, take no slot while parked, and go on from their
tokens when the job's next carried request is accepted, under the job's newest policy version,
each group sent once."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
from sqlalchemy import text

from tests.api.support import run_tltctl, sampling
from tests.rollout.support import direct_outputs
from tltd.domain import SamplingParams
from tltd.v1 import common_pb2, job_pb2, rollout_pb2
from tltd_clients.errors import InvalidArgumentError

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12], [3, 1, 4, 1, 5]]
MORE = [[2, 7, 1], [8, 2, 8, 1]]
# Token 16 ends prompt 0 after ~34 tokens and prompt 1 after ~160 (greedy, the tiny
# checkpoint): the others run to the cap, so they are running when the first group is done.
LONG = dict(n=2, temperature=0.0, max_new_tokens=1000, stop_token_ids=[16])
REF = SamplingParams(**{**LONG, "stop_token_ids": (16,)})  # the in-process engine's
BUDGETED = dict(LONG, max_new_tokens=400)  # three steps of 150 tokens reach the cap
# Without speculative decoding a token a step: prompt 0's group is done ~10x sooner than the
# others, which are running when the stream takes it (with drafts a repetitive tail can
# finish before the stream's first take).
OFF = common_pb2.SPECULATIVE_MODE_OFF


def bound(groups: int, carried=False, park=False, deadline_ms=0, max_tokens=0):
    return rollout_pb2.StepBound(
        groups=groups, carried=carried, park=park, deadline_ms=deadline_ms, max_tokens=max_tokens
    )


def groups_of(samples) -> dict[tuple[str, int], list]:
    out: dict[tuple[str, int], list] = {}
    for s in samples:
        out.setdefault((s.request_id, s.prompt_index), []).append(s)
    return out


def sql(store, query: str) -> list[tuple]:
    with store._tx(write=False) as s:
        return [tuple(r) for r in s.execute(text(query)).all()]


def unit_states(store, rid: str) -> dict[int, str]:
    rows = sql(store, f"SELECT prompt_index, state FROM work_units WHERE request_id = '{rid}'")
    return {int(p): st for p, st in rows}


def paused_samples(store, rid: str) -> dict[tuple[int, int], int]:
    """(prompt, sample) -> tokens of the samples stored paused (partial, ABORTED)."""
    rows = sql(
        store,
        "SELECT prompt_index, sample_index, num_tokens FROM samples WHERE request_id = "
        f"'{rid}' AND partial AND finish_reason = 'aborted'",
    )
    return {(int(p), int(i)): int(k) for p, i, k in rows}


def test_parked_prompts_wait_then_go_on_from_their_tokens(daemon, ckpt):
    """Lossless across the pause: greedy samples paused mid-way and resumed are the tokens an
    uninterrupted run gives; each group is sent once; parked work takes no slot."""
    run = dict(sampling=sampling(**LONG), timeout=300, speculative=OFF)
    with daemon.client() as c:
        c.create_job(str(ckpt), job_id="job")
        first = list(c.generate("job", PROMPTS, request_id="r1", bound=bound(1, park=True), **run))
        states = unit_states(daemon.store, "r1")
        parked = {p for p, st in states.items() if st == "parked"}
        paused = paused_samples(daemon.store, "r1")
        done_before = sql(daemon.store, "SELECT count(*) FROM samples WHERE NOT partial")
        time.sleep(1.0)  # parked: nothing of r1 runs
        assert sql(daemon.store, "SELECT count(*) FROM samples WHERE NOT partial") == done_before
        assert daemon.supervisor.queue.get("r1") is None
        second = list(
            c.generate("job", MORE, request_id="r2", bound=bound(6, carried=True), **run)
        )
    g1, g2 = groups_of(first), groups_of(second)
    assert len(g1) == 1 and all(len(v) == 2 for v in g1.values())
    assert parked, states  # the rest was running long when the bound was reached
    assert paused and all(k > 0 for k in paused.values())  # tokens kept, not re-run
    assert {p for p, _ in paused} <= parked
    # Every group once: r1's other four (carried, parked or done) and r2's own two.
    assert set(g1) | set(g2) == {("r1", p) for p in range(5)} | {("r2", 0), ("r2", 1)}
    assert not set(g1) & set(g2)
    assert all(len(v) == 2 and not any(s.partial for s in v) for v in g2.values())
    ref = direct_outputs(ckpt, PROMPTS, REF, speculative=False)
    for (rid, p), samples in {**g1, **g2}.items():
        if rid == "r1":
            for s in samples:
                assert tuple(s.token_ids) == ref[(p, s.sample_index)], (p, s.sample_index)
    assert unit_states(daemon.store, "r1") == {p: "done" for p in range(5)}


def test_a_parked_sample_goes_on_under_the_newest_version_and_its_spans_say_so(
    sqlite_daemon, ckpt, ckpt2, capsys, monkeypatch
):
    """Per-token versions true by construction: the two checkpoints answer differently, so the
    resumed tokens are the new version's continuation of the stored ones."""
    d, run = sqlite_daemon, dict(sampling=sampling(**LONG), timeout=300, speculative=OFF)
    with d.client() as c:
        c.create_job(
            str(ckpt), job_id="v", policy_switch=job_pb2.POLICY_SWITCH_NEXT_STEP, max_staleness=4
        )
        list(c.generate("v", PROMPTS, request_id="a", bound=bound(1, park=True), **run))
        paused = paused_samples(d.store, "a")
        stored = {(s.prompt_index, s.sample_index): s for s in c.get_request("a", True).samples}
        c.update_policy("v", str(ckpt2))
        later = list(c.generate("v", MORE, request_id="b", bound=bound(6, carried=True), **run))
        stats = c.get_job("v").bounded
    monkeypatch.setenv("TLTD_TARGET", d.target)
    code, out, _ = run_tltctl(capsys, "jobs", "show", "v", "-o", "json")
    assert code == 0 and json.loads(out)["bounded"]["groups_sent"] == 7
    assert json.loads(out)["partial_ratio"] == round(len(paused) / 14, 3)
    assert paused
    assert stats.groups_sent == 7 and stats.prompts_parked == 0 and stats.samples_sent == 14
    # The paused samples went on under v1; nothing else spans two versions.
    assert stats.samples_multi_version == len(paused) and stats.max_version_spread == 1
    resumed = {(s.prompt_index, s.sample_index): s for s in later if s.request_id == "a"}
    for key, k in sorted(paused.items()):
        s, before = resumed[key], stored[key]
        assert tuple(s.token_ids[:k]) == tuple(before.token_ids)  # the stored tokens, kept
        spans = [(x.first_token, x.policy_version) for x in s.policy_spans]
        assert spans[0] == (0, 0) and spans[-1][1] == 1
        switch = spans[-1][0]
        assert switch == k  # every token after the pause is the new version's
        # The new version's own continuation of prompt + stored tokens (greedy).
        prompt = tuple(PROMPTS[key[0]]) + tuple(before.token_ids)
        left = LONG["max_new_tokens"] - k
        ref = direct_outputs(ckpt2, [prompt], replace(REF, max_new_tokens=left), False)
        assert tuple(s.token_ids[k:]) == ref[(0, 0)][: len(s.token_ids) - k], key


def test_a_deadline_ends_the_stream_with_fewer_groups_and_parks_the_rest(sqlite_daemon, ckpt):
    # 1000 tokens a sample without speculative decoding: seconds, far past the deadline.
    params = sampling(n=2, temperature=0.0, max_new_tokens=1000)
    with sqlite_daemon.client() as c:
        c.create_job(str(ckpt), job_id="job")
        started = time.monotonic()
        got = list(
            c.generate(
                "job", PROMPTS, sampling=params, request_id="d1",
                speculative=common_pb2.SPECULATIVE_MODE_OFF,
                bound=bound(5, park=True, deadline_ms=300), timeout=300,
            )
        )  # fmt: skip
        took = time.monotonic() - started
    states = unit_states(sqlite_daemon.store, "d1")
    assert len(groups_of(got)) < 5 and "parked" in states.values(), states
    assert took < 30  # ended at the deadline, not when every prompt was done


@pytest.mark.parametrize(
    ("b", "field"),
    [(bound(0, park=True), "bound.park"), (bound(0, deadline_ms=100), "bound.deadline_ms"),
     (bound(0, max_tokens=10), "bound.max_tokens")],
)
def test_park_and_deadline_need_a_bound(sqlite_daemon, ckpt, b, field):
    with sqlite_daemon.client() as c:
        c.create_job(str(ckpt), job_id="job")
        with pytest.raises(InvalidArgumentError) as err:
            list(c.generate("job", PROMPTS, sampling=sampling(**LONG), bound=b))
    assert field in str(err.value)


def test_a_token_budget_pauses_long_samples_and_later_steps_go_on(sqlite_daemon, ckpt):
    """Kimi-style partial rollouts: each step a sample emits at most 150 tokens; the long ones
    pause, park, and go on in the next carried requests until done, each group sent once and
    token-identical to an uninterrupted run."""
    d, run = sqlite_daemon, dict(sampling=sampling(**BUDGETED), timeout=300)
    sent: dict[tuple[str, int], list] = {}
    with d.client() as c:
        c.create_job(str(ckpt), job_id="b")
        first = list(c.generate("b", PROMPTS, request_id="t0", bound=bound(5, max_tokens=150),
                                **run))  # fmt: skip
        sent.update(groups_of(first))
        paused = paused_samples(d.store, "t0")
        states = unit_states(d.store, "t0")
        for step in range(1, 4):
            step_bound = bound(6, carried=True, max_tokens=150)
            later = list(
                c.generate("b", [MORE[step % 2]], request_id=f"t{step}", bound=step_bound, **run)
            )
            assert not set(groups_of(later)) & set(sent)  # never twice
            sent.update(groups_of(later))
    # Prompt 0 stops after ~34 tokens: its group is the first step's only one; the others
    # paused at exactly 150 tokens and parked.
    assert set(groups_of(first)) == {("t0", 0)}
    assert states == {0: "done", 1: "parked", 2: "parked", 3: "parked", 4: "parked"}
    assert paused and set(paused.values()) == {150}
    # Prompt 1 ends at ~160 tokens (second step); the rest reach 400 in the third.
    assert {k for k in sent if k[0] == "t0"} == {("t0", p) for p in range(5)}
    ref = direct_outputs(ckpt, PROMPTS, replace(REF, max_new_tokens=400))
    for (rid, p), samples in sent.items():
        if rid == "t0":
            assert all(tuple(s.token_ids) == ref[(p, s.sample_index)] for s in samples), p
