"""The rollout simulator on a small recorded trace: it replays what the engine did, and its gate
decides from the injected costs (benchmarks/sim_rollout.py)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.rollout_trace import PREFILL
from benchmarks.sim_rollout import CostTable, Drafts, load, measured_table, replay
from tltd_workers.engine.costs import BucketCost, CostModel

# bench_spec.py --prompts 2 --samples 4 --max-new-tokens 192 --repeats 1 --modes off,adaptive
# --warmup 1 --trace ...: one SD-off and one TLT (adaptive) pass, a warm pass each, and the step
# costs timed before each.
TRACE = Path(__file__).parent / "data" / "small_trace.jsonl"


def _passes(mode: str) -> list[dict]:
    return load(TRACE)[1][(0, mode)]


def _table(verify_factor: float, draft_share: float) -> CostTable:
    """Synthetic costs: a plain step of 2 + 0.1 x batch ms, verifying k drafts costs
    1 + verify_factor x k plain steps, a draft step draft_share of a plain step."""
    buckets = {}
    for b in (1, 2, 4, 8, 16):
        plain = 2.0 + 0.1 * b
        verify = {w: plain * (1 + verify_factor * (w - 1)) for w in (3, 5, 7)}
        buckets[b] = BucketCost(plain, verify, draft_share * plain)
    return CostTable({512: CostModel(buckets, 512)}, lambda prompts, width: 1.0)


def test_sd_off_replay_takes_exactly_the_recorded_decode_steps():
    costs, runs = load(TRACE)
    ((p, res),) = replay(runs[(0, "off")], measured_table(costs[(0, "off")]))
    recorded = sum(1 for s in p["steps"] if s[2] != PREFILL)
    assert sum(res.arms.values()) == recorded
    assert set(res.arms) == {"plain"}


def test_replay_under_the_run_s_own_step_costs_reproduces_its_wall_times():
    # One tiny run on a shared 2-core machine: wider than the benchmark's +-10% gate, but
    # a replay that lost steps, tokens or costs is off by far more.
    costs, runs = load(TRACE)
    walls = {}
    for mode in ("off", "adaptive"):
        ((p, res),) = replay(runs[(0, mode)], measured_table(costs[(0, mode)]))
        assert abs(res.seconds / p["seconds"] - 1) < 0.25, (mode, res.seconds, p["seconds"])
        walls[mode] = (p["seconds"], res.seconds)
    real = walls["off"][0] / walls["adaptive"][0]
    sim = walls["off"][1] / walls["adaptive"][1]
    assert abs(sim / real - 1) < 0.25


def test_the_gate_drafts_more_where_drafting_and_verifying_are_free():
    def sd_share(table: CostTable) -> float:
        ((_, res),) = replay(_passes("adaptive"), table)
        return 1 - res.arms["plain"] / sum(res.arms.values())

    free, dear = sd_share(_table(0.0, 0.0)), sd_share(_table(1.0, 1.0))
    assert free > 0.8
    assert dear < 0.3
    # Where verifying is free, the longest chains pay: the gate picks more k = 6 steps.
    ((_, cheap),) = replay(_passes("adaptive"), _table(0.0, 0.0))
    assert cheap.arms["eagle/k6"] > cheap.arms["eagle/k2"]


def test_a_chain_keeps_the_run_of_tokens_its_drafter_got_right():
    run = {"steps": [
        [0.01, 1, "eagle/k4", [[0, 1, 4, 2, 3, "eagle"]]],  # 2 and 3 right, 4 wrong
        [0.01, 1, "eagle/k4", [[0, 4, 4, 4, 5, "eagle"]]],  # 4..7 right
    ]}  # fmt: skip
    d = Drafts.of_run(run)
    assert d.offer(0, "eagle", 1, 4) == (4, 2)  # the recorded step
    assert d.offer(0, "eagle", 2, 4) == (4, 1)  # from inside it: up to the wrong token
    assert d.offer(0, "eagle", 4, 2) == (2, 2)
    assert d.offer(0, "ngram", 4, 2) == (0, 0)  # a drafter that never ran drafts nothing
