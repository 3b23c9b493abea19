"""Bounded requests (asynchronous RL) through a real daemon and real workers: whole groups, each
sent once, the rest carried to a later request, stale groups never sent."""

from __future__ import annotations

import pytest

from tests.api.support import sampling
from tests.rollout.support import direct_outputs, wait_until
from tltd.domain import SamplingParams
from tltd.metrics import METRICS
from tltd.store.tables import WorkUnitRow
from tltd.v1 import rollout_pb2
from tltd_clients.errors import InvalidArgumentError

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12], [3, 1, 4, 1, 5]]
MORE = [[2, 7, 1], [8, 2, 8, 1]]
PARAMS = dict(n=2, temperature=0.0, max_new_tokens=12)


def _groups(samples) -> dict[tuple[str, int], list]:
    out: dict[tuple[str, int], list] = {}
    for s in samples:
        out.setdefault((s.request_id, s.prompt_index), []).append(s)
    return out


def _bound(groups: int, carried: bool = False) -> rollout_pb2.StepBound:
    return rollout_pb2.StepBound(groups=groups, carried=carried)


def _units_done(store, request_id: str) -> bool:
    with store._tx(write=False) as s:
        states = [u.state for u in s.query(WorkUnitRow).filter_by(request_id=request_id)]
    return bool(states) and all(st == "done" for st in states)


def test_groups_are_sent_whole_once_and_the_rest_carried(daemon, ckpt):
    run = dict(sampling=sampling(**PARAMS), timeout=120)
    with daemon.client() as c:
        c.create_job(str(ckpt), job_id="job")
        first = list(c.generate("job", PROMPTS, request_id="r1", bound=_bound(2), **run))
        again = list(c.generate("job", PROMPTS, request_id="r1", bound=_bound(2), **run))
        wait_until(lambda: _units_done(daemon.store, "r1"), what="r1's other prompts done")
        second = list(
            c.generate("job", MORE, request_id="r2", bound=_bound(5, carried=True), **run)
        )
        third = list(c.generate("job", [[5, 5]], request_id="r3", bound=_bound(1, True), **run))
    g1, g2 = _groups(first), _groups(second)
    # Whole groups: every sample of each, and exactly the bound.
    assert len(g1) == 2 and all(len(v) == PARAMS["n"] for v in g1.values())
    assert sorted((s.request_id, s.prompt_index, s.sample_index) for s in again) == sorted(
        (s.request_id, s.prompt_index, s.sample_index) for s in first
    )
    # The carried groups (r1's other three) come first, then r2's own two; none twice.
    assert len(g2) == 5 and all(len(v) == PARAMS["n"] for v in g2.values())
    assert [k[0] for k in g2] == ["r1"] * 3 + ["r2"] * 2
    assert set(g1) | set(g2) == {("r1", p) for p in range(5)} | {("r2", 0), ("r2", 1)}
    assert not set(g1) & set(g2)
    # A carried sample names its prompt; the stream's own do not need to.
    for (rid, p), samples in g2.items():
        want = tuple(PROMPTS[p]) if rid == "r1" else ()
        assert all(tuple(s.prompt_token_ids) == want for s in samples)
    # Nothing was left to carry to r3: it sends its own group only.
    assert set(_groups(third)) == {("r3", 0)}
    # Lossless: the tokens are the engine's own.
    ref = direct_outputs(ckpt, PROMPTS, SamplingParams(**PARAMS))
    for (rid, p), samples in {**g1, **g2}.items():
        if rid == "r1":
            assert all(tuple(s.token_ids) == ref[(p, s.sample_index)] for s in samples)


def test_a_group_older_than_the_staleness_bound_is_never_sent(sqlite_daemon, ckpt, ckpt2):
    d, run = sqlite_daemon, dict(sampling=sampling(**PARAMS), timeout=120)
    before = METRICS.stale_groups.labels("stale")._value.get()
    with d.client() as c:
        c.create_job(str(ckpt), job_id="stale", max_staleness=0)
        got = list(c.generate("stale", PROMPTS, request_id="s1", bound=_bound(1), **run))
        wait_until(lambda: _units_done(d.store, "s1"), what="s1's other prompts done")
        c.update_policy("stale", str(ckpt2))  # s1's leftovers are now one version old
        # One prompt: the staleness bound's admission rule, (0 + 1 + 1) x 3 >= 5 + 1, admits it.
        later = list(
            c.generate("stale", MORE[:1], request_id="s2", bound=_bound(3, carried=True), **run)
        )
    assert len(_groups(got)) == 1
    # Only s2's own group: s1's four leftovers were too stale, and none arrives later.
    assert set(_groups(later)) == {("s2", 0)}
    assert all(s.policy_version == 1 for s in later)
    assert METRICS.stale_groups.labels("stale")._value.get() - before == 4
    with d.store._tx(write=False) as s:
        dropped = s.query(WorkUnitRow).filter_by(request_id="s1", delivered_to="").count()
    assert dropped == 4


@pytest.mark.parametrize(
    ("bound", "field"),
    [(_bound(0, carried=True), "bound.carried"), (_bound(6), "bound.groups")],
)
def test_a_bound_that_cannot_be_met_names_its_field(sqlite_daemon, ckpt, bound, field):
    with sqlite_daemon.client() as c:
        c.create_job(str(ckpt), job_id="job")
        with pytest.raises(InvalidArgumentError) as err:
            list(c.generate("job", PROMPTS, sampling=sampling(**PARAMS), bound=bound))
    assert field in str(err.value)


def test_streams_in_flight_together_share_the_jobs_groups_each_once(sqlite_daemon, ckpt):
    """Two bounded requests in flight (an asynchronous trainer's lookahead): each call gets
    exactly its bound in whole groups, whichever request they answer, and no group twice."""
    from concurrent.futures import ThreadPoolExecutor

    from tltd_clients import RolloutClient, by_prompt

    with RolloutClient(sqlite_daemon.target) as rc:
        rc.create_job(ckpt, job_id="pool", speculative="off")
        run = dict(n=2, temperature=1.0, max_new_tokens=24, bound_groups=3, carried=True)
        with ThreadPoolExecutor(2) as pool:
            calls = [
                pool.submit(rc.generate, prompts, request_id=rid, seed=7, **run)
                for rid, prompts in (("a", PROMPTS[:3]), ("b", PROMPTS[2:5]))
            ]
            got = [by_prompt(c.result(timeout=120)) for c in calls]
    keys = [{(g[0].request_id, g[0].prompt_index) for g in groups} for groups in got]
    assert [len(groups) for groups in got] == [3, 3]
    assert all(len(g) == 2 for groups in got for g in groups)
    assert not keys[0] & keys[1]
    assert keys[0] | keys[1] == {(r, p) for r in "ab" for p in range(3)}


def test_the_staleness_bound_admits_a_request_once_a_new_version_allows_it(
    sqlite_daemon, ckpt, ckpt2
):
    """AReaL's rule with eta = 0: bounded prompts accepted <= (0 + version + 1) x B (3 + 3 > 3
    at version 0). The second step's request waits, not stored, until the first step's update
    is pushed (3 + 3 <= 6)."""
    import threading

    from tltd_clients.errors import NotFoundError

    d, run = sqlite_daemon, dict(sampling=sampling(**PARAMS), timeout=120)
    with d.client() as c:
        c.create_job(str(ckpt), job_id="eta0", max_staleness=0)
        first = list(c.generate("eta0", PROMPTS[:3], request_id="e1", bound=_bound(3), **run))
        got: list = []
        t = threading.Thread(target=lambda: got.extend(
            c.generate("eta0", PROMPTS[2:], request_id="e2", bound=_bound(3, True), **run)
        ))  # fmt: skip
        t.start()
        t.join(1.5)  # (it must still wait: nothing admits it before the push)
        with pytest.raises(NotFoundError):
            c.get_request("e2")
        c.update_policy("eta0", str(ckpt2))
        t.join(60)
    assert not t.is_alive()
    assert len(_groups(first)) == 3 and set(_groups(got)) == {("e2", p) for p in range(3)}
    assert all(s.policy_version == 1 for s in got)


@pytest.mark.parametrize(
    ("so_far", "new", "b", "version", "eta", "allowed"),
    [
        (0, 64, 16, 0, 0, True),  # the first request
        (16, 16, 16, 0, 0, False),  # eta 0: one step's prompts per version
        (16, 16, 16, 1, 0, True),
        (32, 16, 16, 0, 2, True),  # eta 2: two steps ahead
        (48, 16, 16, 0, 2, False),
        (48, 16, 16, 0, None, True),  # no bound
    ],
)
def test_staleness_admission_rule(so_far, new, b, version, eta, allowed):
    from tltd.services.bounded import staleness_allows

    assert staleness_allows(so_far, new, b, version, eta) is allowed
