"""A torch worker's engine trace (engine_trace_dir): one line per busy period, read from outside
the engine, that the rollout simulator replays step for step (tltd_workers.engine.trace,
benchmarks/sim_rollout.py, benchmarks/sim_demo.py)."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from benchmarks.sim_demo import (
    in_cpu_time,
    load_demo,
    project_demo,
    simulate_step,
    validate_demo,
)
from benchmarks.sim_rollout import CostTable, Simulator, recorded_steps
from tests.rollout.support import make_checkpoint
from tltd.contract.rollout_messages import AddWork, EngineSpec, LoadModel
from tltd.domain import SamplingParams
from tltd_workers.engine.costs import BucketCost, CostModel
from tltd_workers.rollout.worker import RolloutWorker

PROMPTS = [(1, 5, 9, 13, 2), (1, 7, 3, 3, 8, 11)]
# SD in the fixed mode (n-gram drafts, k = 2, batch <= threshold): the same tokens every run.
SPEC = EngineSpec(max_batch=8, max_seq_len=96, spec_mode="fixed", drafter="ngram", seed=3)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "m")


def _rollout(w: RolloutWorker, request: str, history: tuple = ()) -> dict:
    """One request of both prompts x 3 samples through the worker until it is idle; `history`:
    earlier answers to the first prompt."""
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=40, seed=11)
    for i, prompt in enumerate(PROMPTS):
        past = history if i == 0 else ()
        w.add(AddWork(i + 1, request, i, (0, 1, 2), prompt, sampling, history=past))
    outs = {}
    while w.busy():
        for s in w.step():
            outs[(s.prompt_index, s.sample_index)] = s.token_ids
    return outs


def _worker(ckpt: Path, trace_dir: str) -> RolloutWorker:
    here, _there = mp.Pipe()
    w = RolloutWorker(here, heartbeat_seconds=1.0, trace_dir=trace_dir)
    w.load(LoadModel("job", str(ckpt), 1, SPEC))
    w.job_id = "job"
    return w


def _lines(trace_dir: Path) -> list[dict]:
    path = trace_dir / f"{mp.current_process().name}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_traced_worker_samples_the_same_tokens_and_writes_a_line_per_busy_period(ckpt, tmp_path):
    plain = _rollout(_worker(ckpt, ""), "r1")
    w = _worker(ckpt, str(tmp_path))
    traced = _rollout(w, "r1")
    assert traced == plain  # recording reads the engine, it decides nothing
    second = _rollout(w, "r2", history=((("r1", 0, 0), traced[(0, 0)]),))
    w.load(LoadModel("job", str(ckpt), 2, SPEC))  # another engine: its count goes up
    w.job_id = "job"
    _rollout(w, "r3")
    first, again, third = _lines(tmp_path)
    assert (first["job"], first["engine"], third["engine"]) == ("job", 1, 2)
    assert first["worker"] == mp.current_process().name and first["start"] < again["start"]
    # Per prompt its context, samples, token cap and earlier answers; per sample its length.
    assert [g[1:3] + g[4:6] for g in first["groups"]] == [[5, 3, 40, 0], [6, 3, 40, 0]]
    assert [g[5] for g in again["groups"]] == [1, 0]  # the earlier answer given to prompt 0
    assert first["groups"][0][6] == again["groups"][0][6] != again["groups"][1][6]
    by_sample = {(g, i): n for g, i, n in again["samples"]}
    for (p, i), tokens in second.items():
        assert by_sample[(f"r2/{p}/0", i)] == len(tokens)
    arms = {s[2] for s in first["steps"]}
    assert first["steps"][0][2] == "prefill" and arms <= {"prefill", "plain", "ngram/k2"}
    assert len(first["at"]) == len(first["steps"]) and first["at"] == sorted(first["at"])
    assert len(first["cpu"]) == len(first["steps"])  # the engine thread's CPU time per step
    assert sum(s[0] for s in first["steps"]) <= first["seconds"]
    assert first["versions"][0][1:] == [1, 0]


def _flat_costs() -> CostTable:
    cost = BucketCost(2.0, {3: 3.0, 5: 4.0, 7: 5.0}, 0.5)
    return CostTable({64: CostModel({b: cost for b in (1, 2, 4, 8)}, 64)}, lambda p, w: 1.0)


def test_the_simulator_replays_a_worker_pass_step_for_step(ckpt, tmp_path):
    w = _worker(ckpt, str(tmp_path))
    _rollout(w, "r1")
    (line,) = _lines(tmp_path)
    res = Simulator(line["config"], _flat_costs()).run(line)
    decode = [s for s in recorded_steps(line) if s.arm != "prefill"]
    # The fixed gate takes the recorded arm at every step and each row keeps the drafts it
    # kept there: the replay takes exactly the recorded steps.
    assert sum(res.arms.values()) == len(decode)
    assert dict(res.arms) == {a: sum(s.arm == a for s in decode) for a in res.arms}


def test_a_demo_trace_is_replayed_per_rl_step(ckpt, tmp_path, capsys):
    # Two "RL steps" of one job, each one busy period of the worker, and demo.jsonl saying
    # when the trainer's rollouts began and how long they took.
    w = _worker(ckpt, str(tmp_path))
    _rollout(w, "r1")
    _rollout(w, "r2")
    with (tmp_path / "demo.jsonl").open("w") as f:
        for i, p in enumerate(_lines(tmp_path)):
            line = {"type": "step", "mode": "tlt", "step": i, "job": "job",
                    "start": p["start"] - 0.001, "seconds": p["seconds"] + 0.002}  # fmt: skip
            f.write(json.dumps(line) + "\n")
    trace = load_demo(tmp_path)
    assert [len(s.passes) for s in trace.steps] == [1, 1]
    assert list(trace.engines) == [(mp.current_process().name, "job")]
    simulated, priced = simulate_step(trace, trace.steps[1], lambda step, worker: _flat_costs())
    assert simulated > 0 and priced > 0
    cpu = in_cpu_time(trace)  # the same steps in the engine's CPU seconds
    assert (
        cpu is not None
        and cpu.steps[0].passes[0][1]["steps"][0][0] == trace.steps[0].passes[0][1]["cpu"][0]
    )
    validate_demo(tmp_path)  # costs fitted on the other step: prints the per-step table
    out = capsys.readouterr().out
    assert "| 0 | tlt | - | 1 |" in out and "| 1 | tlt | - | 1 |" in out
    project_demo(tmp_path, ["H100"], ["Qwen2.5-1.5B"])  # the same steps under a GPU's costs
    assert "| H100 Qwen2.5-1.5B (projection) |" in capsys.readouterr().out
