"""RolloutClient / AsyncRolloutClient generate against a real daemon with real rollout worker
processes: complete and lossless results as plain values, streaming, retries, policy versions,
and the metrics the supervisor records for every sample."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from clients import AsyncRolloutClient, RolloutClient, by_prompt
from tests.api.support import make_settings
from tests.rollout.support import InProcessDaemon, direct_outputs, make_checkpoint
from tltd.domain import SamplingParams
from tltd.metrics import METRICS
from tltd.store import Store
from tltd.store.migrate import upgrade

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


@pytest.fixture
def daemon(sqlite_url, tmp_path) -> Iterator[InProcessDaemon]:
    upgrade(sqlite_url)
    store = Store(sqlite_url)
    settings = make_settings(
        tmp_path,
        cpu_slots=2,
        worker_max_batch=16,
        worker_max_seq_len=128,
        worker_heartbeat_seconds=0.2,
        shutdown_grace_seconds=10.0,
        device_refresh_seconds=3600.0,
    )
    d = InProcessDaemon(settings, store).start()
    try:
        yield d
    finally:
        d.kill()
        store.close()


@pytest.fixture
def ckpt(tmp_path):
    return make_checkpoint(tmp_path / "policy")


def engine_steps() -> float:
    """Engine decode steps the supervisor has counted from worker heartbeats, all devices."""
    return sum(
        s.value
        for family in METRICS.registry.collect()
        for s in family.samples
        if s.name == "tltd_engine_decode_steps_total"
    )


def test_generate_round_trip(daemon, ckpt, tmp_path):
    greedy = SamplingParams(n=2, temperature=0.0, max_new_tokens=10)
    steps_before = engine_steps()
    expected = direct_outputs(ckpt, PROMPTS, greedy)
    tokens_before = METRICS.registry.get_sample_value(
        "tltd_rollout_tokens_total", {"job_id": "rc-job"}
    )
    with RolloutClient(daemon.target) as client:
        client.create_job(ckpt, job_id="rc-job")
        samples = client.generate(PROMPTS, sampling=greedy, request_id="rc-1")
        # All samples, in (prompt, sample) order, as plain values.
        assert [(s.prompt_index, s.sample_index) for s in samples] == [
            (p, i) for p in range(3) for i in range(2)
        ]
        assert {(s.prompt_index, s.sample_index): tuple(s.token_ids) for s in samples} == expected
        for s in samples:
            assert isinstance(s.token_ids, list) and len(s.logprobs) == len(s.token_ids)
            assert s.finish_reason in ("stop", "length") and s.policy_version == 0
            assert s.request_id == "rc-1" and not s.partial
        # A retry with the same request id attaches to the finished work: same samples.
        assert client.generate(PROMPTS, sampling=greedy, request_id="rc-1") == samples
        # Streaming yields every sample once; keywords override the params object.
        streamed = list(client.stream(PROMPTS[:1], sampling=greedy, n=3, speculative="off"))
        assert sorted((s.prompt_index, s.sample_index) for s in streamed) == [
            (0, 0),
            (0, 1),
            (0, 2),
        ]
        assert all(s.draft_steps == 0 for s in streamed)
        assert [len(g) for g in by_prompt(samples)] == [2, 2, 2]

        # A new policy: later samples carry its version.
        new = make_checkpoint(tmp_path / "policy-2", seed=7)
        assert client.update_policy(new) == 1
        after = client.generate(PROMPTS[:1], n=1, temperature=0.0, max_new_tokens=10)
        assert after[0].policy_version == 1
        assert tuple(after[0].token_ids) == direct_outputs(new, PROMPTS[:1], greedy)[(0, 0)]

    # The supervisor counted every sample it served (retries attach, they do not recount).
    tokens = METRICS.registry.get_sample_value("tltd_rollout_tokens_total", {"job_id": "rc-job"})
    served = sum(len(s.token_ids) for s in samples + streamed + after)
    assert tokens - (tokens_before or 0) == served
    # Heartbeats carry the engines' counters: the steps that produced them show up too.
    deadline = time.monotonic() + 10
    while engine_steps() - steps_before < 10 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine_steps() - steps_before >= 10  # at least max_new_tokens steps were decoded


def test_async_generate_and_stream(daemon, ckpt):
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=11)

    async def scenario():
        async with AsyncRolloutClient(daemon.target) as client:
            await client.create_job(ckpt, job_id="async-job")
            got = await client.generate(PROMPTS, sampling=sampling, request_id="a-1")
            streamed = [s async for s in client.stream(PROMPTS, sampling=sampling,
                                                       request_id="a-1")]  # fmt: skip
            return got, streamed

    got, streamed = asyncio.run(scenario())
    assert len(got) == 6 and sorted(streamed, key=lambda s: (s.prompt_index, s.sample_index)) == got
    assert all(len(s.logprobs) == len(s.token_ids) > 0 for s in got)
