"""Bounded requests (asynchronous RL) on two nodes of one PostgreSQL: a node killed while it
runs a bounded request's prompts; the other takes them over (going on from the running
samples' checkpoints and the paused samples' tokens), and every group is sent once."""

from __future__ import annotations

import os
import signal
import threading

from tests.multinode.conftest import Cluster, long_only
from tests.multinode.test_multinode import _duplicates
from tests.rollout.support import direct_outputs, wait_until
from tests.rollout.test_bounded_crash import alter_a_checkpoint, check_resumed
from tltd.domain import SamplingParams
from tltd.v1 import common_pb2, rollout_pb2

PROMPTS = [[5, 9, 3, 12], [6, 10, 4, 12], [7, 11, 5, 12], [8, 12, 6, 12]]
LATER = [[9, 13, 7, 12]]
PARAMS = dict(n=2, temperature=0.0, max_new_tokens=900)
OFF = common_pb2.SPECULATIVE_MODE_OFF  # a token a step: samples run a few seconds
LONG_SEQ = dict(worker_max_seq_len=1024)


def _groups(samples) -> dict[tuple[str, int], tuple]:
    out: dict[tuple[str, int], list] = {}
    for s in samples:
        out.setdefault((s.request_id, s.prompt_index), []).append(s)
    return {k: tuple(sorted(tuple(s.token_ids) for s in v)) for k, v in out.items()}


@long_only
def test_a_killed_nodes_bounded_prompts_are_taken_over_and_sent_once(cluster: Cluster, ckpt):
    a = cluster.start("node-a", **LONG_SEQ)
    b = cluster.start("node-b", sample_checkpoint_seconds=0.2, **LONG_SEQ)
    with a.client() as c:
        c.create_job(str(ckpt), job_id="bounded")
    for d in (a, b):
        d.wait_workers_ready("bounded", n=1, timeout=240)
    sampling = rollout_pb2.SamplingParams(**PARAMS)
    got: dict[str, list] = {"r1": [], "r2": []}

    def stream(rid: str, prompts, bound) -> None:
        with a.client() as ca:
            got[rid].extend(ca.generate("bounded", prompts, sampling=sampling, request_id=rid,
                                        bound=bound, speculative=OFF))  # fmt: skip

    t = threading.Thread(target=stream, args=("r1", PROMPTS, rollout_pb2.StepBound(groups=1)))
    t.start()
    held = "SELECT prompt_index FROM work_units WHERE owner_node = 'node-b' AND state = 'leased'"
    saved = (
        "SELECT count(*) FROM sample_checkpoints c JOIN work_units w ON c.request_id = "
        "w.request_id AND c.prompt_index = w.prompt_index WHERE w.owner_node = 'node-b' "
        "AND w.state = 'leased'"
    )
    wait_until(lambda: cluster.sql(saved)[0][0] > 0, timeout=240, what="node-b checkpoints r1")
    os.killpg(b.proc.pid, signal.SIGKILL)
    # Before node-a can take them (their leases run a few seconds more): what was stored is
    # made to differ from what the policy samples, so that going on from it shows.
    altered = alter_a_checkpoint(cluster.db_url, "r1", [p for (p,) in cluster.sql(held)])
    t.join(300)
    assert not t.is_alive()
    done = "SELECT count(*) FROM work_units WHERE request_id = 'r1' AND state = 'done'"
    wait_until(lambda: cluster.sql(done) == [(4,)], timeout=300, what="r1 done on node-a")
    stream("r2", LATER, rollout_pb2.StepBound(groups=4, carried=True))
    g1, g2 = _groups(got["r1"]), _groups(got["r2"])
    assert len(g1) == 1 and not set(g1) & set(g2)
    assert set(g1) | set(g2) == {("r1", p) for p in range(4)} | {("r2", 0)}
    assert _duplicates(cluster) == 0
    sent = cluster.sql("SELECT request_id, prompt_index, delivered_to FROM work_units")
    assert sorted(sent) == sorted([(r, p, "r1") for r, p in g1] + [(r, p, "r2") for r, p in g2])
    check_resumed(ckpt, got["r1"] + got["r2"], altered, PROMPTS, PARAMS)
    ref = direct_outputs(ckpt, PROMPTS, SamplingParams(**PARAMS))
    for s in got["r1"] + got["r2"]:
        if s.request_id == "r1" and s.prompt_index != altered.prompt_index:
            # Greedy: what node-a ran or went on from is what node-b would have produced.
            assert tuple(s.token_ids) == ref[(s.prompt_index, s.sample_index)]


# Token 16 ends prompt 0 after ~34 tokens (greedy, the tiny checkpoint); the others run on.
PARK_PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]
PARKING = dict(n=2, temperature=0.0, max_new_tokens=200, stop_token_ids=[16])


@long_only
def test_paused_samples_of_a_killed_node_go_on_from_their_tokens_on_the_other(
    cluster: Cluster, ckpt
):
    """Node a parks a request at its bound (paused samples stored), then dies (kill -9);
    node b's carried request goes on from a's stored tokens: each group once, the paused
    tokens kept, greedy output as an uninterrupted run's."""
    a = cluster.start("node-a")
    with a.client() as c:
        c.create_job(str(ckpt), job_id="park")
    a.wait_workers_ready("park", n=1, timeout=240)
    sampling = rollout_pb2.SamplingParams(**PARKING)
    with a.client() as ca:
        park = rollout_pb2.StepBound(groups=1, park=True)
        first = list(ca.generate("park", PARK_PROMPTS, sampling=sampling, request_id="p1",
                                 speculative=OFF, bound=park))  # fmt: skip
        paused = {(s.prompt_index, s.sample_index): tuple(s.token_ids)
                  for s in ca.get_request("p1", True).samples if s.partial}  # fmt: skip
    b = cluster.start("node-b")
    b.wait_workers_ready("park", n=1, timeout=240)
    os.killpg(a.proc.pid, signal.SIGKILL)
    with b.client() as cb:
        later = list(cb.generate("park", LATER, sampling=sampling, request_id="p2",
                                 speculative=OFF,
                                 bound=rollout_pb2.StepBound(groups=4, carried=True)))  # fmt: skip
    g1, g2 = _groups(first), _groups(later)
    # Tokens were stored when a parked (a sample not started by then has none: it runs anew).
    assert any(paused.values())
    assert set(g1) == {("p1", 0)}
    assert set(g2) == {("p1", p) for p in range(1, 4)} | {("p2", 0)}  # lost 0, dup 0
    assert _duplicates(cluster) == 0
    greedy = SamplingParams(**{**PARKING, "stop_token_ids": (16,)})
    ref = direct_outputs(ckpt, PARK_PROMPTS, greedy, speculative=False)
    for s in later:
        key = (s.prompt_index, s.sample_index)
        if s.request_id == "p1":
            assert tuple(s.token_ids) == ref[key]
            if key in paused:  # went on from what node a stored
                assert tuple(s.token_ids[: len(paused[key])]) == paused[key]
