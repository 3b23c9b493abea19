"""A session across the loss of the node running its turn (two real `tltd serve` nodes on one
PostgreSQL): the trainer retries the turn on the other node, which takes the turn's unit over
when the dead node's lease runs out; every turn ran once (lost 0, duplicated 0), with its
mask and versions true."""

from __future__ import annotations

import os
import signal
import threading

from tests.api.support import sampling
from tests.multinode.conftest import Cluster, long_only
from tests.rollout.support import wait_until
from tests.rollout.test_session_crash import ENV, PROMPT, SHORT, _expected

# Long enough that the turn is seen running on a loaded machine (~0.5 s alone), in the room
# SEQ gives a node.
LONG = dict(temperature=0.0, max_new_tokens=900)
SEQ = dict(worker_max_seq_len=1024)


def _kill_during_turn_2(cluster: Cluster, a) -> str:
    """Turns 0 and 1 done through node a; turn 2 running when the node running it (either)
    is killed. Returns that node's id."""
    with a.client() as c:
        c.open_session("job", PROMPT, session_id="s")
        c.turn("s", 0, sampling=sampling(**SHORT))
        c.turn("s", 1, ENV[0], sampling=sampling(**SHORT))
        errors: list[Exception] = []

        def third() -> None:
            try:
                c.turn("s", 2, ENV[1], sampling=sampling(**LONG))
            except Exception as exc:  # noqa: BLE001 - node a may die under it
                errors.append(exc)

        t = threading.Thread(target=third)
        t.start()
        held = (
            "SELECT owner_node FROM work_units WHERE request_id = 'session:s:2:0' "
            "AND state = 'leased'"
        )
        wait_until(lambda: cluster.sql(held), timeout=120,
                   what=lambda: f"turn 2 running: {cluster.units_and_logs()}")  # fmt: skip
        node = cluster.sql(held)[0][0]
        d = cluster.nodes[node]
        os.killpg(d.proc.pid, signal.SIGKILL)
        d.wait()
        if node == "node-a":
            t.join(30)
            assert not t.is_alive() and len(errors) == 1
        return node


@long_only
def test_a_session_goes_on_on_another_node_when_its_node_is_lost(cluster: Cluster, ckpt):
    a, b = cluster.start("node-a", **SEQ), cluster.start("node-b", **SEQ)
    with a.client() as c:
        c.create_job(str(ckpt), job_id="job")
    for d in (a, b):
        d.wait_workers_ready("job", n=1, timeout=240)
    lost = _kill_during_turn_2(cluster, a)
    survivor = b if lost == "node-a" else a
    with survivor.client() as c:
        # The retry attaches to turn 2's request; node b claims its unit once a's lease ends.
        t2 = c.turn("s", 2, ENV[1], sampling=sampling(**LONG)).turn
        t3 = c.turn("s", 3, ENV[2], sampling=sampling(**SHORT)).turn
        closed = c.close_session("s")
        per_turn = [
            len(c.get_request(t.request_id, include_samples=True).samples) for t in closed.turns
        ]
    assert per_turn == [1, 1, 1, 1]  # each turn's request holds one sample: nothing twice
    assert [t.turn_index for t in closed.turns] == [0, 1, 2, 3]
    assert closed.turns[2] == t2 and closed.turns[3] == t3
    t0, t1 = closed.turns[0], closed.turns[1]
    context = PROMPT + list(t0.token_ids) + ENV[0] + list(t1.token_ids) + ENV[1]
    assert list(t2.token_ids) == _expected(ckpt, context, LONG["max_new_tokens"])
    context += list(t2.token_ids) + ENV[2]
    assert list(t3.token_ids) == _expected(ckpt, context, SHORT["max_new_tokens"])
    context += list(t3.token_ids)
    trajectory = closed.trajectory
    assert list(trajectory.token_ids) == context  # lost 0, duplicated 0
    long = LONG["max_new_tokens"]
    lengths = [(0, 4), (1, 12), (0, 3), (1, 12), (0, 2), (1, long), (0, 1), (1, 12)]
    mask = [m for m, n in lengths for _ in range(n)]
    assert list(trajectory.loss_mask) == mask
    # One policy version all along: 0 on every sampled token, -1 on the rest.
    assert list(trajectory.policy_versions) == [0 if m else -1 for m in mask]


@long_only
def test_a_sessions_turns_go_to_the_node_holding_its_kv(cluster: Cluster, ckpt):
    """Turns sent through either node run on the node that ran the session's first turn (it
    holds the KV), and reuse it there."""
    a, b = cluster.start("node-a"), cluster.start("node-b")
    with a.client() as c:
        c.create_job(str(ckpt), job_id="job")
        c.open_session("job", PROMPT, session_id="s")
    for d in (a, b):
        d.wait_workers_ready("job", n=1, timeout=240)
    with a.client() as ca, b.client() as cb:
        for i, c in enumerate((ca, cb, ca, cb)):
            c.turn("s", i, ENV[i - 1] if i else [], sampling=sampling(**SHORT))
        closed = ca.close_session("s")
    ids = ", ".join(f"'{t.request_id}'" for t in closed.turns)
    owners = cluster.sql(f"SELECT DISTINCT owner_node FROM work_units WHERE request_id IN ({ids})")
    assert len(owners) == 1, owners
    holder = cluster.nodes[owners[0][0]]
    with holder.client() as c:
        (summary,) = [s for s in c.list_sessions("job") if s.session_id == "s"]
    assert summary.reuse_hits == 3
