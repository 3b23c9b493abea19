"""The control plane's own cost is observable: admission latency and per-sample store time."""

from __future__ import annotations

from tests.api.support import sampling
from tltd.metrics import METRICS


def _count(name: str) -> float:
    for family in METRICS.registry.collect():
        for s in family.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"no {name}")


def test_a_rollout_observes_its_admission_and_each_sample_store(sqlite_daemon, ckpt) -> None:
    d = sqlite_daemon
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        admitted = _count("tltd_admission_latency_seconds_count")
        stored = _count("tltd_sample_store_latency_seconds_count")
        batched = _count("tltd_sample_store_batch_size_sum")
        got = list(c.generate("job", [[1, 2, 3], [4, 5]], sampling=sampling(n=3, max_new_tokens=4)))
    assert len(got) == 6
    assert _count("tltd_admission_latency_seconds_count") == admitted + 1
    assert _count("tltd_sample_store_latency_seconds_count") == stored + 6
    assert _count("tltd_sample_store_batch_size_sum") == batched + 6
    assert _count("tltd_admission_latency_seconds_sum") > 0
