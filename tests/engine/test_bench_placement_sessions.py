"""`benchmarks/bench_placement_sessions.py --quick`: one daemon with two torch workers runs the
same skewed sessions under each `session_placement` rule, and the table's counts follow the
rules (hash: the split its hashing of the session ids gives and every later turn reusing its
KV; sticky: every later turn reused; round robin: turns alternating over the workers)."""

from __future__ import annotations

import ast

from benchmarks import bench_placement_sessions as bench
from tltd.scheduler import hashed

WORKERS = ["rollout-cpu:0", "rollout-cpu:1"]


def test_bench_placement_sessions_quick_table(capsys):
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("workload per round: 1 sessions of 6 turns and 4 of 2")
    rows: dict[str, list[str]] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 12 and cells[0] in bench.RULES:
            rows[cells[0]] = cells
    assert sorted(rows) == sorted(bench.RULES)  # every rule ran
    turns, sessions, prompt, env = 6 + 4 * 2, 5, 32, 8
    # A turn after the first, reusing the whole session, prefills its environment's tokens and
    # the token sampled last (its KV was not computed yet); a first turn its prompt.
    reused_all = sessions * prompt + (turns - sessions) * (env + 1)
    split = {}
    for rule, cells in rows.items():
        assert int(cells[1]) == turns
        split[rule] = [int(x) for x in cells[2].split("/")]
        assert sum(split[rule]) == turns  # one prefix lookup per turn, on one of 2 workers
    # Hash ignores the load: every later turn finds its whole session's KV. Sticky may move a
    # turn (its holder full or busier), so it prefills between that floor and a re-send of
    # every context (prompt, then each turn's 4 sampled and 8 environment tokens).
    assert rows["hash"][3] == "100.0%" and int(rows["hash"][5]) == reused_all
    stateless = sum(prompt + t * (4 + env) for n in (6, 2, 2, 2, 2) for t in range(n))
    assert reused_all <= int(rows["sticky"][5]) < stateless
    w = bench.Workload(1, 6, 4, 2, prompt, 4, env, 1)
    home = {wid: 0 for wid in WORKERS}
    for sid, n in w.sessions("hash-r0"):
        home[hashed(sid, WORKERS)] += n
    assert split["hash"] == [home[wid] for wid in WORKERS]  # sorted device ids: cpu:0, cpu:1
    assert split["round_robin"] == [7, 7]
    # Round robin ignores where the KV is (tests/scheduler): whether one of its 9 later turns
    # lands away from its KV is left to chance (about 2^-9 that none does), so only the floor.
    assert int(rows["round_robin"][5]) >= reused_all
    # Re-pins by reason follow the table: hash never sends a turn away from its KV.
    assert "hash: turns sent away" not in out
    for line in out.splitlines():
        if line.startswith("sticky: turns sent away"):
            assert set(ast.literal_eval(line.split("reason ", 1)[1])) <= {"full", "overloaded"}
