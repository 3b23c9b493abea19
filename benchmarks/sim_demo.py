"""Replay a demo's recorded rollouts per RL step (`examples/grpo_demo.py --trace DIR`).

    python benchmarks/sim_rollout.py validate DIR    # per RL step: measured vs simulated

DIR holds `demo.jsonl` (per RL step: mode, job, wall-clock start and seconds of its rollout as
the trainer timed it) and one trace per rollout worker (`<worker>.jsonl`, written by the
daemon's torch workers under `engine_trace_dir`: one `run` line per busy period of an engine).
A step's passes are the busy periods of its job's engines that began during its rollout; the
others (the job's warm-up request) replay untimed, for the gate. Each engine (worker x job)
replays its passes in order through one `sim_rollout.Simulator`, its gate living across them
as the worker's does. A step's simulated rollout is its latest simulated end over the workers:
a pass's recorded start after the step's start (the daemon's dispatch) + its simulated seconds.

Costs are held out per RL step: `fitted_table` on the recorded engine steps of every other RL
step of both modes, so that no step is priced by costs fitted on its own steps or on its
pair's (the other mode's same step).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.rollout_trace import PREFILL, read_trace
from benchmarks.sim_rollout import CostTable, Simulator, fitted_table, step_costs

# A pass that began up to this long before the trainer's clock started its rollout still
# belongs to it (the two clocks are read in different processes).
START_SLACK_S = 0.05


@dataclass
class DemoStep:
    """One RL step's rollout: what the trainer timed, and its passes (worker, pass)."""

    mode: str
    step: int
    job: str
    start: float  # wall clock (time.time())
    seconds: float
    passes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def engine_seconds(self) -> float:
        """From the step's start to the end of its last pass (the engines' part of it)."""
        return max((p["start"] - self.start + p["seconds"] for _, p in self.passes), default=0.0)


@dataclass
class DemoTrace:
    """A demo's steps, and per engine (worker, job, engine count) its passes in order."""

    steps: list[DemoStep]
    engines: dict[tuple[str, str], list[dict[str, Any]]]


def load_demo(trace_dir: Path) -> DemoTrace:
    """The steps of `trace_dir`/demo.jsonl with their passes, and the passes per engine."""
    steps = [
        DemoStep(s["mode"], s["step"], s["job"], s["start"], s["seconds"])
        for s in read_trace(trace_dir / "demo.jsonl")
        if s["type"] == "step"
    ]
    jobs = {s.job for s in steps}
    engines: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(trace_dir.glob("*.jsonl")):
        if path.name == "demo.jsonl":
            continue
        for p in read_trace(path):
            if p["type"] != "run" or p["job"] not in jobs:
                continue
            engines[(p["worker"], p["job"])].append(p)
            for s in steps:
                if s.job == p["job"] and s.start - START_SLACK_S <= p["start"] < s.start + s.seconds:
                    s.passes.append((p["worker"], p))
    for passes in engines.values():
        passes.sort(key=lambda p: p["start"])
    return DemoTrace(steps, dict(engines))


def held_out_tables(trace: DemoTrace) -> dict[int, CostTable]:
    """Per RL step index, costs fitted on the passes of every other step index (both modes)."""
    indices = sorted({s.step for s in trace.steps})
    return {
        i: fitted_table(
            [p for s in trace.steps if s.step != i for _, p in s.passes], f"steps other than {i}"
        )
        for i in indices
        if len(indices) > 1
    }


def simulate_step(trace: DemoTrace, step: DemoStep, table: CostTable) -> float:
    """The step's simulated rollout seconds: every engine of its job replays its passes up to
    the step's under `table`; the latest simulated end of the step's passes."""
    ends = [0.0]
    mine = {id(p) for _, p in step.passes}
    for (_, job), passes in trace.engines.items():
        if job != step.job:
            continue
        sim = None
        for p in passes:
            if p["start"] >= step.start + step.seconds:
                break
            sim = sim or Simulator(p["config"], table)
            sim.drafter = bool(p["config"]["drafter"])
            got = sim.run(p)
            if id(p) in mine:
                ends.append(p["start"] - step.start + got.seconds)
    return max(ends)


def _priced(step: DemoStep, table: CostTable) -> tuple[float, float]:
    """The step's recorded engine seconds, and the same steps priced at the table's costs."""
    pairs = [pair for _, p in step.passes for pair in step_costs(p, table)]
    return sum(m for m, _ in pairs), sum(t for _, t in pairs)


def _pct(sim: float, real: float) -> str:
    return f"{100 * (sim / real - 1):+.1f}%" if real else "-"


def _sd_share(step: DemoStep) -> float:
    steps = [s for _, p in step.passes for s in p["steps"] if s[2] != PREFILL]
    return sum(1 for s in steps if s[2] != "plain") / max(1, len(steps))


def validate_demo(trace_dir: Path, tolerance: float = 0.10) -> bool:
    """Per RL step and mode: the rollout the trainer timed, the engines' part of it, the
    replay under held-out costs and its error; then the SD-off / TLT ratio per step. True when
    every step and every ratio is within `tolerance` of the trainer's timing."""
    trace = load_demo(trace_dir)
    tables = held_out_tables(trace)
    if not tables:
        print(f"{trace_dir}: a single RL step: nothing to hold out to price it with")
        return False
    print(f"replay of {trace_dir} per RL step, costs fitted on the recorded engine steps of "
          "every other RL step (both modes)\n")  # fmt: skip
    print("| step | mode | workers | passes | SD steps | rollout s (trainer) | engines s "
          "| simulated s | error | error vs engines | recorded steps priced |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    sim: dict[tuple[str, int], float] = {}
    real: dict[tuple[str, int], float] = {}
    ok = bad = 0
    for s in sorted(trace.steps, key=lambda s: (s.mode, s.step)):
        table = tables[s.step]
        sim[(s.mode, s.step)] = t = simulate_step(trace, s, table)
        real[(s.mode, s.step)] = s.seconds
        recorded, priced = _priced(s, table)
        within = abs(t / s.seconds - 1) <= tolerance
        ok, bad = ok + within, bad + (not within)
        print(f"| {s.step} | {s.mode} | {len({w for w, _ in s.passes})} | {len(s.passes)} "
              f"| {100 * _sd_share(s):.0f}% | {s.seconds:.2f} | {s.engine_seconds():.2f} "
              f"| {t:.2f} | {_pct(t, s.seconds)} | {_pct(t, s.engine_seconds())} "
              f"| {_pct(priced, recorded)} |")  # fmt: skip
    ratios = _print_ratios(sim, real, tolerance)
    _print_totals(sim, real)
    verdict = "yes" if bad == 0 and ratios[1] == 0 else "NO"
    print(f"\nwithin +-{100 * tolerance:.0f}% (every step and ratio): {verdict} ({ok} of "
          f"{ok + bad} steps, {ratios[0]} of {sum(ratios)} ratios)")  # fmt: skip
    return verdict == "yes"


def _print_ratios(
    sim: dict[tuple[str, int], float], real: dict[tuple[str, int], float], tolerance: float
) -> tuple[int, int]:
    """SD off / TLT per step, measured and simulated; (ratios within, ratios outside)."""
    print("\n| step | SD off / TLT measured | simulated | error |\n|---:|---:|---:|---:|")
    ok = bad = 0
    for mode, i in sorted(k for k in real if k[0] == "tlt"):
        if ("off", i) not in real:
            continue
        m = real[("off", i)] / real[(mode, i)]
        t = sim[("off", i)] / sim[(mode, i)]
        within = abs(t / m - 1) <= tolerance
        ok, bad = ok + within, bad + (not within)
        print(f"| {i} | {m:.2f}x | {t:.2f}x | {_pct(t, m)} |")
    return ok, bad


def _print_totals(sim: dict[tuple[str, int], float], real: dict[tuple[str, int], float]) -> None:
    for mode in sorted({m for m, _ in real}):
        r = sum(v for (m, _), v in real.items() if m == mode)
        t = sum(v for (m, _), v in sim.items() if m == mode)
        print(f"\n{mode}, all steps: measured {r:.2f} s, simulated {t:.2f} s ({_pct(t, r)})",
              end="")  # fmt: skip
    print()

