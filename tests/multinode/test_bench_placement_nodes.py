"""`benchmarks/bench_placement_sessions.py --nodes 2 --quick`: each rule on a fresh pair of real
`tltd serve` nodes (one torch worker each) on PostgreSQL, the clients sending each call to
either node. Every turn runs once; under sticky placement every turn after a session's first
prefers the node of the turn before, under "none" (round_robin) none does."""

from __future__ import annotations

from benchmarks import bench_placement_sessions as bench


def test_bench_placement_two_nodes_quick(pg_url: str, capsys) -> None:
    # pg_url: the server is reachable (else skipped, or failed under CI); the benchmark makes
    # a database of its own on it per rule.
    assert bench.main(["--nodes", "2", "--quick"]) == 0
    out = capsys.readouterr().out
    rows: dict[str, list[str]] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 12 and cells[0] in bench.NODE_RULES:
            rows[cells[0]] = cells
    assert sorted(rows) == sorted(bench.NODE_RULES)  # every rule ran
    turns, later = 6 + 4 * 2, 6 + 4 * 2 - 5
    for cells in rows.values():
        assert int(cells[1]) == turns
        split = [int(x) for x in cells[2].split("/")]
        assert len(split) == 2 and sum(split) == turns  # one prefix lookup per turn
    assert "prefix lookups beyond one per turn" not in out
    assert f"sticky: {later} turns preferred a node" in out
    assert "none: 0 turns preferred a node" in out
