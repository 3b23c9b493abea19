"""The drafter training lease on PostgreSQL, between several nodes' stores: one holder under
concurrent claims, a lapsed lease fenced at publish, a takeover that knows the last published
version and the cursor, samples of every node read through the cursor."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from tests.store.expiry import expire_drafter_lease
from tests.store.test_store_api import JOB, SAMPLING
from tltd.domain import DrafterStatus, DrafterVersion, FinishReason, RolloutRequest, Sample
from tltd.errors import Fenced
from tltd.store import Store

LONG = 120.0


def _node(store: Store, node_id: str) -> Store:
    other = Store(store.url, node_id=node_id)
    other.nodes.join(f"{node_id}:1", down_seconds=30.0)
    return other


def _version(path: str, steps: int) -> DrafterVersion:
    return DrafterVersion(JOB.job_id, 0, 0, path, train_steps=steps, acceptance_length=1.5)


def test_one_node_holds_the_lease_under_concurrent_claims(pg_store: Store) -> None:
    pg_store.jobs.create(JOB)
    nodes = [_node(pg_store, f"n{i}") for i in range(6)]
    try:
        for _ in range(5):
            got: dict[str, object] = {}
            barrier = threading.Barrier(len(nodes))

            def claim(n: Store, got=got, barrier=barrier) -> None:
                barrier.wait()
                got[n.node_id] = n.drafter_leases.claim(JOB.job_id, LONG)

            threads = [threading.Thread(target=claim, args=(n,)) for n in nodes]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            holders = [k for k, v in got.items() if v is not None]
            assert len(got) == len(nodes)
            assert len(holders) == 1, got
            owner, epoch, alive = pg_store.drafter_leases.owner(JOB.job_id)  # type: ignore[misc]
            assert (owner, alive) == (holders[0], True)
            assert epoch == got[holders[0]].lease_epoch  # type: ignore[union-attr]
            # The holder lets it go: the next round is a fresh race.
            holder = next(n for n in nodes if n.node_id == holders[0])
            assert holder.drafter_leases.release(JOB.job_id, epoch)
    finally:
        for n in nodes:
            n.close()


def test_a_lapsed_lease_cannot_publish_and_a_takeover_continues(pg_store: Store) -> None:
    pg_store.jobs.create(JOB)
    a, b = _node(pg_store, "a"), _node(pg_store, "b")
    try:
        la = a.drafter_leases.claim(JOB.job_id, LONG)
        assert la is not None and la.taken_from == "" and la.published_version == 0
        assert b.drafter_leases.claim(JOB.job_id, LONG) is None  # held by a
        v1 = a.drafter_leases.publish(
            _version("/d/a1", 50), la.lease_epoch, DrafterStatus.PROMOTED, ""
        )
        assert (v1.version, v1.node_id, v1.status) == (1, "a", DrafterStatus.PROMOTED)
        assert expire_drafter_lease(pg_store, JOB.job_id) == 1  # a's lease lapses
        # Nobody took it yet, and still a cannot publish, renew or move the cursor.
        with pytest.raises(Fenced):
            a.drafter_leases.publish(
                _version("/d/a2", 100), la.lease_epoch, DrafterStatus.PROMOTED, ""
            )
        assert not a.drafter_leases.renew(JOB.job_id, la.lease_epoch, LONG)
        lb = b.drafter_leases.claim(JOB.job_id, LONG)
        assert lb is not None
        assert lb.taken_from == "a" and lb.lease_epoch > la.lease_epoch
        assert lb.published_version == 1  # b continues from a's last published version
        assert a.drafter_leases.claim(JOB.job_id, LONG) is None  # b holds it now
        with pytest.raises(Fenced):
            a.drafter_leases.publish(
                _version("/d/a2", 100), la.lease_epoch, DrafterStatus.PROMOTED, ""
            )
        v2 = b.drafter_leases.publish(
            _version("/d/b2", 100), lb.lease_epoch, DrafterStatus.REJECTED, ""
        )
        assert (v2.version, v2.node_id) == (2, "b")
        assert [(v.version, v.node_id) for v in pg_store.drafters.list(JOB.job_id)] == [
            (1, "a"),
            (2, "b"),
        ]
        # Released by b: a takes it at once, and learns b published last.
        assert b.drafter_leases.release(JOB.job_id, lb.lease_epoch)
        la2 = a.drafter_leases.claim(JOB.job_id, LONG)
        assert la2 is not None and la2.taken_from == "b" and la2.published_version == 2
        # A renewal keeps the epoch; a publish under the old lease of a stays fenced.
        again = a.drafter_leases.claim(JOB.job_id, LONG)
        assert again is not None and again.lease_epoch == la2.lease_epoch
        assert again.taken_from == ""
        with pytest.raises(Fenced):
            a.drafter_leases.publish(
                _version("/d/a3", 150), la.lease_epoch, DrafterStatus.PROMOTED, ""
            )
    finally:
        a.close()
        b.close()


def test_a_restarted_node_takes_its_own_lease_back(pg_store: Store) -> None:
    pg_store.jobs.create(JOB)
    a = _node(pg_store, "a")
    first = a.drafter_leases.claim(JOB.job_id, LONG)
    a.close()
    again = _node(pg_store, "a")  # the same node id, a new epoch: the old process is gone
    try:
        lease = again.drafter_leases.claim(JOB.job_id, LONG)
        assert first is not None and lease is not None
        assert lease.lease_epoch > first.lease_epoch and lease.taken_from == ""
    finally:
        again.close()


def test_the_cursor_reads_samples_from_every_node(pg_store: Store) -> None:
    pg_store.jobs.create(JOB)
    for i in range(2):
        prompts = ((1, 2, 3 + i), (4, 5, 6 + i))
        pg_store.requests.create(RolloutRequest(f"r{i}", JOB.job_id, prompts, SAMPLING))
    a, b, c = _node(pg_store, "a"), _node(pg_store, "b"), _node(pg_store, "c")
    try:
        # a runs the units of r0, b those of r1 (each node's own samples).
        claims = {n.node_id: n.leases.claim_units(capacity=4, lease_seconds=LONG) for n in (a, b)}
        written = {}
        for n in (a, b):
            for cl in claims[n.node_id]:
                for s in range(SAMPLING.n):
                    tokens = (100 + cl.prompt_index, 200 + s, ord(n.node_id))
                    n.samples.add(
                        Sample(cl.request_id, cl.prompt_index, s, tokens, (-0.1,) * 3,
                               FinishReason.STOP)
                    )  # fmt: skip
                    written[(cl.request_id, cl.prompt_index, s)] = n.node_id
        assert set(written.values()) == {"a", "b"}
        # c trains the drafter: it reads both nodes' samples after its cursor.
        lease = c.drafter_leases.claim(JOB.job_id, LONG)
        assert lease is not None and lease.cursor == 0
        assert c.drafter_leases.backlog([JOB.job_id]) == {JOB.job_id: len(written)}
        read = c.drafter_leases.finished_samples(JOB.job_id, lease.cursor, 1000)
        assert len(read) == len(written)
        assert {chr(f.token_ids[-1]) for f in read} == {"a", "b"}
        first_prompt = {f.prompt for f in read}
        assert (1, 2, 3) in first_prompt and (4, 5, 7) in first_prompt
        # Read, not yet published: the backlog counts them, except for the node that read them.
        assert c.drafter_leases.backlog([JOB.job_id]) == {JOB.job_id: len(written)}
        assert c.drafter_leases.backlog([JOB.job_id], {JOB.job_id: read[-1].sample_id}) == {}
        # A publish moves the cursor to the last sample its drafter was trained on.
        c.drafter_leases.publish(
            _version("/d/c1", 3), lease.lease_epoch, DrafterStatus.PROMOTED, "", read[-1].sample_id
        )
        assert c.drafter_leases.backlog([JOB.job_id]) == {}
        assert c.drafter_leases.finished_samples(JOB.job_id, read[-1].sample_id, 1000) == []
        # A new sample on a, a partial one on b (not trained on): only a's is read next.
        pg_store.requests.create(RolloutRequest("r2", JOB.job_id, ((9, 9, 9),), SAMPLING))
        [unit] = a.leases.claim_units(capacity=4, lease_seconds=LONG)
        a.samples.add(Sample("r2", 0, 0, (7, 7, 7), (-0.1,) * 3, FinishReason.LENGTH))
        a.samples.add(Sample("r2", 0, 1, (8,), (-0.1,), FinishReason.CANCELLED, partial=True))
        assert c.drafter_leases.backlog([JOB.job_id]) == {JOB.job_id: 1}
        [new] = c.drafter_leases.finished_samples(JOB.job_id, read[-1].sample_id, 1000)
        assert new.token_ids == (7, 7, 7) and new.prompt == (9, 9, 9)
        assert unit.request_id == "r2"
        # The cursor belongs to the lease: another node that takes it over starts there.
        c.drafter_leases.release(JOB.job_id, lease.lease_epoch)
        taken = a.drafter_leases.claim(JOB.job_id, LONG)
        assert taken is not None and taken.taken_from == "c"
        assert taken.cursor == read[-1].sample_id
    finally:
        for n in (a, b, c):
            n.close()


def test_a_restart_rejects_only_its_own_candidates(pg_store: Store, tmp_path) -> None:
    """A node's start rejects the candidates a crash left behind: its own, not one another
    node is evaluating now."""
    pg_store.jobs.create(JOB)
    a, b = _node(pg_store, "a"), _node(pg_store, "b")
    try:
        mine = a.drafters.add(replace(_version(str(tmp_path / "a1"), 3), node_id="a"))
        theirs = b.drafters.add(replace(_version(str(tmp_path / "b1"), 3), node_id="b"))
        assert [v.version for v in a.drafters.reject_candidates("restart")] == [mine.version]
        assert a.drafters.get(JOB.job_id, mine.version).status is DrafterStatus.REJECTED
        assert a.drafters.get(JOB.job_id, theirs.version).status is DrafterStatus.CANDIDATE
    finally:
        a.close()
        b.close()


def test_drafter_gc_retires_on_one_node_and_each_node_deletes_its_own(
    pg_store: Store, tmp_path
) -> None:
    """Retiring runs under the cluster lock (a node that finds it held retires nothing);
    each node deletes the directories of retired versions on its own storage, whichever node
    retired them, and never another node's."""
    from tltd.periodic import gc_drafters

    pg_store.jobs.create(JOB)
    a, b = _node(pg_store, "a"), _node(pg_store, "b")
    roots = {"a": tmp_path / "a" / "drafters", "b": tmp_path / "b" / "drafters"}
    try:
        for i, owner in enumerate(["a", "b", "a", "b", "a"], 1):
            path = roots[owner] / JOB.job_id / f"v{i}"
            path.mkdir(parents=True)
            store = a if owner == "a" else b
            v = store.drafters.add(replace(_version(str(path), i), node_id=owner))
            store.drafters.set_status(JOB.job_id, v.version, DrafterStatus.PROMOTED, "better")
        with a.nodes.cluster_lock("drafter-gc") as held:  # node a retiring: node b skips that part
            assert held
            assert gc_drafters(b, 1, roots["b"]) == []
        assert {v.status for v in b.drafters.list(JOB.job_id)} == {DrafterStatus.PROMOTED}
        # Node a retires v1..v4 and deletes its own v1, v3; node b's v2, v4 stay for b.
        assert gc_drafters(a, 1, roots["a"]) == [(JOB.job_id, v) for v in (1, 2, 3, 4)]
        on_disk = sorted(p.name for r in roots.values() for p in (r / JOB.job_id).iterdir())
        assert on_disk == ["v2", "v4", "v5"]
        assert gc_drafters(b, 1, roots["b"]) == []  # nothing left to retire; b deletes its own
        assert sorted(p.name for p in (roots["b"] / JOB.job_id).iterdir()) == []
        assert sorted(p.name for p in (roots["a"] / JOB.job_id).iterdir()) == ["v5"]
    finally:
        a.close()
        b.close()
