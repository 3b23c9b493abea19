"""Several daemons on one PostgreSQL: a batch spread over nodes, a killed node's work taken
over, a paused node fenced, a restart touching only its own rows, calls on one node acting on
work that runs on another."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

from tests.multinode.conftest import Cluster, long_only
from tests.rollout.support import wait_until
from tltd.domain import FinishReason
from tltd.v1 import rollout_pb2
from tltd_clients import Backoff, RolloutClient

NODES = ("node-a", "node-b", "node-c")
FAST = Backoff(initial=0.05, maximum=0.5)


def _greedy(max_new_tokens: int) -> rollout_pb2.SamplingParams:
    return rollout_pb2.SamplingParams(n=2, temperature=0.0, max_new_tokens=max_new_tokens)


def _prompt(i: int, p: int) -> list[int]:
    return [5 + (i % 7), 9 + p, 3 + (i * 3 + p) % 11, 12]


def _run_batch(
    targets: list[str], job: str, requests: int, prompts: int, max_new_tokens: int, tag: str
) -> dict[str, list]:
    """Every request at once through ONE client that knows every target (each call starts on
    the next one, round-robin, and fails over to the others); returns the samples each
    stream yielded, in arrival order, by request id."""
    out: dict[str, list] = {}
    errors: list[BaseException] = []

    with RolloutClient(targets, job_id=job, backoff=FAST) as client:

        def one(i: int) -> None:
            rid = f"{tag}-{i:03d}"
            try:
                out[rid] = list(
                    client.stream(
                        [_prompt(i, p) for p in range(prompts)], request_id=rid, n=2,
                        temperature=0.0, max_new_tokens=max_new_tokens,
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
def test_a_killed_node_s_work_is_taken_over(cluster: Cluster, ckpt, capsys, caplog) -> None:
    nodes = [cluster.start(n) for n in NODES]
    with nodes[0].client() as c:
        c.create_job(str(ckpt), job_id="kill")
    for d in nodes:
        d.wait_workers_ready("kill", n=1, timeout=240)
    # Streams that sit on the node about to die, submitted first (the oldest units: node-c
    # claims some of them): a client per request that tries node-c first, then the others.
    on_c = [f"kc-{i}" for i in range(4)]
    order = [nodes[2].target, nodes[0].target, nodes[1].target]
    # Long samples (near the workers' 256-position limit): node-c must still hold one of these
    # units when the test freezes it, and greedy drafts make short ones end within a poll.
    calls = {rid: partial(_stream_into, target=order, job="kill", rid=rid, max_new_tokens=240)
             for rid in on_c}  # fmt: skip
    caplog.set_level(logging.WARNING, logger="tltd_clients.failover")
    out_c, threads_c, errors_c = _in_threads(calls)
    wait_until(
        lambda: cluster.sql("SELECT count(*) FROM rollout_requests WHERE request_id LIKE 'kc-%'")
        == [(len(on_c),)],
        timeout=240, what="the streams on node-c attached",
    )  # fmt: skip
    result: dict = {}
    # And streams through the nodes that stay; the work spreads over all three.
    runner = threading.Thread(
        target=lambda: result.update(
            out=_run_batch([nodes[0].target, nodes[1].target], "kill", 12, 2, 96, "k")
        )
    )
    runner.start()
    leased_on_c = (
        "SELECT request_id, prompt_index FROM work_units "
        "WHERE owner_node = 'node-c' AND state = 'leased'"
    )
    open_kc = (
        "SELECT count(*) FROM rollout_requests "
        "WHERE request_id LIKE 'kc-%' AND status IN ('queued', 'running')"
    )
    while True:
        wait_until(
            lambda: any(r[0].startswith("kc-") for r in cluster.sql(leased_on_c))
            or cluster.sql(open_kc) == [(0,)],
            timeout=240, what="node-c holds a unit of a request streamed through it",
        )  # fmt: skip
        assert cluster.sql(open_kc) != [(0,)], "node-c ended every kc- request before it was frozen"
        # Frozen first, so that what it holds is what it held when it died.
        os.killpg(nodes[2].proc.pid, signal.SIGSTOP)
        held = {(r[0], r[1]) for r in cluster.sql(leased_on_c)}
        # Their streams cannot have ended: node-c held a unit of each.
        open_on_c = sorted({rid for rid, _ in held if rid.startswith("kc-")})
        if open_on_c:
            break
        os.killpg(nodes[2].proc.pid, signal.SIGCONT)  # it had just finished it: again
    received_on_c = {rid: len(got) for rid, got in out_c.items()}
    os.killpg(nodes[2].proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()

    def taken() -> bool:
        rows = cluster.sql("SELECT request_id, prompt_index, owner_node, state FROM work_units")
        return all(r[2] != "node-c" or r[3] == "done" for r in rows if (r[0], r[1]) in held)

    wait_until(taken, timeout=120, what="node-c's units claimed by other nodes")
    takeover = time.monotonic() - killed_at
    runner.join(600)
    for t in threads_c:
        t.join(600)
    assert not errors_c, errors_c
    out = result["out"] | out_c
    assert all(len(s) == 4 for s in out.values())
    assert all(len({(x.prompt_index, x.sample_index) for x in s}) == 4 for s in out.values())
    assert _duplicates(cluster) == 0
    assert cluster.sql("SELECT DISTINCT status FROM rollout_requests") == [("completed",)]
    # The streams on node-c failed over with their request id and re-attached to the same
    # request (one row each, created once), receiving each sample once (above).
    moved = [r.getMessage() for r in caplog.records if r.name == "tltd_clients.failover"]
    still_open = [rid for rid, n in received_on_c.items() if n < 4]  # open_on_c among them
    for rid in still_open:
        assert any(f"request {rid} failed on {nodes[2].target}" in m for m in moved), moved
    assert cluster.sql(
        "SELECT count(*), min(samples_done), max(samples_done) FROM rollout_requests "
        "WHERE request_id LIKE 'kc-%'"
    ) == [(len(on_c), 4, 4)]
    attempts = cluster.sql("SELECT max(attempts) FROM work_units")[0][0]
    with capsys.disabled():
        print(
            f"\nkill -9: units held by the killed node {len(held)}, takeover "
            f"{takeover:.1f}s (lease 3s, claim interval 0.3s), requests {len(out)}, "
            f"duplicates 0, lost 0, max attempts {attempts}, "
            f"units per node {dict(_units_per_node(cluster, 'k'))}; streams on the killed "
            f"node re-attached: {still_open} (node-c held a unit of {open_on_c}), samples "
            f"each had before the kill: {received_on_c}"
        )


@long_only
def test_a_paused_node_is_fenced_and_rejoins_with_a_new_epoch(cluster: Cluster, ckpt) -> None:
    # node-b's workers were paused with it: their silence is not held against them.
    nodes = [cluster.start(NODES[0]), cluster.start(NODES[1], worker_heartbeat_timeout_seconds=3)]
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
    workers = "SELECT worker_id, pid FROM workers WHERE node_id = 'node-b' ORDER BY 1"
    pids = cluster.sql(workers)
    os.killpg(nodes[1].proc.pid, signal.SIGSTOP)
    paused = time.monotonic()
    try:
        runner.join(600)  # node-a takes everything over meanwhile
        time.sleep(max(0.0, paused + 5.0 - time.monotonic()))  # past the heartbeat timeout
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
    assert cluster.sql(workers) == pids  # none killed as silent, none restarted
    assert not cluster.sql(
        "SELECT entity_id FROM events WHERE entity = 'worker' AND reason LIKE '%no heartbeat%'"
    )


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
    # Room for a request long enough to be seen running (~2 s) on a loaded machine.
    a, b = (cluster.start(n, worker_max_seq_len=1024) for n in ("node-a", "node-b"))
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
        sampling = rollout_pb2.SamplingParams(n=2, temperature=1.0, max_new_tokens=1000, seed=3)
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
            timeout=120, what=lambda: f"node-b runs it: {cluster.units_and_logs()}",
        )  # fmt: skip
        ca.cancel_request("long", "cancelled through node-a")
        t.join(60)
        assert not t.is_alive()
        assert cb.get_request("long").request.status == rollout_pb2.REQUEST_STATUS_CANCELLED
        assert len(got) == 2
        ca.update_policy("remote", str(ckpt2))
        [s0, _] = list(cb.generate("remote", [[5, 6, 7]], sampling=_greedy(8), request_id="new"))
        assert s0.policy_version == 1


def _stream_into(
    got: list, target: str | list[str], job: str, rid: str, max_new_tokens: int, **kw
) -> None:
    """Append every sample one stream of request `rid` (2 prompts, n=2, greedy) yields to
    `got` as it arrives."""
    i = int(rid.rsplit("-", 1)[1])
    with RolloutClient(target, job_id=job, timeout=300, backoff=FAST) as c:
        for s in c.stream([_prompt(i, p) for p in range(2)], request_id=rid, n=2,
                          temperature=0.0, max_new_tokens=max_new_tokens, **kw):  # fmt: skip
            got.append(s)


def _in_threads(
    calls: dict[str, Callable[[list], None]], errors: list[BaseException] | None = None
) -> tuple[dict, list, list]:
    """Run each call (name -> call(list it appends to)) in a thread; returns the lists by
    name, the threads and the errors raised (appended to `errors` when given)."""
    out: dict[str, list] = {name: [] for name in calls}
    errors = [] if errors is None else errors

    def run(name: str) -> None:
        try:
            calls[name](out[name])
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in calls]
    for t in threads:
        t.start()
    return out, threads, errors


def _check_partial_then_complete(got: list, prompts: int) -> list:
    """A stream that asked for partial samples: each sample complete once, at most one
    partial (ABORTED) before it, whose tokens begin the complete one's (greedy, one seed).
    Returns the partial samples."""
    complete = {(s.prompt_index, s.sample_index): s for s in got if not s.partial}
    partial = [s for s in got if s.partial]
    assert len(complete) == prompts * 2 == len(got) - len(partial), got
    assert len({(s.prompt_index, s.sample_index) for s in partial}) == len(partial)
    for s in partial:
        full = complete[(s.prompt_index, s.sample_index)]
        assert s.finish_reason == FinishReason.ABORTED
        assert got.index(s) < got.index(full)
        assert list(full.token_ids[: len(s.token_ids)]) == list(s.token_ids)
    return partial


@long_only
def test_a_drained_node_hands_its_work_to_the_others(cluster: Cluster, ckpt) -> None:
    """SIGTERM on a node that runs work: its worker returns the running samples partial (the
    tokens so far), the node hands every unit to the other node and nothing fails. Streams
    that asked for partial samples receive them (on the drained node, or on the other after
    re-attaching there; and on the other node) and then the complete samples, which the other
    node's worker resumes from the stored tokens; streams that did not ask receive each
    complete sample once."""
    # Samples of 1000 tokens: far from done when node-b's worker is held (below).
    a = cluster.start("node-a", worker_max_seq_len=1100)
    # Grace 4 s: 3 s of work, then 1 s for the worker to return what runs.
    b = cluster.start("node-b", worker_max_seq_len=1100, shutdown_grace_seconds=4)
    with a.client() as c:
        c.create_job(str(ckpt), job_id="handover")
    a.wait_workers_ready("handover", n=1, timeout=240)
    b.wait_workers_ready("handover", n=1, timeout=240)
    # node-a runs nothing until node-b is gone: node-b holds the work, and its partial
    # samples stay stored (not replaced) until the streams have read them.
    with a.client() as ca:
        assert ca.cordon("node-a/cpu:0", "held until node-b is drained").cordoned
    rids = [f"h-{i}" for i in range(3)]
    calls: dict[str, Callable[[list], None]] = {}
    for rid in rids:
        for where, target in (("on-b", [b.target, a.target]), ("on-a", a.target)):
            calls[f"{where}/{rid}"] = partial(
                _stream_into, target=target, job="handover", rid=rid, max_new_tokens=1000,
                return_partial=True,
            )  # fmt: skip
        calls[f"plain/{rid}"] = partial(_stream_into, target=a.target, job="handover", rid=rid,
                                        max_new_tokens=1000)  # fmt: skip
    # The requests are created on node-b first: node-a, all cordoned, refuses a new request
    # whenever node-b's heartbeat looks late to it (a loaded machine), and attaches to a
    # stored one.
    on_b = {n: c for n, c in calls.items() if n.startswith("on-b/")}
    out, threads, errors = _in_threads(on_b)
    wait_until(
        lambda: errors or cluster.sql("SELECT count(*) FROM rollout_requests") == [(len(rids),)],
        timeout=60, what="the requests stored via node-b",
    )  # fmt: skip
    assert not errors, errors
    more, more_threads, _ = _in_threads(
        {n: c for n, c in calls.items() if n not in on_b}, errors=errors
    )
    out |= more
    threads += more_threads
    with b.client() as cb:  # its worker runs the units (not only claimed)
        wait_until(
            lambda: any(w.state == "busy" for w in cb.list_workers()), timeout=240, what="busy"
        )
        [worker] = [w for w in cb.list_workers() if w.kind == "rollout"]
    # A few tokens into its samples: only the length of the partial samples depends on this
    # wait (node-b holds more work than its worker runs at once: it never runs out).
    time.sleep(0.1)
    # The worker is held while node-b's grace runs out, so that its samples are still running
    # when it is asked to return them; it answers once released.
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        b.proc.send_signal(signal.SIGTERM)
        wait_until(
            lambda: any("before the hand-over" in r.get("msg", "") for r in b.logs()),
            timeout=30, what="node-b asks its worker for what runs",
        )  # fmt: skip
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    assert b.wait(60) == 0
    stored = {
        (r[0], r[1], r[2])
        for r in cluster.sql(
            "SELECT request_id, prompt_index, sample_index FROM samples WHERE partial"
        )
    }
    assert stored  # node-b's running samples, stored partial before the hand-over

    def received(where: str) -> set:
        return {
            (n.split("/")[1], x.prompt_index, x.sample_index)
            for n, got in out.items()
            if n.startswith(where)
            for x in list(got)
            if x.partial
        }

    for where in ("on-a/", "on-b/"):
        wait_until(lambda: errors or received(where) == stored, timeout=60, what=where)  # noqa: B023
        assert not errors, errors
    with a.client() as ca:
        ca.uncordon("node-a/cpu:0")
    for t in threads:
        t.join(600)
    assert not errors, errors
    for rid in rids:
        assert [s.partial for s in out[f"plain/{rid}"]] == [False] * 4
        assert len({(s.prompt_index, s.sample_index) for s in out[f"plain/{rid}"]}) == 4
        for where in ("on-a", "on-b"):
            _check_partial_then_complete(out[f"{where}/{rid}"], 2)
    tokens = sorted(
        len(s.token_ids) for n, ss in out.items() if n.startswith("on-a/") for s in ss if s.partial
    )
    assert any(tokens), tokens  # tokens so far, not only empty partial samples
    assert cluster.sql("SELECT DISTINCT status FROM rollout_requests") == [("completed",)]
    assert cluster.sql("SELECT count(*) FROM samples WHERE partial") == [(0,)]
    assert _duplicates(cluster) == 0
    assert cluster.sql("SELECT count(*) FROM rollout_requests") == [(len(rids),)]
    assert any("handed to the other nodes" in r.get("msg", "") for r in b.logs())
    assert any("resumed from their stored tokens" in r.get("msg", "") for r in a.logs())
    print(f"\nhand-over: partial samples {len(stored)}, their tokens so far {tokens}")


@long_only
def test_a_node_no_longer_alone_gives_back_what_it_has_not_started(cluster: Cluster, ckpt) -> None:
    """node-a, alone, claims every unit of a batch; its worker is held (SIGSTOP) with the
    first units. Once node-b is up, node-a gives back the units it has not started and
    node-b runs them; node-a finishes the ones it started once its worker is released. A
    unit given back is not a lost attempt."""
    # A held worker must not be taken for hung meanwhile.
    a = cluster.start("node-a", worker_heartbeat_timeout_seconds=300)
    with a.client() as ca:
        ca.create_job(str(ckpt), job_id="late")
        [worker] = a.wait_workers_ready("late", n=1, timeout=240)
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        result: dict = {}
        runner = threading.Thread(
            target=lambda: result.update(out=_run_batch([a.target], "late", 4, 2, 24, "late"))
        )
        runner.start()
        held_by = (
            "SELECT owner_node, count(*) FROM work_units WHERE request_id LIKE 'late-%' "
            "AND state = 'leased' GROUP BY 1"
        )
        wait_until(lambda: cluster.sql(held_by) == [("node-a", 8)], timeout=120, what="a alone")
        b = cluster.start("node-b")
        # The 2 units node-a's worker took (4 samples, its batch) stay; b runs the other 6.
        done_by_b = (
            "SELECT count(*) FROM work_units WHERE request_id LIKE 'late-%' "
            "AND owner_node = 'node-b' AND state = 'done'"
        )
        wait_until(lambda: cluster.sql(done_by_b) == [(6,)], timeout=240, what="b runs 6")
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    runner.join(600)
    assert all(len(s) == 4 and not any(x.partial for x in s) for s in result["out"].values())
    assert cluster.sql("SELECT DISTINCT status FROM rollout_requests") == [("completed",)]
    assert _units_per_node(cluster, "late") == Counter({"node-a": 2, "node-b": 6})
    assert cluster.sql("SELECT max(attempts) FROM work_units") == [(1,)]
    assert any("another node has room" in r.get("msg", "") for r in a.logs())
    assert _duplicates(cluster) == 0
    b.kill()


@long_only
def test_weights_pushed_to_one_node_are_served_by_another(cluster: Cluster, ckpt, ckpt2) -> None:
    """With `shared_dir`, a version pushed over gRPC to node-a is written where node-b's
    workers load it: node-b serves it, with ckpt2's greedy tokens."""
    shared = cluster.tmp_path / "shared"
    a = cluster.start("node-a", shared_dir=shared)
    b = cluster.start("node-b", shared_dir=shared)
    with a.client() as ca, b.client() as cb:
        assert ca.cordon("node-a/cpu:0", "only node-b serves").cordoned
        ca.create_job(str(ckpt), job_id="pushed")
        got = ca.push_policy("pushed", ckpt2 / "model.safetensors", note="through node-a")
        assert got.policy.version == 1
        assert Path(got.policy.path).is_relative_to(shared / "policies")
        prompts = [[5, 6, 7], [9, 4, 12, 3]]
        new = list(cb.generate("pushed", prompts, sampling=_greedy(16), request_id="on-v1"))
        cb.create_job(str(ckpt2), job_id="reference")
        ref = list(cb.generate("reference", prompts, sampling=_greedy(16), request_id="ref"))
    owners = cluster.sql("SELECT DISTINCT owner_node FROM work_units WHERE request_id = 'on-v1'")
    assert owners == [("node-b",)]
    assert {s.policy_version for s in new} == {1}

    def by_key(samples):
        return {(s.prompt_index, s.sample_index): tuple(s.token_ids) for s in samples}

    assert by_key(new) == by_key(ref) and len(new) == 4
