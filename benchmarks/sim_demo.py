"""Replay a demo's recorded rollouts per RL step (`examples/grpo_demo.py --trace DIR`).

    python benchmarks/sim_rollout.py validate DIR    # per RL step: measured vs simulated
    python benchmarks/sim_rollout.py project DIR     # PROJECTION: H100 / H200 costs

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.rollout_trace import PREFILL, read_trace
from benchmarks.sim_rollout import (
    CostTable,
    Simulator,
    fitted_table,
    gpu_table,
    step_costs,
    strategy,
)
from tltd_workers.engine.engine import EngineConfig

# The cost table a step's passes on a worker are priced with (None: nothing to hold out).
TableFor = Callable[["DemoStep", str], CostTable] | None

# A pass that began up to this long before the trainer's clock started its rollout still
# belongs to it (one wall clock, read in different processes).
START_SLACK_S = 0.005


@dataclass
class DemoStep:
    """One RL step's rollout: what the trainer timed, and its passes (worker, pass)."""

    mode: str
    step: int
    job: str
    start: float  # wall clock (time.time())
    seconds: float
    load: float | None = None  # the machine's 1-minute load average when it ended
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
        DemoStep(s["mode"], s["step"], s["job"], s["start"], s["seconds"], s.get("load"))
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
            began = [
                s for s in steps if s.job == p["job"] and s.start - START_SLACK_S <= p["start"]
            ]
            last = max(began, key=lambda s: s.start, default=None)
            if last is not None and p["start"] < last.start + last.seconds:
                last.passes.append((p["worker"], p))
    for passes in engines.values():
        passes.sort(key=lambda p: p["start"])
    return DemoTrace(steps, dict(engines))


def by_step(trace: DemoTrace) -> TableFor:
    """Costs held out by RL step: for a step, fitted on the passes of every other RL step
    (both modes); None with a single step."""
    indices = sorted({s.step for s in trace.steps})
    if len(indices) < 2:
        return None
    tables = {
        i: fitted_table([p for s in trace.steps if s.step != i for _, p in s.passes])
        for i in indices
    }
    return lambda step, worker: tables[step.step]


def simulate_step(
    trace: DemoTrace, step: DemoStep, table_for: Callable[[DemoStep, str], CostTable]
) -> tuple[float, float]:
    """The step's simulated rollout seconds (every engine of its job replays its passes up to
    the step's under its worker's table: the latest simulated end of the step's passes), and
    the same end with each pass's recorded steps priced at that table instead of replayed."""
    ends, priced = [0.0], [0.0]
    mine = {id(p) for _, p in step.passes}
    for (worker, job), passes in trace.engines.items():
        if job != step.job:
            continue
        table = table_for(step, worker)
        sim = None
        upto = max((i for i, p in enumerate(passes) if id(p) in mine), default=-1)
        for p in passes[: upto + 1]:
            sim = sim or Simulator(p["config"], table)
            sim.drafter = bool(p["config"]["drafter"])
            got = sim.run(p)
            if id(p) in mine:
                ends.append(p["start"] - step.start + got.seconds)
                priced.append(p["start"] - step.start + sum(t for _, t in step_costs(p, table)))
    return max(ends), max(priced)


def _pct(sim: float, real: float) -> str:
    return f"{100 * (sim / real - 1):+.1f}%" if real else "-"


def _sd_share(step: DemoStep) -> float:
    steps = [s for _, p in step.passes for s in p["steps"] if s[2] != PREFILL]
    return sum(1 for s in steps if s[2] != "plain") / max(1, len(steps))


def in_cpu_time(trace: DemoTrace) -> DemoTrace | None:
    """The trace with every engine step's wall time replaced by its CPU time, and each RL
    step's measured rollout by what those make: its passes' latest start after the step's +
    their steps' CPU seconds. None where the workers did not time CPU."""
    timed: dict[int, dict[str, Any]] = {}
    for passes in trace.engines.values():
        for p in passes:
            if len(p.get("cpu", ())) != len(p["steps"]):
                return None
            steps = [[c, *s[1:]] for c, s in zip(p["cpu"], p["steps"], strict=True)]
            timed[id(p)] = {**p, "steps": steps, "seconds": sum(p["cpu"])}
    steps = []
    for s in trace.steps:
        passes = [(w, timed[id(p)]) for w, p in s.passes]
        seconds = max((p["start"] - s.start + p["seconds"] for _, p in passes), default=0.0)
        steps.append(DemoStep(s.mode, s.step, s.job, s.start, seconds, s.load, passes))
    engines = {k: [timed[id(p)] for p in ps] for k, ps in trace.engines.items()}
    return DemoTrace(steps, engines)


def validate_demo(trace_dir: Path, tolerance: float = 0.10) -> bool:
    """Per RL step and mode, the rollout against its replay under costs held out by RL step
    (`by_step`), in wall time (the rollout as the trainer timed it) and in the engines' CPU
    time (what the steps cost without the other processes of a shared machine); then the
    SD-off / TLT ratio per step. True when every step and every ratio is within `tolerance`
    in wall time."""
    trace = load_demo(trace_dir)
    print(f"replay of {trace_dir} per RL step, costs fitted on the recorded engine steps of the "
          "other RL steps (both modes)\n")  # fmt: skip
    ok = _validate(trace, "wall time", "rollout s (trainer)", tolerance)
    cpu = in_cpu_time(trace)
    if cpu is not None:
        _validate(cpu, "CPU time of the engines' steps", "CPU s", tolerance)
    return ok


def _validate(trace: DemoTrace, title: str, measured: str, tolerance: float) -> bool:
    table_for = by_step(trace)
    if table_for is None:
        print("a single RL step: nothing to hold out to price it with")
        return False
    print(f"{title}:")
    sim = _step_table(trace, table_for, measured, tolerance)
    real = {(s.mode, s.step): s.seconds for s in trace.steps}
    within = sum(abs(sim[k] / real[k] - 1) <= tolerance for k in real)
    r_in, r_all = _print_ratios(sim, real, tolerance)
    verdict = "yes" if within == len(real) and r_in == r_all else "NO"
    print(f"{title}: within +-{100 * tolerance:.0f}% (every step and ratio): {verdict} "
          f"({within} of {len(real)} steps, {r_in} of {r_all} ratios)\n")  # fmt: skip
    return verdict == "yes"


def _step_table(
    trace: DemoTrace,
    table_for: Callable[[DemoStep, str], CostTable],
    measured: str,
    tolerance: float,
) -> dict[tuple[str, int], float]:
    """Print the per-step table; the simulated seconds per (mode, step)."""
    print(f"| step | mode | load | passes | SD steps | {measured} | engines s | simulated s "
          "| error | recorded steps at these costs | simulated vs those |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    out = {}
    for s in sorted(trace.steps, key=lambda s: (s.mode, s.step)):
        t, priced = simulate_step(trace, s, table_for)
        out[(s.mode, s.step)] = t
        flag = "" if abs(t / s.seconds - 1) <= tolerance else " **"
        load = "-" if s.load is None else f"{s.load:.1f}"
        print(f"| {s.step} | {s.mode} | {load} | {len(s.passes)} | {100 * _sd_share(s):.0f}% "
              f"| {s.seconds:.2f} | {s.engine_seconds():.2f} | {t:.2f} "
              f"| {_pct(t, s.seconds)}{flag} | {_pct(priced, s.engine_seconds())} "
              f"| {_pct(t, priced)} |")  # fmt: skip
    for mode in sorted({m for m, _ in out}):
        r = sum(x.seconds for x in trace.steps if x.mode == mode)
        t = sum(v for (m, _), v in out.items() if m == mode)
        print(f"{mode}, all steps: measured {r:.2f} s, simulated {t:.2f} s ({_pct(t, r)})")
    return out


def _print_ratios(
    sim: dict[tuple[str, int], float], real: dict[tuple[str, int], float], tolerance: float
) -> tuple[int, int]:
    """SD off / TLT per step, measured and simulated; (ratios within, ratios)."""
    print("\n| step | SD off / TLT measured | simulated | error |\n|---:|---:|---:|---:|")
    within = n = 0
    for i in sorted(i for m, i in real if m == "tlt" and ("off", i) in real):
        m = real[("off", i)] / real[("tlt", i)]
        t = sim[("off", i)] / sim[("tlt", i)]
        within += abs(t / m - 1) <= tolerance
        n += 1
        print(f"| {i} | {m:.2f}x | {t:.2f}x | {_pct(t, m)} |")
    return within, n


def project_demo(trace_dir: Path, devices: Sequence[str], shapes: Sequence[str]) -> None:
    """PROJECTION: every RL step's recorded passes replayed under gpu_model's costs (the
    engines' gate deciding from them), summed per mode; beside them this CPU's measured
    rollouts and their replay under costs held out by RL step."""
    trace = load_demo(trace_dir)
    modes = sorted({s.mode for s in trace.steps}, reverse=True)  # tlt, off
    cfgs = [p["config"] for ps in trace.engines.values() for p in ps[:1]]
    ks = sorted({strategy(n).k for c in cfgs for n in c["strategies"]})
    batches = EngineConfig(max_batch=max(c["max_batch"] for c in cfgs)).bucket_sizes()

    def total(mode: str, table_for: Callable[[DemoStep, str], CostTable]) -> float:
        return sum(simulate_step(trace, s, table_for)[0] for s in trace.steps if s.mode == mode)

    print(f"PROJECTION (not a measurement): {trace_dir}'s {len(trace.steps)} RL step "
          "rollouts replayed under gpu_model's roofline costs, acceptance and lengths as "
          "recorded\n")  # fmt: skip
    print("| costs | " + " | ".join(f"{m} rollouts s" for m in modes) + " | speedup |")
    print("|---|" + "---:|" * (len(modes) + 1))
    rows = [("this CPU (measured)", {m: sum(s.seconds for s in trace.steps if s.mode == m)
                                     for m in modes})]  # fmt: skip
    held_out = by_step(trace)
    if held_out is not None:
        rows.append(
            ("this CPU (simulated, held-out costs)", {m: total(m, held_out) for m in modes})
        )
    for d in devices:
        for shape in shapes:
            table = gpu_table(d, shape, ks, batches)
            rows.append((table.label, {m: total(m, lambda s, w, t=table: t) for m in modes}))
    for label, got in rows:
        speedup = got["off"] / got["tlt"] if {"off", "tlt"} <= set(got) else float("nan")
        print(f"| {label} | " + " | ".join(f"{got[m]:.2f}" for m in modes) + f" | {speedup:.2f}x |")
