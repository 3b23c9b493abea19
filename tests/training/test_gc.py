"""The periodic drafter GC: keeps the newest N, every pinned and the active version."""

from __future__ import annotations

import asyncio

from tltd.domain import DrafterStatus, DrafterVersion, Job
from tltd.drafter_training import DrafterTraining
from tltd.periodic import build_scheduler, gc_drafters


def _version(store, job_id: str, path, status: DrafterStatus) -> int:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x")
    dv = store.drafters.add(DrafterVersion(job_id, 0, policy_version=0, path=str(path)))
    store.drafters.set_status(job_id, dv.version, status, "evaluated")
    return dv.version


def test_gc_keeps_newest_pinned_and_active(sqlite_store, tmp_path):
    store, root = sqlite_store, tmp_path / "drafters"
    store.jobs.create(Job("job", str(tmp_path / "policy")))
    P, R = DrafterStatus.PROMOTED, DrafterStatus.REJECTED
    statuses = [P, R, P, R, R, P, R]  # v1..v7; v6 is the newest promoted = active
    for i, st in enumerate(statuses, 1):
        _version(store, "job", root / "job" / f"v{i}", st)
    store.drafters.pin("job", 1)  # pinned: kept, and it is the active one now
    outside = tmp_path / "elsewhere" / "v8"  # registered by hand outside the daemon's dir
    _version(store, "job", outside, R)
    store.drafters.add(DrafterVersion("job", 0, policy_version=0, path=str(root / "c")))

    retired = gc_drafters(store, 3, root)

    assert sorted(v for _, v in retired) == [2, 3, 4, 5]
    by_version = {v.version: v for v in store.drafters.list("job")}
    for v in (2, 3, 4, 5):
        assert by_version[v].status is DrafterStatus.RETIRED
        assert not (root / "job" / f"v{v}").exists()
    assert by_version[1].pinned and by_version[1].active and (root / "job" / "v1").is_dir()
    for v in (6, 7):  # newest three evaluated: 6, 7, 8
        assert by_version[v].status is statuses[v - 1] and (root / "job" / f"v{v}").is_dir()
    assert by_version[8].status is R and outside.is_dir()
    assert by_version[9].status is DrafterStatus.CANDIDATE  # being evaluated: left alone
    assert gc_drafters(store, 3, root) == []  # idempotent

    # After an unpin the old pinned version is collected too (v6 is active again).
    store.drafters.pin("job", 0)
    assert gc_drafters(store, 3, root) == [("job", 1)]
    assert not (root / "job" / "v1").exists()


def test_gc_is_a_declared_periodic_job(sqlite_store, tmp_path):
    from tests.training.conftest import training_settings

    settings = training_settings(tmp_path, drafter_gc_seconds=60.0)
    training = DrafterTraining(sqlite_store, settings)
    scheduler = build_scheduler(settings, sqlite_store, None, None, training)

    async def started_job():
        scheduler.start(paused=True)  # the job defaults apply as a scheduler starts
        try:
            return scheduler.get_job("drafter-gc")
        finally:
            scheduler.shutdown(wait=False)

    gc = asyncio.run(started_job())
    assert gc.func is gc_drafters and gc.args == (sqlite_store, 5, training.root)
    assert gc.trigger.interval.total_seconds() == 60.0
    assert (gc.max_instances, gc.coalesce) == (1, True)
    assert "drafter-gc" not in {
        j.id for j in build_scheduler(settings, sqlite_store, None).get_jobs()
    }


def _old_versions(store, tmp_path, root):
    """A job with v1..v4 promoted (v4 active); with keep=1, v1..v3 are candidates."""
    store.jobs.create(Job("job", str(tmp_path / "policy")))
    for i in range(1, 5):
        _version(store, "job", root / "job" / f"v{i}", DrafterStatus.PROMOTED)


def test_retire_skips_a_version_pinned_after_the_candidates_were_read(store, tmp_path):
    _old_versions(store, tmp_path, tmp_path / "drafters")
    candidates = [v.version for v in store.drafters.list("job") if not v.active]
    assert candidates == [1, 2, 3]
    store.drafters.pin("job", 2)  # lands between the read and the retire

    retired = store.drafters.retire("job", candidates, "garbage-collected")

    assert [v.version for v in retired] == [1, 3]
    assert all(v.status is DrafterStatus.RETIRED for v in retired)
    by_version = {v.version: v for v in store.drafters.list("job")}
    assert by_version[2].pinned and by_version[2].active
    assert by_version[2].status is DrafterStatus.PROMOTED
    # v4 is no longer active (the pin is): asked for, it is retired; a retired version, a
    # candidate being evaluated and an unknown version are not.
    store.drafters.add(DrafterVersion("job", 0, policy_version=0, path="/c"))
    assert [v.version for v in store.drafters.retire("job", [1, 4, 5, 99], "gc")] == [4]


def test_gc_keeps_the_checkpoint_of_a_version_pinned_during_the_gc(store, tmp_path):
    root = tmp_path / "drafters"
    _old_versions(store, tmp_path, root)
    real = store.drafters.list

    def read_then_pin(job_id):
        versions = real(job_id)
        store.drafters.pin(job_id, 1)  # an operator pins v1 right after the GC read the pins
        return versions

    store.drafters.list = read_then_pin
    retired = gc_drafters(store, 1, root)
    store.drafters.list = real

    assert retired == [("job", 2), ("job", 3)]
    v1 = store.drafters.get("job", 1)
    assert v1.pinned and v1.active and v1.status is DrafterStatus.PROMOTED
    assert (root / "job" / "v1" / "model.safetensors").is_file()
    assert not (root / "job" / "v2").exists() and not (root / "job" / "v3").exists()


def test_a_candidate_left_by_a_crash_is_rejected_at_start_then_collected(sqlite_store, tmp_path):
    """A kill -9 between recording a drafter version and judging it: the next daemon start
    rejects the candidate (it can no longer be pinned), and GC collects it."""
    from tests.api.support import make_settings
    from tests.rollout.support import InProcessDaemon

    store, root = sqlite_store, tmp_path / "drafters"
    store.jobs.create(Job("job", str(tmp_path / "policy")))
    _version(store, "job", root / "job" / "v1", DrafterStatus.PROMOTED)
    (root / "job" / "v2").mkdir()
    store.drafters.add(DrafterVersion("job", 0, policy_version=0, path=str(root / "job" / "v2")))
    _version(store, "job", root / "job" / "v3", DrafterStatus.PROMOTED)
    settings = make_settings(tmp_path, cpu_slots=0, drafter_training=False)
    InProcessDaemon(settings, store).start().kill()
    assert store.drafters.get("job", 2).status is DrafterStatus.REJECTED
    assert sorted(gc_drafters(store, 1, root)) == [("job", 1), ("job", 2)]
    assert not (root / "job" / "v2").exists()
