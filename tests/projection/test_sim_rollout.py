"""The rollout simulator on a small recorded trace: it replays what the engine did, and its gate
decides from the injected costs (benchmarks/sim_rollout.py)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.rollout_trace import PREFILL
from benchmarks.sim_rollout import (
    CostTable,
    Drafts,
    cross_fitted,
    fitted_table,
    load,
    measured_table,
    recorded_steps,
    replay,
    step_costs,
)
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


def test_a_history_walk_ends_where_the_recorded_one_did_and_keeps_what_the_nearest_kept():
    run = {"steps": [
        [0.01, 1, "history/k16", [[0, 10, 6, 6, 7, "history"]]],  # 10..15 right, then it stopped
        [0.01, 1, "history/k16", [[0, 40, 8, 3, 4, "history"]]],  # 40..42 right, 43 wrong
    ]}  # fmt: skip
    d = Drafts.of_run(run)
    assert d.offer(0, "history", 12, 16) == (4, 4)  # inside the first walk: it ends at 16
    assert d.offer(0, "history", 41, 16) == (7, 2)  # inside the second: up to the wrong token
    # Where no walk was recorded: the nearest recorded walk's offer and what it kept.
    assert d.offer(0, "history", 30, 16) == (8, 3)
    assert d.offer(0, "history", 20, 16) == (6, 6)


def _priced(passes: list[dict], table: CostTable) -> tuple[float, float]:
    """(recorded, priced at the table) seconds of every step of the passes."""
    pairs = [pair for p in passes for pair in step_costs(p, table)]
    return sum(m for m, _ in pairs), sum(t for _, t in pairs)


def test_a_table_fitted_on_steps_of_known_costs_prices_every_step_back():
    # Steps whose seconds follow known BucketCost-form costs (plain 2 + 0.3 x batch + 0.5 x
    # batch x context / 1000 ms; verifying w drafts adds 1 + 0.2 x batch x w; a draft step
    # 0.4 + 0.05 x batch): the fit recovers them, so every step is priced back exactly.
    _, runs = load(TRACE)
    passes = []
    for p in (q for ps in runs.values() for q in ps):
        steps = []
        for s, rec in zip(p["steps"], recorded_steps(p), strict=True):
            b, c = rec.batch, rec.context / 1000
            ms = 2 + 0.3 * b + 0.5 * b * c
            if rec.arm == PREFILL:
                ms = 0.01 * rec.prompts * rec.width
            elif rec.arm != "plain" and rec.width:
                ms += 1 + 0.2 * b * rec.width
                drafter, k = rec.arm.split("/k")
                ms += int(k) * (0.4 + 0.05 * b) if drafter == "eagle" else 0.0
            steps.append([ms / 1000, *s[1:]])
        passes.append({**p, "steps": steps})
    table = fitted_table(passes)
    for p in passes:
        for measured, priced in step_costs(p, table):
            assert abs(priced - measured) < 1e-9 + 1e-6 * measured
    assert table.fit is not None and abs(table.fit["k*B"] - 0.05) < 1e-6


def test_in_run_costs_of_a_repeat_come_from_the_other_repeat_only():
    # A second repeat whose every step took twice as long: the costs cross-fitted for the
    # first price its steps at twice their recorded seconds, and the other way round.
    _, runs = load(TRACE)
    doubled = {
        (1, mode): [{**p, "steps": [[2 * s[0], *s[1:]] for s in p["steps"]]} for p in ps]
        for (_, mode), ps in runs.items()
    }
    tables = cross_fitted({**runs, **doubled})
    assert set(tables) == {0, 1} and tables[0].label == "repeat 2"
    first = [p for ps in runs.values() for p in ps]
    second = [p for ps in doubled.values() for p in ps]
    recorded, priced = _priced(first, tables[0])
    assert abs(priced / recorded - 2) < 1e-6
    recorded, priced = _priced(second, tables[1])
    assert abs(priced / recorded - 0.5) < 1e-6
    assert cross_fitted(runs) == {}  # one repeat: nothing to hold out
