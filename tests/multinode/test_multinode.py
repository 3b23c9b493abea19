"""Several daemons on one PostgreSQL: a batch spread over nodes, a killed node's work taken
over, a paused node fenced, a restart touching only its own rows, calls on one node acting on
work that runs on another."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter

from tests.multinode.conftest import Cluster, long_only
from tests.rollout.support import wait_until
from tltd.v1 import rollout_pb2
from tltd_clients.client import TltClient

NODES = ("node-a", "node-b", "node-c")


def _greedy(max_new_tokens: int) -> rollout_pb2.SamplingParams:
    return rollout_pb2.SamplingParams(n=2, temperature=0.0, max_new_tokens=max_new_tokens)


def _prompt(i: int, p: int) -> list[int]:
    return [5 + (i % 7), 9 + p, 3 + (i * 3 + p) % 11, 12]


def _run_batch(
    targets: list[str], job: str, requests: int, prompts: int, max_new_tokens: int, tag: str
) -> dict[str, list]:
    """Each request through one of `targets` (round-robin), all at once; returns the samples
    each stream received, by request id."""
    out: dict[str, list] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        rid = f"{tag}-{i:03d}"
        try:
            with TltClient(targets[i % len(targets)], timeout=300) as c:
                out[rid] = list(
                    c.generate(
                        job, [_prompt(i, p) for p in range(prompts)],
                        sampling=_greedy(max_new_tokens), request_id=rid,
                    )
                )  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    return out


def _tokens(out: dict[str, list], tag: str) -> dict[tuple[str, int, int], tuple[int, ...]]:
    return {
        (rid.split("-", 1)[1], s.prompt_index, s.sample_index): tuple(s.token_ids)
        for rid, samples in out.items()
        for s in samples
        if rid.startswith(tag)
    }


def _units_per_node(cluster: Cluster, tag: str) -> Counter:
    rows = cluster.sql(
        "SELECT owner_node, count(*) FROM work_units WHERE request_id LIKE :t GROUP BY owner_node",
        t=f"{tag}-%",
    )
    return Counter({r[0]: int(r[1]) for r in rows})


def _duplicates(cluster: Cluster) -> int:
    return int(
        cluster.sql(
            "SELECT count(*) FROM (SELECT request_id, prompt_index, sample_index FROM samples "
            "GROUP BY 1, 2, 3 HAVING count(*) > 1) d"
        )[0][0]
    )


def test_three_nodes_share_a_batch_with_single_node_outputs(cluster: Cluster, ckpt) -> None:
    nodes = [cluster.start(n) for n in NODES]
    with nodes[0].client() as c:
        c.create_job(str(ckpt), job_id="spread")
    for d in nodes:
        d.wait_workers_ready("spread", n=1, timeout=240)
    requests, prompts = 9, 2
    out = _run_batch([d.target for d in nodes], "spread", requests, prompts, 24, "multi")
    assert all(len(s) == prompts * 2 for s in out.values()), {k: len(v) for k, v in out.items()}
    per_node = _units_per_node(cluster, "multi")
    assert sum(per_node.values()) == requests * prompts
    assert len(per_node) >= 2, per_node  # the batch spread over nodes
    assert _duplicates(cluster) == 0
    statuses = cluster.sql("SELECT DISTINCT status FROM rollout_requests")
    assert statuses == [("completed",)]
    # The same prompts on one node alone (the others stopped): the same greedy tokens.
    for d in nodes[1:]:
        d.kill()
    single = _run_batch([nodes[0].target], "spread", requests, prompts, 24, "single")
    assert _tokens(single, "single") == _tokens(out, "multi")
    with nodes[0].client() as c:
        listed = {n.node_id: n for n in c.list_nodes()}
    assert set(listed) == set(NODES)
    assert listed["node-a"].state == "up"
    print(f"units per node: {dict(per_node)}")


@long_only
def test_a_killed_node_s_work_is_taken_over(cluster: Cluster, ckpt, capsys) -> None:
    nodes = [cluster.start(n) for n in NODES]
    with nodes[0].client() as c:
        c.create_job(str(ckpt), job_id="kill")
    for d in nodes:
        d.wait_workers_ready("kill", n=1, timeout=240)
    result: dict = {}
    # Streams through the nodes that stay; the work spreads over all three.
    runner = threading.Thread(
        target=lambda: result.update(
            out=_run_batch([nodes[0].target, nodes[1].target], "kill", 12, 2, 96, "k")
        )
    )
    runner.start()
    wait_until(
        lambda: cluster.sql(
            "SELECT count(*) FROM work_units WHERE owner_node = 'node-c' AND state = 'leased'"
        )[0][0] > 0,
        timeout=240, what="node-c holds work",
    )  # fmt: skip
    held = {
        (r[0], r[1])
        for r in cluster.sql(
            "SELECT request_id, prompt_index FROM work_units "
            "WHERE owner_node = 'node-c' AND state = 'leased'"
        )
    }
    os.killpg(nodes[2].proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()

    def taken() -> bool:
        rows = cluster.sql(
            "SELECT request_id, prompt_index, owner_node, state FROM work_units "
            "WHERE request_id LIKE 'k-%'"
        )
        return all(r[2] != "node-c" or r[3] == "done" for r in rows if (r[0], r[1]) in held)

    wait_until(taken, timeout=120, what="node-c's units claimed by other nodes")
    takeover = time.monotonic() - killed_at
    runner.join(600)
    out = result["out"]
    assert all(len(s) == 4 for s in out.values())
    assert all(len({(x.prompt_index, x.sample_index) for x in s}) == 4 for s in out.values())
    assert _duplicates(cluster) == 0
    assert cluster.sql("SELECT DISTINCT status FROM rollout_requests") == [("completed",)]
    attempts = cluster.sql("SELECT max(attempts) FROM work_units")[0][0]
    with capsys.disabled():
        print(
            f"\nkill -9: units held by the killed node {len(held)}, takeover "
            f"{takeover:.1f}s (lease 3s, claim interval 0.3s), requests {len(out)}, "
            f"duplicates 0, lost 0, max attempts {attempts}, "
            f"units per node {dict(_units_per_node(cluster, 'k'))}"
        )


@long_only
def test_a_paused_node_is_fenced_and_rejoins_with_a_new_epoch(cluster: Cluster, ckpt) -> None:
    nodes = [cluster.start(n) for n in NODES[:2]]
    with nodes[0].client() as c:
        c.create_job(str(ckpt), job_id="pause")
    for d in nodes:
        d.wait_workers_ready("pause", n=1, timeout=240)
    result: dict = {}
    runner = threading.Thread(
        target=lambda: result.update(out=_run_batch([nodes[0].target], "pause", 8, 2, 96, "p"))
    )
    runner.start()
    wait_until(
        lambda: cluster.sql(
            "SELECT count(*) FROM work_units WHERE owner_node = 'node-b' AND state = 'leased'"
        )[0][0] > 0,
        timeout=240, what="node-b holds work",
    )  # fmt: skip
    epoch = cluster.sql("SELECT epoch FROM nodes WHERE node_id = 'node-b'")[0][0]
    os.killpg(nodes[1].proc.pid, signal.SIGSTOP)
    try:
        runner.join(600)  # node-a takes everything over meanwhile
        snapshot = cluster.sql(
            "SELECT id, request_id, prompt_index, sample_index, token_ids::text FROM samples "
            "ORDER BY id"
        )
    finally:
        os.killpg(nodes[1].proc.pid, signal.SIGCONT)
    wait_until(
        lambda: cluster.sql("SELECT epoch FROM nodes WHERE node_id = 'node-b'")[0][0] > epoch,
        timeout=60, what="node-b rejoins with a new epoch",
    )  # fmt: skip
    time.sleep(3.0)  # its late sample writes, if any, would land now
    after = cluster.sql(
        "SELECT id, request_id, prompt_index, sample_index, token_ids::text FROM samples "
        "ORDER BY id"
    )
    assert after == snapshot
    assert all(len(s) == 4 for s in result["out"].values())
    assert _duplicates(cluster) == 0


@long_only
def test_a_restart_touches_no_other_node_s_rows(cluster: Cluster, ckpt) -> None:
    a, b = cluster.start("node-a"), cluster.start("node-b")
    with a.client() as c:
        c.create_job(str(ckpt), job_id="own")
    a.wait_workers_ready("own", n=1, timeout=240)
    b.wait_workers_ready("own", n=1, timeout=240)
    query = (
        "SELECT 'device', device_id, state, cordoned::text, '' FROM devices WHERE node_id = "
        "'node-a' UNION ALL SELECT 'worker', worker_id, state, pid::text, job_id FROM workers "
        "WHERE node_id = 'node-a' ORDER BY 1, 2"
    )
    before = cluster.sql(query)
    os.killpg(b.proc.pid, signal.SIGKILL)
    b2 = cluster.start("node-b")
    b2.wait_workers_ready("own", n=1, timeout=240)
    assert cluster.sql(query) == before
    assert {r[0] for r in cluster.sql("SELECT node_id FROM devices")} == {"node-a", "node-b"}


@long_only
def test_cancel_and_update_policy_on_one_node_act_on_another(cluster: Cluster, ckpt, ckpt2) -> None:
    a, b = cluster.start("node-a"), cluster.start("node-b")
    with a.client() as ca:
        ca.create_job(str(ckpt), job_id="remote")
    a.wait_workers_ready("remote", n=1, timeout=240)
    b.wait_workers_ready("remote", n=1, timeout=240)
    with a.client() as ca, b.client() as cb:
        # Through node-b: node-a's device, named NODE/DEVICE, takes no more work.
        assert cb.cordon("node-a/cpu:0", "the work goes to node-b").cordoned
        wait_until(
            lambda: all(w.state != "busy" for w in ca.list_workers()), timeout=30, what="idle"
        )
        got: list = []
        sampling = rollout_pb2.SamplingParams(n=2, temperature=1.0, max_new_tokens=200, seed=3)
        t = threading.Thread(
            target=lambda: got.extend(
                cb.generate("remote", [[5, 6, 7]], sampling=sampling, request_id="long")
            )
        )
        t.start()
        wait_until(
            lambda: cluster.sql(
                "SELECT count(*) FROM work_units WHERE owner_node = 'node-b' AND state = 'leased'"
            )[0][0] > 0,
            timeout=120, what="node-b runs it",
        )  # fmt: skip
        ca.cancel_request("long", "cancelled through node-a")
        t.join(60)
        assert not t.is_alive()
        assert cb.get_request("long").request.status == rollout_pb2.REQUEST_STATUS_CANCELLED
        assert len(got) == 2
        ca.update_policy("remote", str(ckpt2))
        [s0, _] = list(cb.generate("remote", [[5, 6, 7]], sampling=_greedy(8), request_id="new"))
        assert s0.policy_version == 1


@long_only
def test_a_drained_node_hands_its_work_to_the_others(cluster: Cluster, ckpt) -> None:
    """SIGTERM with a short grace on a node that runs work: the other node finishes it,
    nothing fails."""
    a = cluster.start("node-a")
    b = cluster.start("node-b", shutdown_grace_seconds=0.5)
    with a.client() as c:
        c.create_job(str(ckpt), job_id="handover")
    a.wait_workers_ready("handover", n=1, timeout=240)
    b.wait_workers_ready("handover", n=1, timeout=240)
    result: dict = {}
    runner = threading.Thread(
        target=lambda: result.update(out=_run_batch([a.target], "handover", 8, 2, 240, "h"))
    )
    runner.start()
    wait_until(
        lambda: cluster.sql(
            "SELECT count(*) FROM work_units WHERE owner_node = 'node-b' AND state = 'leased'"
        )[0][0] > 0,
        timeout=240, what="node-b holds work",
    )  # fmt: skip
    with b.client() as cb:  # its worker runs the units (not only claimed)
        wait_until(
            lambda: any(w.state == "busy" for w in cb.list_workers()), timeout=60, what="busy"
        )
    b.proc.send_signal(signal.SIGTERM)
    assert b.wait(60) == 0
    runner.join(600)
    assert all(len(s) == 4 and not any(x.partial for x in s) for s in result["out"].values())
    assert cluster.sql("SELECT DISTINCT status FROM rollout_requests") == [("completed",)]
    assert _duplicates(cluster) == 0
    assert any("handed to the other nodes" in r.get("msg", "") for r in b.logs())
