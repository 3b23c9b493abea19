"""The rollout worker process on its own: real process, real pipe, real tiny model."""

from __future__ import annotations

import pytest

from tests.rollout.support import WorkerProcess, direct_outputs, make_checkpoint
from tltd.contract.rollout_messages import (
    AddWork,
    Cancel,
    Drain,
    Drained,
    EngineSpec,
    Finished,
    Freeze,
    Heartbeat,
    LoadFailed,
    LoadModel,
    Ready,
    SampleCheckpoint,
    SetDrafter,
    Shutdown,
)
from tltd.domain import FinishReason, SamplingParams
from tltd_workers.rollout.worker import contiguous_runs

PROMPTS = [(1, 2, 3), (4, 5, 6, 7), (8, 9)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "m")


@pytest.fixture
def worker():
    w = WorkerProcess()
    yield w
    w.close()


def _collect(w: WorkerProcess, count: int) -> dict:
    got = {}
    while len(got) < count:
        s = w.recv(Finished).sample
        got[(s.prompt_index, s.sample_index)] = s
    return got


def test_contiguous_runs():
    assert contiguous_runs([5, 0, 1, 2, 6]) == [(0, 3), (5, 2)]
    assert contiguous_runs([]) == []


def test_worker_matches_engine_and_splits_samples(worker, ckpt):
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=6, seed=11)
    expected = direct_outputs(ckpt, PROMPTS, sampling, speculative=False)
    assert worker.recv(Ready).job_id == ""
    worker.send(LoadModel("job", str(ckpt), 3, EngineSpec(max_batch=16, max_seq_len=128)))
    assert worker.recv(Ready).policy_version == 3
    # The samples of a prompt may be spread over sends (and workers): any slice reproduces
    # exactly what the engine makes for those indices.
    seq = 0
    for i, p in enumerate(PROMPTS):
        for chunk in ((0, 2), (1, 3)):
            seq += 1
            worker.send(AddWork(seq, "req", i, chunk, p, sampling, speculative=False))
    got = _collect(worker, 12)
    assert {k: v.token_ids for k, v in got.items()} == {k: v for k, v in expected.items()}
    assert all(s.policy_version == 3 and not s.partial for s in got.values())
    hb = worker.recv(Heartbeat, timeout=5)
    assert hb.acked_seq == seq and hb.stats["prefills"] == 12
    worker.send(Shutdown())
    worker.proc.join(10)
    assert worker.proc.exitcode == 0


def test_cancel_and_drain_return_partials(worker, ckpt):
    worker.recv(Ready)
    worker.send(LoadModel("job", str(ckpt), 0, EngineSpec(max_batch=8, max_seq_len=256)))
    worker.recv(Ready)
    long = SamplingParams(n=2, temperature=1.0, max_new_tokens=200, seed=1)
    worker.send(AddWork(1, "a", 0, (0, 1), (1, 2), long))
    worker.send(Cancel("a"))
    got = _collect(worker, 2)
    assert {s.finish_reason for s in got.values()} == {FinishReason.CANCELLED}
    assert all(s.partial for s in got.values())

    worker.send(AddWork(2, "b", 0, (0, 1, 2), (3, 4), long))
    worker.send(Drain(0.05))
    kept: list = []
    drained = worker.recv(Drained, keep=kept)
    finished = [m.sample for m in kept if isinstance(m, Finished)]
    assert drained.partial == 3 and len(finished) == 3
    assert all(s.partial and s.finish_reason is FinishReason.ABORTED for s in finished)
    assert all(len(s.token_ids) < 200 for s in finished)


def _frozen_beats(w: WorkerProcess, count: int) -> list[Heartbeat]:
    """The ack of a Freeze(True) (the first heartbeat saying frozen), then `count` more."""
    beats = [w.recv(Heartbeat, timeout=10)]
    while not beats[0].frozen:
        beats = [w.recv(Heartbeat, timeout=10)]
    return beats + [w.recv(Heartbeat, timeout=10) for _ in range(count)]


def _tokens(hb: Heartbeat) -> int:
    return hb.stats["tokens"]["total"]  # type: ignore[index]


def test_a_frozen_worker_takes_no_step_and_continues_exactly_once_thawed(ckpt):
    """Frozen mid-sample, the engine emits nothing over several heartbeats (new work is not
    even prefilled, a cancel is answered at once); thawed, its samples continue from where
    they stood: their tokens are those of a run that was never frozen."""
    worker = WorkerProcess(heartbeat_seconds=0.05)
    try:
        _freeze_and_thaw(worker, ckpt)
    finally:
        worker.close()


def _freeze_and_thaw(worker: WorkerProcess, ckpt) -> None:
    worker.recv(Ready)
    worker.send(LoadModel("job", str(ckpt), 0, EngineSpec(max_batch=8, max_seq_len=1024)))
    worker.recv(Ready)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=1000, seed=5)
    worker.send(AddWork(1, "kept", 0, (0, 1), PROMPTS[1], sampling, speculative=False))
    while _tokens(worker.recv(Heartbeat, timeout=10)) == 0:
        pass  # until it has decoded (the freeze comes mid-sample)
    worker.send(Freeze(True))
    beats = _frozen_beats(worker, 3)
    assert {_tokens(b) for b in beats} == {_tokens(beats[0])}  # no step while frozen
    assert 0 < _tokens(beats[0]) < 2 * 1000
    assert all(b.frozen and b.running_samples == 2 for b in beats)
    prefills = beats[0].stats["prefills"]

    worker.send(AddWork(2, "cut", 0, (0,), PROMPTS[2], sampling, speculative=False))
    more = [worker.recv(Heartbeat, timeout=10) for _ in range(3)]
    assert all(_tokens(b) == _tokens(beats[0]) and b.stats["prefills"] == prefills for b in more)
    assert more[-1].running_samples == 3  # queued in the engine, not started
    worker.send(Cancel("cut"))  # answered while frozen
    (cut,) = _collect(worker, 1).values()
    assert cut.finish_reason is FinishReason.CANCELLED and cut.token_ids == ()

    worker.send(Freeze(False))
    got = _collect(worker, 2)
    expected = direct_outputs(ckpt, [PROMPTS[1]], sampling, speculative=False)
    assert {k: v.token_ids for k, v in got.items()} == expected
    assert all(s.finish_reason is FinishReason.LENGTH and not s.partial for s in got.values())
    assert not worker.recv(Heartbeat, timeout=10).frozen


def test_bad_model_and_bad_work(worker, tmp_path, ckpt):
    worker.recv(Ready)
    worker.send(AddWork(1, "x", 0, (0,), (1,), SamplingParams(max_new_tokens=2)))
    s = worker.recv(Finished).sample
    assert s.finish_reason is FinishReason.FAILED and "no model" in s.error
    worker.send(LoadModel("job", str(tmp_path / "missing"), 0))
    failed = worker.recv(LoadFailed)
    assert failed.job_id == "job" and "missing" in failed.message
    worker.send(LoadModel("job", str(ckpt), 0, EngineSpec(max_batch=4, max_seq_len=16)))
    worker.recv(Ready)
    worker.send(AddWork(2, "y", 0, (0, 1), tuple(range(20)), SamplingParams(n=2, max_new_tokens=2)))
    got = _collect(worker, 2)
    assert all(
        s.finish_reason is FinishReason.FAILED and "max_seq_len" in s.error for s in got.values()
    )
    assert worker.proc.is_alive()


def test_a_drafter_that_cannot_load_is_reported_with_its_version(worker, tmp_path, ckpt):
    """The supervisor remembers (job, drafter version) as bad: the failure must name it."""
    worker.recv(Ready)
    worker.send(LoadModel("job", str(ckpt), 2, EngineSpec(max_batch=4, max_seq_len=64)))
    assert worker.recv(Ready).policy_version == 2
    worker.send(SetDrafter(str(tmp_path / "no-drafter"), 7))
    failed = worker.recv(LoadFailed)
    assert failed.drafter and failed.policy_version == 7 and failed.job_id == "job"
    ready = worker.recv(Ready)
    assert ready.policy_version == 2 and ready.drafter_version == 0


def test_samples_running_a_while_are_checkpointed_and_go_on(worker, ckpt):
    """A sample running longer than `checkpoint_seconds` is sent as a SampleCheckpoint (its
    tokens so far, ABORTED, partial), again only once it has more tokens, and keeps running
    to the engine's own end; a sample done within one interval never is."""
    long = SamplingParams(n=1, temperature=0.0, max_new_tokens=400)
    short = SamplingParams(n=1, temperature=0.0, max_new_tokens=2)
    expected = direct_outputs(ckpt, PROMPTS[:1], long, speculative=False)[(0, 0)]
    worker.recv(Ready)
    spec = EngineSpec(max_batch=8, max_seq_len=512)
    worker.send(LoadModel("job", str(ckpt), 0, spec, checkpoint_seconds=0.05))
    worker.recv(Ready)
    worker.send(AddWork(1, "long", 0, (0,), PROMPTS[0], long, speculative=False))
    worker.send(AddWork(2, "short", 1, (0,), PROMPTS[1], short, speculative=False))
    others: list = []
    done = worker.recv(Finished, keep=others)
    while done.sample.request_id != "long":
        done = worker.recv(Finished, keep=others)
    saved = [m.sample for m in others if isinstance(m, SampleCheckpoint)]
    assert saved and {s.request_id for s in saved} == {"long"}
    lengths = [len(s.token_ids) for s in saved]
    assert lengths == sorted(set(lengths))  # each one longer than the last
    final = done.sample
    assert final.token_ids == expected and not final.partial
    for s in saved:
        k = len(s.token_ids)
        assert s.finish_reason is FinishReason.ABORTED and s.partial
        assert s.token_ids == final.token_ids[:k] and s.logprobs == final.logprobs[:k]
