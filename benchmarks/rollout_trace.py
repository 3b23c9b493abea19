"""Rollout traces: what the engine did per decode step, and the step costs of the device it ran on.

A trace (JSON lines) holds, per rollout pass of one engine (`run` lines): its configuration,
per prompt its length, samples and arrival, per sample its length, and per engine step its
wall time, running batch and kind: a prefill (the prompts it admitted), a plain pass, or an
SD pass with per row the sample, its position (tokens emitted before the step), drafts
verified, drafts accepted, tokens gained and the drafter that proposed them. `costs` lines
hold step costs timed on the same machine in the same process (`measure_step_costs`), so that
machine load weighs on both alike. sim_rollout.py replays the runs under such costs, and under
costs fitted on another repeat's recorded step times.

Recording reads the engine from outside (its running rows before a step, `EngineStats.step_log`
after it): the engine decides exactly as it does unrecorded.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tltd.domain import SamplingParams
from tltd_workers.engine.bandit import Strategy
from tltd_workers.engine.costs import BucketCost, CostModel, smoothed
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.engine import Engine, EngineConfig, SampleOutput
from tltd_workers.engine.transformer import CausalLM

PREFILL = "prefill"


@dataclass
class Recorder:
    """Records one pass of `engine`: call `before()` and `after(seconds, done)` around every
    engine.step(); `run(...)` returns the trace line."""

    engine: Engine
    log: list[tuple] = field(default_factory=list)
    # per prompt: request, prompt tokens, n, arrival (s), max_new_tokens
    groups: list[list[Any]] = field(default_factory=list)
    samples: dict[tuple[str, int], int] = field(default_factory=dict)  # sample -> trace id
    lengths: dict[int, int] = field(default_factory=dict)
    steps: list[list[Any]] = field(default_factory=list)
    _rows: list[tuple[int, int]] = field(default_factory=list)
    _waiting: list[str] = field(default_factory=list)
    _t0: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.engine.stats.step_log = self.log

    def close(self) -> None:
        self.engine.stats.step_log = None

    def before(self) -> None:
        e = self.engine
        now = time.perf_counter() - self._t0
        known = {g[0] for g in self.groups}
        for g in e.waiting:
            if g.request_id not in known:
                n, cap = g.sampling.n, g.sampling.max_new_tokens
                self.groups.append([g.request_id, len(g.context), n, now, cap])
        self._rows = [(self._sid(s.group.request_id, s.index), len(s.tokens)) for s in e.running]
        self._waiting = [g.request_id for g in e.waiting]
        self.log.clear()

    def after(self, seconds: float, done: Sequence[SampleOutput]) -> None:
        e = self.engine
        for o in done:
            self.lengths[self._sid(o.request_id, o.sample_index)] = len(o.token_ids)
        if not self.log:  # no decode pass: a prefill (or nothing ran)
            still = {g.request_id for g in e.waiting}
            admitted = [r for r in self._waiting if r not in still]
            if admitted:
                self.steps.append([seconds, len(self._rows), PREFILL, admitted])
            return
        arm, *per_row = self.log[0]
        if arm == "plain":
            self.steps.append([seconds, len(self._rows), arm, None])
            return
        drafted, accepted, emitted, kinds = per_row
        rows = [
            [sid, pos, d, a, g, kind]
            for (sid, pos), d, a, g, kind in zip(
                self._rows, drafted, accepted, emitted, kinds, strict=True
            )
        ]
        self.steps.append([seconds, len(self._rows), arm, rows])

    def run(self, seconds: float, **meta: Any) -> dict[str, Any]:
        """The trace line of this pass: `meta` (mode, repeat, ...) and what was recorded."""
        self.close()
        samples = sorted(self.samples.items(), key=lambda kv: kv[1])
        cfg = self.engine.config
        return {
            "type": "run",
            **meta,
            "seconds": seconds,
            "config": {
                "spec_mode": cfg.spec_mode,
                "gate": cfg.gate,
                "strategies": [s.name for s in cfg.strategies],
                "max_batch": cfg.max_batch,
                "batch_threshold": cfg.batch_threshold,
                "max_prefill_tokens": cfg.max_prefill_tokens,
                "seed": cfg.seed,
                "drafter": self.engine.drafter is not None,
            },
            "groups": self.groups,
            "samples": [[r, i, self.lengths.get(sid, 0)] for (r, i), sid in samples],
            "steps": self.steps,
        }

    def _sid(self, request_id: str, index: int) -> int:
        return self.samples.setdefault((request_id, index), len(self.samples))


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


def write_line(path: Path, line: dict[str, Any]) -> None:
    """Append one line to a trace file."""
    with path.open("a") as f:
        f.write(json.dumps(line, separators=(",", ":")) + "\n")
