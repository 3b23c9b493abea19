"""The SGLang rollout worker and the real engine adapter over a fake `sglang.Engine` (the
one fake: no GPU here to run SGLang; tests/sglang_contract/ checks the adapter against the
real package).

Covers the adapter's own logic: engine arguments per speculative mode, AddWork -> one engine
request per sample (seeds, stop ids), engine outputs -> Samples (logprobs, finish reasons,
speculative counters, weight versions), cancel -> abort (also before SGLang registered the
request), LoadPolicy as a target-only update, SetDrafter as a draft-only update in place (an
engine restart that carries running samples over only when the speculative algorithm
changes), drain -> partials, SIGTERM ignored, GPU memory released while idle, heartbeats; one
test runs the real worker process over a real pipe.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import shutil
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.drafter.helpers import load_target, make_target_dir
from tests.rollout import fake_sglang
from tests.rollout.fake_sglang import FakeEngine, reference
from tltd.contract.broadcast import assign_ranks, group_prefix, received_tensors
from tltd.contract.rollout_messages import (
    AddWork,
    Cancel,
    Drain,
    Drained,
    EngineSpec,
    Finished,
    Heartbeat,
    JoinBroadcast,
    LoadFailed,
    LoadModel,
    LoadPolicy,
    Ready,
    SetDrafter,
    Shutdown,
    WorkerError,
)
from tltd.domain import FinishReason, SamplingParams
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.rollout import sglang_worker
from tltd_workers.rollout.sglang_worker import SglangWorker
from tltd_workers.sglang.translate import (
    MEM_FRACTION_STATIC,
    Segment,
    adaptive_config,
    distributed_join,
    engine_args,
    finish_reason,
    gpu_index,
    read_output,
    sample_seed,
    sampling_params,
)

FACTORY = "tests.rollout.fake_sglang:factory"
GPU = EngineSpec(device="cuda:0", max_batch=8, max_seq_len=256, seed=7)


@pytest.fixture(autouse=True)
def _fresh_fake(monkeypatch):
    FakeEngine.instances.clear()
    FakeEngine.refuse_eagle = False
    FakeEngine.tokens_per_step = 3
    monkeypatch.setattr(sglang_worker, "POLL_SECONDS", 0.002)  # the fake decodes per poll
    yield
    for h in Harness.made:  # the adapter ends its SGLang tasks, then shuts its engine down
        h.worker.close()
    Harness.made.clear()
    for engine in FakeEngine.instances:  # gives SIGTERM back to the test process
        if not engine.closed:
            engine.shutdown()


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A real tiny Qwen2 checkpoint (the drafter export reads its config)."""
    return make_target_dir(tmp_path_factory.mktemp("policy") / "v0", seed=3)


@pytest.fixture(scope="module")
def drafters(policy, tmp_path_factory):
    """Two drafter versions in our checkpoint format, for that policy."""
    target = load_target(policy)
    root = tmp_path_factory.mktemp("drafters")
    paths = []
    for v in (1, 2):
        EagleDrafter.random_init(target, seed=v).save_pretrained(root / f"v{v}")
        paths.append(str(root / f"v{v}"))
    return paths


class Harness:
    """An SglangWorker driven command by command over a real Pipe, stepping it by hand."""

    made: list[Harness] = []  # closed after each test

    def __init__(self) -> None:
        self.conn, child = mp.Pipe()
        self.worker = SglangWorker(child, 3600.0, fake_sglang.factory)
        self.got: list = []
        Harness.made.append(self)

    def send(self, msg) -> list:
        self.worker._handle(msg)
        return self.messages()

    def step(self, times: int = 1) -> list:
        for _ in range(times):
            if self.worker.busy():
                self.worker._step()
        return self.messages()

    def run_idle(self, limit: int = 500) -> list:
        while self.worker.busy() and limit:
            self.worker._step()
            limit -= 1
        return self.messages()

    def messages(self) -> list:
        out = []
        while self.conn.poll():
            m = self.conn.recv()  # a list: messages sent together (a step's samples)
            out.extend(m if isinstance(m, list) else [m])
        self.got += out
        return out

    @property
    def engine(self) -> FakeEngine:
        return self.worker.engine.engine  # type: ignore[union-attr]


def finished(msgs) -> dict:
    return {
        (m.sample.prompt_index, m.sample.sample_index): m.sample
        for m in msgs
        if isinstance(m, Finished)
    }


def of(kind, msgs) -> list:
    return [m for m in msgs if isinstance(m, kind)]


def loaded(policy, spec: EngineSpec = GPU, version: int = 3) -> Harness:
    h = Harness()
    ready = of(Ready, h.send(LoadModel("job", str(policy), version, spec)))
    assert ready[-1].job_id == "job" and ready[-1].policy_version == version
    return h


# ---- engine arguments ---------------------------------------------------------------------


def test_engine_args_carry_the_model_device_and_limits():
    spec = EngineSpec(device="cuda:2", max_batch=48, max_seq_len=4096, seed=11, spec_mode="off")
    args = engine_args(spec, "/models/p")
    assert args == {
        "model_path": "/models/p",
        "weight_version": "0",
        "skip_tokenizer_init": True,
        "base_gpu_id": 2,
        "tp_size": 1,
        "random_seed": 11,
        "max_running_requests": 48,
        "context_length": 4096,
        "mem_fraction_static": MEM_FRACTION_STATIC,
        "enable_deterministic_inference": True,
        "enable_memory_saver": True,
        "enable_weights_cpu_backup": True,
        "log_level": "error",
    }
    assert engine_args(spec, "/m", policy_version=4)["weight_version"] == "4"
    assert gpu_index("cuda") == 0
    with pytest.raises(ValueError, match="CUDA devices only"):
        gpu_index("cpu")


EAGLE6 = {
    "speculative_algorithm": "EAGLE",
    "speculative_draft_model_path": "/d",
    "speculative_num_steps": 6,
    "speculative_eagle_topk": 1,
    "speculative_num_draft_tokens": 7,
}
NGRAM6 = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 7}


@pytest.mark.parametrize(
    "mode, drafter, path, expected",
    [
        ("off", "auto", "/d", {}),
        ("off", "eagle", "", {}),
        ("adaptive", "auto", "/d", EAGLE6),
        ("fixed", "eagle", "/d", EAGLE6),
        ("adaptive", "auto", "", NGRAM6),  # no learned drafter yet: model-free
        ("adaptive", "ngram", "/d", NGRAM6),  # n-gram only, whatever is learned
        ("fixed", "eagle", "", {}),  # EAGLE only, none learned yet: plain decoding
    ],
)
def test_speculative_args_per_mode(mode, drafter, path, expected):
    spec = EngineSpec(device="cuda:0", spec_mode=mode, drafter=drafter, draft_lengths=(2, 6, 4))
    args = engine_args(spec, "/m", path)
    assert {k: v for k, v in args.items() if k.startswith("speculative")} == expected
    adaptive = engine_args(spec, "/m", path, "/a.json")
    extra = {k: v for k, v in adaptive.items() if k not in args}
    if expected.get("speculative_algorithm") == "EAGLE":  # SGLang adapts EAGLE only
        assert extra == {"speculative_adaptive": True, "speculative_adaptive_config": "/a.json"}
    else:
        assert extra == {}


def test_the_gate_and_draft_lengths_as_sglangs_adaptive_config():
    spec = EngineSpec(spec_mode="adaptive", batch_threshold=24, draft_lengths=(6, 2, 4, 2))
    # Buckets by smallest batch size: SGLang picks among the draft lengths up to the job's
    # threshold, and speculates no more (0 steps) above it.
    assert adaptive_config(spec) == {
        "1": {"candidate_steps": [2, 4, 6]},
        "25": {"candidate_steps": [0]},
    }
    fixed = adaptive_config(replace(spec, spec_mode="fixed"))
    assert fixed == {"1": {"candidate_steps": [6]}, "25": {"candidate_steps": [0]}}


# ---- requests and responses ---------------------------------------------------------------


def test_sampling_params_translation():
    s = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, stop_token_ids=(9, 2, 9))
    # No ignore_eos with stop ids: SGLang skips every stop check under ignore_eos.
    assert sampling_params(s, max_new_tokens=33, seed=5) == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_new_tokens": 33,
        "stop_token_ids": [2, 9],
        "sampling_seed": 5,
    }
    p = sampling_params(replace(s, top_k=20, stop_token_ids=()), max_new_tokens=1, seed=None)
    assert p["top_k"] == 20 and "stop_token_ids" not in p and "sampling_seed" not in p
    assert p["ignore_eos"] is True  # no stop set: the model's EOS must not end it either


def test_sample_seeds_are_fixed_by_their_indices():
    seeds = {sample_seed(1, p, i) for p in range(4) for i in range(16)}
    assert len(seeds) == 64 and all(0 <= x < 2**31 - 1 for x in seeds)
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3) != sample_seed(2, 2, 3)
    assert sample_seed(1, 2, 3, segment=1) != sample_seed(1, 2, 3)


def _out(ids, lps, reason, **meta):
    triples = [(lp, t, None) for lp, t in zip(lps, ids, strict=False)]
    info = {"finish_reason": reason, "output_token_logprobs": triples} | meta
    return {"output_ids": ids, "meta_info": info}


def test_read_output_translates_tokens_logprobs_finish_and_spec_counters():
    seg = read_output(_out([5, 6, 7], [-0.1, -0.2, -0.3], {"type": "length", "length": 3}))
    assert seg == Segment((5, 6, 7), (-0.1, -0.2, -0.3), "length", plain_steps=3)
    # 9 tokens: 1 from prefill + 4 verify passes that accepted 4 drafts in all.
    eagle = _out(list(range(9)), [0.0] * 9, {"type": "stop", "matched": 8}, spec_verify_ct=4)
    eagle["meta_info"]["spec_num_correct_drafts"] = 4
    assert read_output(eagle) == Segment(tuple(range(9)), (0.0,) * 9, "stop", "", 4, 4, 1)
    del eagle["meta_info"]["spec_num_correct_drafts"]  # older SGLang / NGRAM: derived
    assert read_output(eagle).accepted == 4
    aborted = {"meta_info": {"finish_reason": {"type": "abort", "message": "Abort before prefill"}}}
    assert read_output(aborted) == Segment((), (), "abort", "Abort before prefill")
    assert read_output(_out([1], [-1.0], "stop")).finish == "stop"  # a plain string reason
    with pytest.raises(ValueError, match="do not match"):
        read_output(_out([1, 2], [-1.0], {"type": "length"}))
    with pytest.raises(ValueError, match="unknown finish_reason"):
        read_output(_out([1], [-1.0], {"type": "bogus"}))


def test_finish_reasons():
    def seg(finish, message=""):
        return Segment((), (), finish, message)

    assert finish_reason(seg("stop"), cancelled=True) == (FinishReason.STOP, "")
    assert finish_reason(seg("length"), cancelled=False) == (FinishReason.LENGTH, "")
    assert finish_reason(seg("abort"), cancelled=True) == (FinishReason.CANCELLED, "")
    reason, error = finish_reason(seg("abort", "input too long"), cancelled=False)
    assert reason is FinishReason.FAILED and "input too long" in error


# ---- the worker ---------------------------------------------------------------------------


def test_load_builds_the_engine_and_refuses_what_cannot_run(policy, tmp_path):
    h = Harness()
    msgs = h.send(LoadModel("job", str(policy), 0, replace(GPU, device="cpu")))
    assert "CUDA devices only" in of(LoadFailed, msgs)[0].message
    assert of(Ready, msgs)[-1].job_id == ""
    msgs = h.send(LoadModel("job", str(tmp_path / "missing"), 0, GPU))
    assert "config.json" in of(LoadFailed, msgs)[0].message and not h.worker.loaded()
    h = loaded(policy)
    assert h.engine.args == engine_args(GPU, str(policy), "", h.worker.adaptive_path, 3)
    assert json.loads(Path(h.worker.adaptive_path).read_text()) == adaptive_config(GPU)
    assert h.engine.args["speculative_algorithm"] == "NGRAM"  # auto, no learned drafter yet


def test_addwork_is_one_request_per_sample_with_its_own_seed(policy):
    h = loaded(policy)
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=11, stop_token_ids=(3,))
    h.send(AddWork(1, "r", 2, (0, 1), (4, 5, 6), sampling))
    h.send(AddWork(2, "r", 2, (3, 2), (4, 5, 6), sampling))  # the rest, spread over a send
    h.step()  # SGLang's generate tasks run on its loop
    subs = h.engine.submitted
    assert [s[1] for s in subs] == [[4, 5, 6]] * 4
    assert [s[2]["sampling_seed"] for s in subs] == [sample_seed(11, 2, i) for i in (0, 1, 3, 2)]
    assert all(s[2]["n"] == 1 and s[2]["stop_token_ids"] == [3] for s in subs)
    assert len({s[0] for s in subs}) == 4  # one engine request id per sample
    assert h.worker.acked_seq == 2


def test_outputs_become_samples_with_logprobs_and_finish_reasons(policy):
    h = loaded(policy, version=5)
    prompts = {0: [1, 2, 3], 1: [7, 7]}
    stop = tuple(reference(prompts[1], 40)[5:6])  # a token the second prompt emits 6th
    sampling = SamplingParams(n=1, max_new_tokens=12, seed=1, stop_token_ids=stop)
    for p, ids in prompts.items():
        h.send(AddWork(p + 1, "r", p, (0,), tuple(ids), sampling))
    got = finished(h.run_idle())
    for p, ids in prompts.items():
        s = got[(p, 0)]
        want = reference(ids, 12, stop)
        assert list(s.token_ids) == want
        ctx = [ids + want[:j] for j in range(len(want))]
        assert list(s.logprobs) == [
            fake_sglang.token_logprob(c, t) for c, t in zip(ctx, want, strict=True)
        ]
        assert s.policy_version == 5 and not s.partial and s.error == ""
        stopped = want[-1] in stop
        assert s.finish_reason is (FinishReason.STOP if stopped else FinishReason.LENGTH)
        # NGRAM answers spec_verify_ct only (the fake: 2 tokens per verify pass, the first
        # token from prefill): accepted drafts are derived.
        spec = s.speculative
        assert (spec.draft_steps, spec.accepted_tokens) == (
            len(want) // 2,
            len(want) - 1 - len(want) // 2,
        )
        assert spec.mean_accepted_length == pytest.approx(
            (spec.accepted_tokens + spec.draft_steps) / spec.draft_steps
        )
    assert got[(0, 0)].finish_reason is FinishReason.LENGTH and len(got[(0, 0)].token_ids) == 12
    assert got[(1, 0)].finish_reason is FinishReason.STOP and len(got[(1, 0)].token_ids) == 6


def test_prompt_too_long_and_refused_requests_fail(policy):
    h = loaded(policy, replace(GPU, max_seq_len=8))
    msgs = h.send(AddWork(1, "r", 0, (0, 1), tuple(range(8)), SamplingParams(max_new_tokens=4)))
    assert {(s.finish_reason, "max_seq_len" in s.error) for s in finished(msgs).values()} == {
        (FinishReason.FAILED, True)
    }
    h.send(AddWork(2, "r", 1, (0,), (1, 2), SamplingParams(top_p=0.0, max_new_tokens=4)))
    s = finished(h.run_idle())[(1, 0)]
    assert s.finish_reason is FinishReason.FAILED and "top_p must be in (0, 1]" in s.error
    h.send(AddWork(3, "q", 0, (0,), (1, 2, 3), SamplingParams(max_new_tokens=50, seed=1)))
    h.step()
    assert h.engine.submitted[-1][2]["max_new_tokens"] == 5  # capped by max_seq_len, as torch


def test_cancel_aborts_only_that_request(policy):
    h = loaded(policy)
    long = SamplingParams(n=2, max_new_tokens=200, seed=1)
    h.send(AddWork(1, "a", 0, (0, 1), (1, 2), long))
    h.send(AddWork(2, "b", 0, (0,), (3, 4), long))
    h.step(2)
    a_rids = {rid for rid, s in h.worker.running.items() if s.request_id == "a"}
    h.send(Cancel("a"))
    assert set(h.engine.aborted) == a_rids
    got = finished(h.step())
    assert len(got) == 2 and all(
        s.request_id == "a" and s.finish_reason is FinishReason.CANCELLED and s.partial
        for s in got.values()
    )
    assert all(0 < len(s.token_ids) < 200 for s in got.values())
    assert list(got[(0, 0)].token_ids) == reference([1, 2], 200)[: len(got[(0, 0)].token_ids)]
    assert [s.request_id for s in h.worker.running.values()] == ["b"]


def test_heartbeat_counts_running_samples_and_tokens_left(policy):
    h = loaded(policy)
    h.send(AddWork(4, "a", 0, (0, 1, 2), (1, 2), SamplingParams(max_new_tokens=50, seed=1)))
    h.worker._maybe_heartbeat(force=True)
    hb = of(Heartbeat, h.messages())[-1]
    assert (hb.running_samples, hb.remaining_tokens, hb.acked_seq) == (3, 150, 4)
    assert hb.idle_since is None and hb.stats["backend"] == "sglang"
    assert hb.stats["prefills"] == 3 and hb.stats["speculative"] == "NGRAM"


def test_drain_returns_partials(policy):
    h = loaded(policy)
    h.send(AddWork(1, "a", 0, (0, 1, 2), (1, 2), SamplingParams(max_new_tokens=200, seed=2)))
    h.step(3)
    assert h.worker._abort_all() == 3
    got = finished(h.messages())
    assert len(got) == 3 and all(
        s.finish_reason is FinishReason.ABORTED and s.partial and 0 < len(s.token_ids) < 200
        for s in got.values()
    )
    assert not h.worker.busy() and h.worker.loaded()


def test_stop_ids_end_samples_and_the_models_eos_alone_does_not(policy, tmp_path):
    """SGLang skips stop_token_ids under ignore_eos, and stops at the model's EOS without it:
    only the caller's stop ids end a sample, on this backend as on the torch engine."""
    prompt = [7, 7]
    free = reference(prompt, 40)
    eos, stop = free[3], free[9]  # the model's EOS comes 4th, the caller's stop id 10th
    assert eos not in free[:3] and stop not in free[:9] and eos != stop
    model = tmp_path / "with-eos"
    shutil.copytree(policy, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"eos_token_id": eos}))
    h = loaded(model)
    h.send(
        AddWork(
            1,
            "r",
            0,
            (0,),
            tuple(prompt),
            SamplingParams(max_new_tokens=40, seed=3, stop_token_ids=(stop,)),
        )
    )
    s = finished(h.run_idle())[(0, 0)]
    assert list(s.token_ids) == free[:10] and s.finish_reason is FinishReason.STOP
    assert len(s.logprobs) == 10 and not s.partial
    # It went on after SGLang stopped at the EOS: a second segment, a fresh seed.
    (_, _, first), (_, ids, second) = h.engine.submitted
    assert "ignore_eos" not in first and first["stop_token_ids"] == [stop]
    assert ids == prompt + free[:4] and second["max_new_tokens"] == 36
    assert second["sampling_seed"] == sample_seed(3, 0, 0, segment=1)
    # Without stop ids: to the length, through the model's EOS.
    h.send(AddWork(2, "r", 1, (0,), tuple(prompt), SamplingParams(max_new_tokens=12, seed=3)))
    s = finished(h.run_idle())[(1, 0)]
    assert list(s.token_ids) == free[:12] and s.finish_reason is FinishReason.LENGTH


def test_seeds_reach_sglang_in_deterministic_mode(policy):
    """SGLang reads sampling_seed only with enable_deterministic_inference."""
    h = loaded(policy)
    assert h.engine.args["enable_deterministic_inference"] is True
    h.send(AddWork(1, "r", 0, (0,), (1, 2), SamplingParams(max_new_tokens=3, seed=8)))
    h.step()
    assert h.engine.submitted[0][2]["sampling_seed"] == sample_seed(8, 0, 0)


def test_sigterm_does_not_stop_the_engine(policy):
    """SGLang's TokenizerManager puts a SIGTERM handler on its loop at its first request; its
    watchdog would shut the engine down without a drain. The daemon alone stops workers."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as in a worker process
    try:
        h = loaded(policy)
        h.send(AddWork(1, "r", 0, (0, 1), (1, 2), SamplingParams(max_new_tokens=30, seed=1)))
        h.step()
        tm = h.engine.tokenizer_manager
        assert signal.SIGTERM in h.engine.loop._signal_handlers  # SGLang's handler is on
        os.kill(os.getpid(), signal.SIGTERM)
        got = finished(h.run_idle())
        assert not tm.gracefully_exit and not h.engine.exited
        assert all(len(s.token_ids) == 30 and not s.partial for s in got.values())
        h.send(AddWork(2, "r", 1, (0,), (3,), SamplingParams(max_new_tokens=4, seed=1)))
        assert finished(h.run_idle())[(1, 0)].finish_reason is FinishReason.LENGTH
        h.worker.close()
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_cancel_before_sglang_registered_the_request_still_aborts_it(policy):
    """SGLang ignores abort_request(rid) until its generate task has registered the rid."""
    h = loaded(policy)
    h.send(AddWork(1, "a", 0, (0, 1), (1, 2), SamplingParams(max_new_tokens=10**4, seed=1)))
    h.send(Cancel("a"))  # no step in between: SGLang has not seen the requests yet
    got: dict = {}
    for _ in range(5):
        got |= finished(h.step())
    assert len(got) == 2 and {s.finish_reason for s in got.values()} == {FinishReason.CANCELLED}
    assert all(len(s.token_ids) <= 3 for s in got.values())
    # A drain right after AddWork, the same.
    h.send(AddWork(2, "b", 0, (0,), (1, 2), SamplingParams(max_new_tokens=10**4, seed=1)))
    assert h.worker._abort_all() == 1
    assert not h.worker.busy()


def test_closing_ends_the_generate_tasks_sglang_never_ran(policy):
    """A request submitted and never polled has a task whose coroutine never started: closing
    the worker runs each such task to its cancellation instead of leaving it to the garbage
    collector (a coroutine never awaited)."""
    h = loaded(policy)
    h.send(AddWork(1, "a", 0, (0, 1), (1, 2), SamplingParams(max_new_tokens=10, seed=1)))
    tasks = list(h.worker.engine.tasks)
    assert len(tasks) == 2 and not any(t.done() for t in tasks)
    h.worker.close()
    assert all(t.cancelled() for t in tasks)


def test_weight_versions_are_checked_against_the_recorded_policy(policy, tmp_path):
    h = loaded(policy, version=3)
    engine = h.engine
    h.send(AddWork(1, "r", 0, (0,), (1, 2), SamplingParams(max_new_tokens=6, seed=1)))
    assert finished(h.run_idle())[(0, 0)].policy_version == 3  # SGLang said "3"
    # Weights SGLang reports that the worker never recorded: the sample fails, named.
    engine.weight_version = "7"
    h.send(AddWork(2, "r", 1, (0,), (1, 2), SamplingParams(max_new_tokens=6, seed=1)))
    s = finished(h.run_idle())[(1, 0)]
    assert s.finish_reason is FinishReason.FAILED and "weight_version 7" in s.error
    engine.weight_version = "3"
    # Queued (no token yet) across a LoadPolicy: drawn from the new weights, labelled so.
    new = make_target_dir(tmp_path / "v4", seed=4)
    FakeEngine.tokens_per_step = 0  # SGLang has not scheduled it yet
    h.send(AddWork(3, "r", 2, (0,), (1, 2), SamplingParams(max_new_tokens=6, seed=1)))
    h.step()
    h.send(LoadPolicy(str(new), 4))
    FakeEngine.tokens_per_step = 3
    s = finished(h.run_idle())[(2, 0)]
    assert s.policy_version == 4 and s.finish_reason is FinishReason.LENGTH
    # Running across it: the version it started with, as on the torch engine.
    h.send(AddWork(4, "r", 3, (0,), (1, 2), SamplingParams(max_new_tokens=30, seed=1)))
    h.step(2)
    h.send(LoadPolicy(str(policy), 5))
    s = finished(h.run_idle())[(3, 0)]
    assert s.policy_version == 4 and s.finish_reason is FinishReason.LENGTH


def test_speculative_counters_reach_the_heartbeat_in_the_metrics_shape(policy, drafters):
    from tltd.metrics import Metrics

    h = loaded(policy)
    h.send(SetDrafter(drafters[0], 1))
    h.send(AddWork(1, "r", 0, (0, 1), (1, 2), SamplingParams(max_new_tokens=9, seed=1)))
    h.run_idle()
    h.worker._maybe_heartbeat(force=True)
    stats = of(Heartbeat, h.messages())[-1].stats
    # The fake: 9 tokens = 1 from prefill + 4 verify passes gaining 2 each.
    assert stats["steps"] == {"plain": 2, "spec": 8}
    assert stats["accepted_length_hist"] == {2: 8}
    m = Metrics()
    m.observe_engine_summary("cuda:0", None, stats)  # what the supervisor feeds them
    assert m.decode_steps.labels("cuda:0", "speculative")._value.get() == 8


def test_idle_workers_release_gpu_memory_and_take_it_back_for_work(policy, monkeypatch):
    monkeypatch.setattr(sglang_worker, "RELEASE_AFTER_SECONDS", 0.0)
    h = loaded(policy)
    assert h.engine.memory_calls == ["release"]  # loaded, nothing to do yet
    h.send(AddWork(1, "r", 0, (0,), (1, 2), SamplingParams(max_new_tokens=30, seed=1)))
    h.step()
    assert h.engine.memory_calls == ["release", "resume"] and not h.engine.released
    h.worker._maybe_heartbeat(force=True)
    assert h.engine.memory_calls == ["release", "resume"]  # never while requests run
    h.run_idle()
    h.worker._maybe_heartbeat(force=True)
    assert h.engine.memory_calls[-1] == "release" and h.engine.released
    h.send(AddWork(2, "r", 1, (0,), (1, 2), SamplingParams(max_new_tokens=3, seed=1)))
    assert h.engine.memory_calls == ["release", "resume", "release", "resume"]


def test_load_policy_is_a_target_update_in_place(policy, tmp_path):
    h = loaded(policy)
    new = make_target_dir(tmp_path / "v1", seed=4)
    engine = h.engine
    ready = of(Ready, h.send(LoadPolicy(str(new), 4)))[-1]
    assert ready.policy_version == 4 and h.engine is engine  # no restart
    assert engine.updates == [
        {"kind": "disk", "runners": ["target"], "names": [str(new)], "version": "4", "flush": True}
    ]
    h.send(AddWork(1, "r", 0, (0,), (1,), SamplingParams(max_new_tokens=3, seed=1)))
    assert finished(h.run_idle())[(0, 0)].policy_version == 4
    failed = of(LoadFailed, h.send(LoadPolicy(str(tmp_path / "nope"), 5)))
    assert failed[0].policy_version == 5 and not failed[0].drafter
    assert "no checkpoint" in failed[0].message
    assert of(Ready, h.got)[-1].policy_version == 4  # unchanged after the failure


def test_set_drafter_restarts_with_the_export_and_carries_running_samples(policy, drafters):
    h = loaded(policy)
    old = h.engine
    sampling = SamplingParams(n=2, max_new_tokens=30, seed=9)
    h.send(AddWork(1, "r", 0, (0, 1), (5, 6, 7), sampling))
    h.step(2)  # 6 tokens each so far
    # NGRAM -> EAGLE changes the speculative algorithm: a restart.
    ready = of(Ready, h.send(SetDrafter(drafters[0], 1)))[-1]
    assert ready.drafter_version == 1
    new = h.engine
    assert old.closed and new is not old and set(old.aborted) == {s[0] for s in old.submitted}
    assert old.tokenizer_manager.abort_calls == [("", True)]  # one abort_all
    draft = new.args["speculative_draft_model_path"]
    assert draft == h.worker.export_dir
    assert new.args == engine_args(GPU, str(policy), draft, h.worker.adaptive_path, 3)
    assert new.args["speculative_algorithm"] == "EAGLE" and new.args["speculative_adaptive"]
    cfg = json.loads((Path(draft) / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLMEagle"] and cfg["num_hidden_layers"] == 1
    h.step()  # the carried samples reach the new engine
    # Carried over: prompt + the tokens so far, the rest of the budget, a fresh seed.
    for rid, ids, params in new.submitted:
        s = h.worker.running[rid]
        assert ids == [5, 6, 7] + s.tokens and len(s.tokens) == 6
        assert params["max_new_tokens"] == 24
        assert params["sampling_seed"] == sample_seed(9, 0, s.sample_index, segment=1)
    got = finished(h.run_idle())
    want = reference([5, 6, 7], 30)
    for s in got.values():  # the fake continues from context: as if never interrupted
        assert list(s.token_ids) == want and len(s.logprobs) == 30
        assert s.finish_reason is FinishReason.LENGTH and not s.partial
        assert s.drafter_version == 1 and s.speculative.draft_steps > 0
        assert s.speculative.drafted_tokens > 0  # SGLang's spec_num_proposed_drafts
    assert h.worker.counters["restarts"] == 1
    # A new version replaces the export; the old one is deleted.
    h.send(SetDrafter(drafters[1], 2))
    assert h.worker.export_dir != draft and not Path(draft).exists()


def test_a_new_drafter_loads_into_the_draft_runner_alone_while_samples_run(policy, drafters):
    h = loaded(policy)
    h.send(SetDrafter(drafters[0], 1))  # NGRAM -> EAGLE: a restart
    engine = h.engine
    h.send(AddWork(1, "r", 0, (0,), (1, 2), SamplingParams(max_new_tokens=30, seed=1)))
    h.step()
    ready = of(Ready, h.send(SetDrafter(drafters[1], 2)))[-1]
    assert ready.drafter_version == 2 and h.engine is engine and not engine.aborted
    assert len(FakeEngine.instances) == 2 and h.worker.counters["restarts"] == 1
    (update,) = engine.updates
    assert update["kind"] == "tensor" and update["runners"] == ["draft"]
    assert update["version"] == "3" and update["flush"] is False  # requests run on
    assert "fc.weight" in update["names"] and "embed_tokens.weight" not in update["names"]
    assert engine.session is None  # begin_weight_update / end_weight_update around it
    assert h.worker.args["speculative_draft_model_path"] == h.worker.export_dir
    s = finished(h.run_idle())[(0, 0)]
    assert s.drafter_version == 2 and list(s.token_ids) == reference([1, 2], 30)
    # No learned drafter any more: back to the model-free drafter (a restart).
    assert of(Ready, h.send(SetDrafter("", 0)))[-1].drafter_version == 0
    assert h.engine is not engine and h.engine.args["speculative_algorithm"] == "NGRAM"


def test_a_policy_update_with_eagle_on_loads_the_target_runner_alone(policy, drafters, tmp_path):
    """A disk update would also reload SGLang's draft runner from the target checkpoint."""
    h = loaded(policy)
    h.send(SetDrafter(drafters[0], 1))
    engine = h.engine
    new = make_target_dir(tmp_path / "v4", seed=4)
    assert of(Ready, h.send(LoadPolicy(str(new), 4)))[-1].policy_version == 4
    (update,) = engine.updates
    assert update["kind"] == "tensor" and update["runners"] == ["target"]
    assert update["version"] == "4" and update["flush"] is True
    assert "model.layers.0.self_attn.q_proj.weight" in update["names"]
    assert h.engine is engine and engine.weight_version == "4"
    h.send(AddWork(1, "r", 0, (0,), (1, 2), SamplingParams(max_new_tokens=5, seed=1)))
    assert finished(h.run_idle())[(0, 0)].policy_version == 4


def test_a_drafter_that_fails_keeps_the_old_engine_and_names_its_version(
    policy, drafters, tmp_path
):
    h = loaded(policy)
    bad = tmp_path / "not-a-drafter"
    bad.mkdir()
    msgs = h.send(SetDrafter(str(bad), 7))
    failed = of(LoadFailed, msgs)[0]
    assert failed.drafter and failed.policy_version == 7  # the drafter version that failed
    assert of(Ready, msgs)[-1].drafter_version == 0 and len(FakeEngine.instances) == 1
    # An export the engine cannot start with: the old engine comes back, work goes on.
    h.send(AddWork(1, "r", 0, (0,), (1, 2), SamplingParams(max_new_tokens=30, seed=1)))
    h.step()
    FakeEngine.refuse_eagle = True
    msgs = h.send(SetDrafter(drafters[0], 1))
    assert "out of memory" in of(LoadFailed, msgs)[0].message
    assert of(Ready, msgs)[-1].drafter_version == 0
    assert h.engine.args["speculative_algorithm"] == "NGRAM" and h.worker.export_dir == ""
    s = finished(h.run_idle())[(0, 0)]
    assert list(s.token_ids) == reference([1, 2], 30) and s.finish_reason is FinishReason.LENGTH


# ---- a policy broadcast through SGLang's distributed weight update --------------------------

WEIGHTS = {"w.a": torch.randn(4, 3).to(torch.bfloat16), "w.b": torch.arange(5.0)}
SPECS = tuple(
    (n, {torch.bfloat16: "BF16", torch.float32: "F32"}[t.dtype], tuple(t.shape))
    for n, t in WEIGHTS.items()
)


class Trainer:
    """Rank 0 of a gloo group in a thread: hosts the store, broadcasts WEIGHTS."""

    def __init__(self, group: str, world: int = 2) -> None:
        import torch.distributed as dist

        wait = datetime.timedelta(seconds=30)
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=wait
        )
        self.error: BaseException | None = None

        def send() -> None:
            try:
                keys = dist.PrefixStore(group_prefix(group), self.store)
                pg = dist.ProcessGroupGloo(keys, 0, world, wait)
                opts = dist.BroadcastOptions()
                opts.rootRank = 0
                for t in WEIGHTS.values():
                    pg.broadcast([t.clone()], opts).wait()
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                self.error = exc

        self.thread = threading.Thread(target=send, daemon=True)
        self.thread.start()

    def join(self, path: str, group: str, timeout: float = 30.0, **kw) -> JoinBroadcast:
        return JoinBroadcast(path, "127.0.0.1", self.store.port, group, 1, 2, SPECS, timeout, **kw)


def step_until(h: Harness, done, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        h.worker._step()
        h.messages()
    assert done()


def test_a_broadcast_arrives_through_sglangs_distributed_update_while_samples_wait(policy):
    """A sample running at the join is started over and new ones wait while the engine
    receives; the version the daemon then records only names the weights, and every sample
    runs on it from its first token."""
    h = loaded(policy, version=3)
    engine = h.engine
    long = SamplingParams(max_new_tokens=40, seed=1)
    h.send(AddWork(1, "r", 0, (0, 1), (1, 2), long))
    h.step(2)
    trainer = Trainer("g1")
    h.send(trainer.join("/v/4", "g1"))
    assert sorted(engine.aborted) == sorted(r for r, _, _ in engine.submitted)  # stopped
    h.send(AddWork(2, "r", 1, (0,), (3,), long))
    submitted = len(engine.submitted)
    step_until(h, lambda: h.worker.broadcast is not None and h.worker.broadcast.received)
    trainer.thread.join(30)
    assert trainer.error is None
    assert engine.weights.keys() == WEIGHTS.keys()
    assert all(
        torch.equal(engine.weights[n].view(torch.uint8), t.view(torch.uint8))
        for n, t in WEIGHTS.items()
    )
    assert engine.updates[-1] == {
        "kind": "distributed",
        "runners": ["target"],
        "names": list(WEIGHTS),
        "version": None,
        "flush": True,
    }
    assert engine.groups == {} and engine.session is None  # destroyed, session closed
    h.step(5)
    assert len(engine.submitted) == submitted  # nothing runs on unrecorded weights
    assert engine.weight_version == "3"
    ready = of(Ready, h.send(LoadPolicy("/v/4", 4)))[-1]
    assert (ready.policy_version, ready.policy_source) == (4, "broadcast")
    assert engine.weight_version == "4" and engine.updates[-1]["kind"] == "distributed"
    got = finished(h.run_idle())
    # Started over on the new weights: no sample mixes two versions' tokens.
    assert {k: s.policy_version for k, s in got.items()} == {(0, 0): 4, (0, 1): 4, (1, 0): 4}
    assert list(got[(0, 0)].token_ids) == reference([1, 2], 40)
    assert list(got[(1, 0)].token_ids) == reference([3], 40)
    assert all(s.finish_reason is FinishReason.LENGTH for s in got.values())


def test_a_broadcast_the_engine_cannot_join_puts_the_recorded_weights_back(policy):
    h = loaded(policy, version=3)
    engine = h.engine
    h.send(AddWork(1, "r", 0, (0,), (1, 2), SamplingParams(max_new_tokens=40, seed=1)))
    h.step()
    h.send(JoinBroadcast("/v/4", "127.0.0.1", 1, "g2", 1, 2, SPECS, 30.0, backend="nccl"))
    step_until(h, lambda: h.worker.broadcast is None)
    (error,) = h.worker.broadcast_errors()
    assert error.startswith("policy broadcast to /v/4 failed") and "nccl" in error
    assert engine.updates[-1]["kind"] == "disk" and engine.updates[-1]["names"] == [str(policy)]
    assert engine.updates[-1]["version"] == "3" and engine.session is None
    s = finished(h.run_idle())[(0, 0)]
    assert s.policy_version == 3 and list(s.token_ids) == reference([1, 2], 40)


def test_a_received_broadcast_never_recorded_is_undone(policy):
    h = loaded(policy, version=3)
    engine = h.engine
    trainer = Trainer("g3")
    h.send(trainer.join("/v/4", "g3", timeout=0.3))
    step_until(h, lambda: h.worker.broadcast is None)
    (error,) = h.worker.broadcast_errors()
    assert "was not recorded within" in error and "back to policy version 3" in error
    assert [u["kind"] for u in engine.updates] == ["distributed", "disk"]
    assert engine.weight_version == "3"
    # A LoadPolicy of another version while one was received loads that one from its file.
    trainer = Trainer("g4")
    h.send(trainer.join("/v/5", "g4"))
    step_until(h, lambda: h.worker.broadcast is not None and h.worker.broadcast.received)
    ready = of(Ready, h.send(LoadPolicy(str(policy), 6)))[-1]
    assert (ready.policy_version, ready.policy_source) == (6, "")
    assert engine.updates[-1]["kind"] == "disk" and engine.weight_version == "6"


def test_an_engine_waiting_for_a_trainer_that_never_came_restarts_on_the_next_version(
    policy, tmp_path, monkeypatch
):
    import torch.distributed as dist

    monkeypatch.setattr(fake_sglang.Group, "timeout", datetime.timedelta(seconds=3))
    h = loaded(policy, version=3)
    first = h.engine
    h.send(AddWork(1, "r", 0, (0,), (1, 2), SamplingParams(max_new_tokens=40, seed=1)))
    h.step()
    wait = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=wait)
    h.send(JoinBroadcast("/v/4", "127.0.0.1", store.port, "g6", 1, 2, SPECS, 30.0))
    h.step(3)
    assert h.worker.broadcast is not None and not h.worker.broadcast.received
    # The trainer fell back to a gRPC push: that version is recorded and offered.
    new = make_target_dir(tmp_path / "v4", seed=4)
    ready = of(Ready, h.send(LoadPolicy(str(new), 4)))[-1]
    assert (ready.policy_version, ready.policy_source) == (4, "")
    assert h.worker.broadcast is None and h.engine is not first and first.closed
    assert h.engine.args["model_path"] == str(new) and h.engine.weight_version == "4"
    (error,) = [m.message for m in of(WorkerError, h.got)]  # sent with the Ready
    assert "abandoned" in error and "/v/4" in error
    s = finished(h.run_idle())[(0, 0)]  # started over at the join, run in the new engine
    assert s.policy_version == 4 and list(s.token_ids) == reference([1, 2], 40)


def test_ranks_and_group_keys_of_a_broadcast():
    assert assign_ranks([1, 2, 1]) == ([2, 3, 5], 6)  # a TP-2 engine takes ranks 3 and 4
    assert assign_ranks([]) == ([], 2)
    with pytest.raises(ValueError):
        assign_ranks([0])
    assert group_prefix("g") == "g/g//cpu/" and group_prefix("g", "nccl") == "g/g//cuda/"
    j = distributed_join(JoinBroadcast("/v", "h", 7, "g", 3, 6, SPECS, 1.0))
    assert (j.rank_offset, j.world_size, j.group_name, j.backend) == (3, 6, "g", "gloo")
    assert j.names == ("w.a", "w.b") and j.dtypes == ("bfloat16", "float32")
    assert j.shapes == ((4, 3), (5,))


def test_a_tensor_parallel_fake_engine_takes_consecutive_ranks(policy):
    """Trainer 0, a stand-in daemon 1, a TP-2 engine at rank_offset 2: all receive."""
    import torch.distributed as dist

    trainer = Trainer("g5", world=4)
    got = {}

    def daemon() -> None:
        wait = datetime.timedelta(seconds=30)
        store = dist.TCPStore("127.0.0.1", trainer.store.port, 4, False, timeout=wait)
        got["daemon"] = dict(received_tensors(store, group_prefix("g5"), 1, 4, SPECS, wait))

    t = threading.Thread(target=daemon)
    t.start()
    engine = FakeEngine(model_path=str(policy), tp_size=2)
    assert engine.init_weights_update_group(
        "127.0.0.1", trainer.store.port, 2, 4, "g5", "gloo"
    ) == (True, "Succeeded to initialize custom process group.")
    assert len(engine.groups["g5"]) == 2
    engine.begin_weight_update("target")
    ok, _ = engine.update_weights_from_distributed(
        [n for n, _, _ in SPECS], ["bfloat16", "float32"], [list(s) for _, _, s in SPECS], "g5"
    )
    engine.end_weight_update()
    t.join(30)
    assert ok and trainer.error is None
    for name, tensor in WEIGHTS.items():
        assert torch.equal(engine.weights[name].float(), tensor.float())
        assert torch.equal(got["daemon"][name].float(), tensor.float())
    assert engine.destroy_weights_update_group("g5")[0] and not dist.is_initialized()


# ---- the real process ---------------------------------------------------------------------


def test_worker_process_over_a_pipe(policy, tmp_path, monkeypatch):
    """The real worker loop in its own process, the fake engine named on its command line."""
    from tltd_workers.rollout.sglang_worker import main

    log = tmp_path / "engine.jsonl"
    monkeypatch.setenv(fake_sglang.LOG_ENV, str(log))
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=main, args=(child, 1, 0.1, FACTORY))
    proc.start()
    child.close()

    pending: list = []

    def recv(kind, keep=None, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not pending and conn.poll(0.05):
                m = conn.recv()  # a list: messages sent together (a step's samples)
                pending.extend(m if isinstance(m, list) else [m])
            while pending:
                m = pending.pop(0)
                if isinstance(m, kind):
                    return m
                if keep is not None:
                    keep.append(m)
        raise TimeoutError(kind)

    try:
        assert recv(Ready).job_id == ""
        conn.send(LoadModel("job", str(policy), 2, replace(GPU, max_seq_len=10**6)))
        assert recv(Ready).policy_version == 2
        sampling = SamplingParams(n=3, max_new_tokens=8, seed=4)
        conn.send(AddWork(1, "r", 0, (0, 2), (1, 2, 3), sampling))
        conn.send(AddWork(2, "r", 0, (1,), (1, 2, 3), sampling))
        got = {}
        while len(got) < 3:
            s = recv(Finished).sample
            got[s.sample_index] = s
        assert all(list(s.token_ids) == reference([1, 2, 3], 8) for s in got.values())
        hb = recv(Heartbeat)
        while hb.running_samples or hb.acked_seq < 2:
            hb = recv(Heartbeat)
        assert hb.stats["prefills"] == 3 and hb.idle_since is not None

        conn.send(AddWork(3, "long", 0, (0, 1), (4, 5), replace(sampling, max_new_tokens=10**5)))
        conn.send(Cancel("long"))
        cancelled = [recv(Finished).sample for _ in range(2)]
        assert {s.finish_reason for s in cancelled} == {FinishReason.CANCELLED}
        conn.send(AddWork(4, "tail", 0, (0,), (6,), replace(sampling, max_new_tokens=10**5)))
        conn.send(Drain(0.2))
        kept: list = []
        assert recv(Drained, kept).partial == 1
        (tail,) = [m.sample for m in kept if isinstance(m, Finished)]
        assert tail.finish_reason is FinishReason.ABORTED and tail.partial and tail.token_ids
        conn.send(Shutdown())
        proc.join(20)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    events = [json.loads(line) for line in log.read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "shutdown"  # the engine is shut at exit
    seeds = [e["params"]["sampling_seed"] for e in events if e["event"] == "submit"][:3]
    assert seeds == [sample_seed(4, 0, i) for i in (0, 2, 1)]
    assert kinds.count("abort") == 3  # two cancelled, one drained


# ---- the daemon starts it -----------------------------------------------------------------


def test_each_backend_has_its_worker_process():
    from tltd.domain import Backend
    from tltd.worker_code import rollout_entry
    from tltd_workers.rollout import sglang_worker, worker

    # SGLang's engine starts scheduler processes: a daemonic process may not have children.
    assert rollout_entry(Backend.SGLANG) == (sglang_worker.main, False)
    assert rollout_entry(Backend.TORCH) == (worker.main, True)


def test_a_job_of_another_backend_restarts_the_worker_on_it(sqlite_daemon, ckpt):
    """A job stored with backend sglang (created on a GPU node sharing the database) reaches
    a CPU-only daemon: its worker is restarted as an SGLang worker process, whose load fails
    with a reason naming the problem, the request fails with it, and torch jobs still run."""
    from tests.api.support import sampling as pb_sampling
    from tests.rollout.support import wait_until
    from tltd.domain import Backend, Job
    from tltd_clients.errors import FailedPreconditionError

    d, sup = sqlite_daemon, sqlite_daemon.supervisor
    with d.client() as c:
        c.create_job(str(ckpt), job_id="t")  # the daemon's default: torch
        d.wait_workers_ready(2)
        assert {s.backend for s in sup.handles.values()} == {Backend.TORCH}
        d.store.jobs.create(Job("s", str(ckpt), backend=Backend.SGLANG))
        params = pb_sampling(n=2, max_new_tokens=4)
        with pytest.raises(FailedPreconditionError, match="CUDA devices only"):
            list(c.generate("s", [[1, 2]], sampling=params, request_id="on-sglang"))
        switched = [s for s in sup.handles.values() if s.backend is Backend.SGLANG]
        assert switched and all(s.proc.daemon is False for s in switched)
        events = d.store.history.list_events("worker", switched[0].worker_id)
        assert any("switching to the sglang backend" in e.reason for e in events)
        got = list(c.generate("t", [[1, 2]], sampling=params, request_id="on-torch"))
        assert len(got) == 2 and all(len(s.token_ids) == 4 for s in got)
        wait_until(
            lambda: all(s.backend is Backend.TORCH for s in sup.handles.values() if s.job_id)
        )
