"""Rollout traces of benchmark passes, and the step costs of the device they ran on.

The trace format and its recorder live with the engine (`tltd_workers.engine.trace`: a rollout
worker records its own busy periods there when the daemon's `engine_trace_dir` is set);
bench_spec.py records its passes with the same `Recorder`. `costs` lines hold step costs timed
on the same machine in the same process (`measure_step_costs`), so that machine load weighs on
both alike. sim_rollout.py replays the runs under such costs, and under costs fitted on another
repeat's recorded step times.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tltd.domain import SamplingParams
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.costs import BucketCost, CostModel, smoothed
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.engine import Engine, EngineConfig
from tltd_workers.engine.trace import PREFILL, Recorder, write_line
from tltd_workers.engine.transformer import CausalLM

__all__ = ["PREFILL", "Recorder", "StepCosts", "measure_step_costs", "read_trace", "write_line"]


def strategy(name: str) -> Strategy:
    """A strategy from its name ("eagle/k6")."""
    drafter, k = name.split("/k")
    return Strategy(drafter, int(k))


# -- step costs measured on this machine ------------------------------------------------------


@dataclass(frozen=True)
class StepCosts:
    """Wall-time costs of whole engine steps (forwards, sampling, the accept rule, emission)
    per context: a `CostModel` per context (plain, verify of k + 1 and one EAGLE draft step
    per batch size), and a prefill's ms per prompt position (padding included) + fixed ms."""

    models: dict[int, CostModel]
    prefill: tuple[float, float]  # (fixed ms, ms per prompt position)

    def as_dict(self) -> dict[str, Any]:
        return {
            "contexts": {str(c): m.as_dict() for c, m in sorted(self.models.items())},
            "prefill": list(self.prefill),
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> StepCosts:
        models = {}
        for c, m in d["contexts"].items():
            buckets = {
                int(b): BucketCost(
                    v["plain_ms"], {int(w): ms for w, ms in v["verify_ms"].items()}, v["draft_ms"]
                )
                for b, v in m["buckets"].items()
            }
            models[int(c)] = CostModel(buckets, int(c), m.get("seconds", 0.0))
        return StepCosts(models, (d["prefill"][0], d["prefill"][1]))


def measure_step_costs(
    model: CausalLM,
    drafter: EagleDrafter | None,
    batches: Sequence[int],
    ks: Sequence[int],
    contexts: Sequence[int],
    steps: int = 8,
    warm: int = 2,
) -> StepCosts:
    """Time whole engine steps per context and batch size: plain passes (SD off) and, with a
    drafter, EAGLE passes drafting k per row at every k (the fixed mode, every draft verified),
    split into drafting (the engine's own draft timer, per draft step) and the rest (verify,
    accept, emit). Each figure is the median of `steps` steps after `warm`; every row holds
    `context` positions and runs at temperature 1 without a stop token. The first step of
    each engine (one prompt of `context` tokens) times the prefill."""
    models: dict[int, CostModel] = {}
    prefills: list[tuple[int, float]] = []
    t_start = time.perf_counter()
    for c in contexts:
        buckets = {}
        for b in batches:
            plain, pre = _time_steps(model, None, None, b, c, steps, warm)
            prefills.append((c, pre))
            verify, draft = {}, []
            for k in ks if drafter is not None else ():
                times, _ = _time_steps(model, drafter, Strategy("eagle", k), b, c, steps, warm)
                verify[k + 1] = statistics.median(t - d for t, d in times)
                draft.append(statistics.median(d for _, d in times) / k)
            p = statistics.median(t for t, _ in plain)
            buckets[b] = BucketCost(p, verify, statistics.median(draft) if draft else 0.0)
        models[c] = CostModel(_despiked(buckets), c, time.perf_counter() - t_start)
    return StepCosts(models, _fit_line(prefills))


def _despiked(costs: dict[int, BucketCost]) -> dict[int, BucketCost]:
    """A shared machine disturbs single timings: a plain step above both neighbouring batch
    sizes' is clipped to the larger of them, then verify and draft costs are taken as the
    plain step x the median ratio over the neighbouring sizes (the engine's `smoothed`)."""
    order = sorted(costs)
    out = dict(costs)
    for lo, b, hi in zip(order, order[1:], order[2:], strict=False):
        top = max(costs[lo].plain_ms, costs[hi].plain_ms)
        if costs[b].plain_ms > top:
            c = costs[b]
            out[b] = BucketCost(top, c.verify_ms, c.draft_ms)
    return smoothed(out)


def _fit_line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    xs = [x for x, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    return max(0.0, my - slope * mx), max(0.0, slope)


def _time_steps(
    model: CausalLM,
    drafter: EagleDrafter | None,
    arm: Strategy | None,
    b: int,
    context: int,
    steps: int,
    warm: int,
) -> tuple[list[tuple[float, float]], float]:
    """(ms of each timed step, ms of its drafting) and the prefill's ms."""
    k = arm.k if arm else 0
    cfg = EngineConfig(
        max_batch=b,
        max_seq_len=context + (steps + warm + 1) * (k + 1) + 8,
        spec_mode="fixed" if arm else "off",
        strategies=(arm,) if arm else EngineConfig().strategies,
        batch_threshold=b,
        cost_budget_s=0.0,
    )
    engine = Engine(model, cfg)
    if drafter is not None and arm is not None:
        engine.set_drafter(drafter, version=1)
    vocab = model.config.vocab_size
    prompt = [1] + [3 + (7 * i) % (vocab - 3) for i in range(context - 1)]
    sp = SamplingParams(n=b, temperature=1.0, max_new_tokens=(steps + warm) * (k + 1) + 2, seed=1)
    engine.add_request("calibrate", prompt, sp)
    t0 = time.perf_counter()
    engine.step()  # the prefill
    prefill = 1000 * (time.perf_counter() - t0)
    out = []
    for i in range(warm + steps):
        d0 = engine.stats.draft_seconds
        t0 = time.perf_counter()
        engine.step()
        if i >= warm:
            dt = time.perf_counter() - t0
            out.append((1000 * dt, 1000 * (engine.stats.draft_seconds - d0)))
    return out, prefill


# -- reading ----------------------------------------------------------------------------------


def read_trace(path: Path) -> Iterator[dict[str, Any]]:
    """The lines of a trace file."""
    with path.open() as f:
        for line in f:
            if line.strip():
                yield json.loads(line)
