"""Replay recorded rollouts under a device's step costs: continuous batching with the engine's gate.

    python benchmarks/sim_rollout.py validate TRACE     # vs the wall times the trace measured
    python benchmarks/sim_rollout.py validate DIR       # a demo's, per RL step (sim_demo.py)
    python benchmarks/sim_rollout.py project DIR        # PROJECTION: a demo's, per mode
    python benchmarks/sim_rollout.py project TRACE      # PROJECTION: H100 / H200 costs

A trace (`bench_spec.py --trace`, rollout_trace.py) fixes what does not depend on the
hardware: the prompts and their arrival, every sample's length, and, per sample, what each
drafter's drafts kept at the positions where it drafted. What does depend on it is replayed:
each decode step's cost comes from an injected cost table, and the arm of every step is chosen
by the engine's own gate (`gate.choose_arm`: the bandit, its priors by `costs.arm_rewards`, the
acceptance estimates of `GateState`) learning from the simulated step times, so that the
decisions follow the costs of the device simulated. Warm passes replay first through the same
gate, as in the benchmark.

A sample's drafts at a position (`Drafts`): the recorded steps say which of its tokens each
drafter drafted right or wrong; a chain keeps the run of right tokens from its start, tokens no
recorded step covered being right at the drafter's recorded acceptance rate. N-gram drafting and
the EAGLE drafter's catch-up after plain steps cost nothing here.

`validate` replays every run under two cost tables and prints, per run, ratio, recorded step
and running-batch bucket, measured against simulated wall time side by side: the whole steps
timed in isolation just before and after the run (rollout_trace.measure_step_costs), and
costs fitted on the engine's own recorded steps of the other repeat (`fitted_table`, held
out: no run is priced by costs fitted on itself).
`project` feeds `gpu_model`'s roofline costs; every figure it prints is a projection.
"""

from __future__ import annotations

import argparse
import bisect
import random
import statistics
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rollout_trace import PREFILL, StepCosts, read_trace, strategy  # noqa: E402
from tltd_workers.engine.bandit import Strategy  # noqa: E402
from tltd_workers.engine.costs import (  # noqa: E402
    BucketCost,
    CostModel,
    expected_tokens,
    fallback_pays,
)
from tltd_workers.engine.engine import EngineConfig, gate_for  # noqa: E402
from tltd_workers.engine.gate import choose_arm  # noqa: E402
from tltd_workers.engine.speculation import HISTORY_MIN_DRAFT  # noqa: E402

GATE_CONTEXT = EngineConfig().cost_context  # the context the engine times its gate's costs at


def bucket_of(batch: int) -> int:
    """Running-batch bucket as bench_spec reports it: the smallest power of two >= batch."""
    return 1 << max(0, batch - 1).bit_length()


# -- costs ------------------------------------------------------------------------------------


def _lerp(a: float, b: float, w: float) -> float:
    return a + (b - a) * w


def _mix(a: BucketCost, b: BucketCost, w: float) -> BucketCost:
    widths = set(a.verify_ms) & set(b.verify_ms)
    verify = {x: _lerp(a.verify_ms[x], b.verify_ms[x], w) for x in widths}
    return BucketCost(_lerp(a.plain_ms, b.plain_ms, w), verify, _lerp(a.draft_ms, b.draft_ms, w))


def _between(points: Sequence[int], x: float) -> tuple[int, int, float]:
    """The two points to interpolate x between (the last two beyond them) and the weight."""
    if len(points) == 1:
        return points[0], points[0], 0.0
    i = min(max(bisect.bisect_left(points, x), 1), len(points) - 1)
    lo, hi = points[i - 1], points[i]
    return lo, hi, max(0.0, (x - lo) / (hi - lo)) if x > lo else 0.0


@dataclass(frozen=True)
class CostTable:
    """Step costs at measured (context, batch) points, in the engine's `BucketCost` form; `at`
    interpolates linearly in the batch size and then in the context (extrapolating from the
    last two contexts). `prefill_ms(prompts, width)`: a prefill of that many prompts padded to
    `width` tokens."""

    models: Mapping[int, CostModel]
    prefill_ms: Callable[[int, int], float]
    label: str = ""
    fit: Mapping[str, float] | None = None  # fitted_table's ms per term (FIT_TERMS)

    def at(self, batch: int, context: float) -> BucketCost:
        ctxs = sorted(self.models)
        c0, c1, wc = _between(ctxs, context)
        return _mix(self._at_batch(c0, batch), self._at_batch(c1, batch), wc)

    def _at_batch(self, context: int, batch: int) -> BucketCost:
        buckets = self.models[context].buckets
        b0, b1, wb = _between(sorted(buckets), batch)
        return _mix(buckets[b0], buckets[b1], wb)

    def gate_model(self, buckets: Sequence[int], context: int = GATE_CONTEXT) -> CostModel:
        """What the engine's gate would have measured on this device: costs per bucket at the
        context it times them at."""
        return CostModel({b: self.at(b, context) for b in buckets}, context)


def step_ms(cost: BucketCost, width: int, draft_steps: int = 0) -> float:
    """ms of one decode step: plain (no row drafted: `width` 0), or an SD step verifying up
    to `width` drafts per row, after `draft_steps` EAGLE draft steps (n-gram and history
    drafts are free: dictionary look-ups)."""
    if width == 0:
        return cost.plain_ms
    return cost.verify(width) + draft_steps * cost.draft_ms


def measured_table(costs: StepCosts) -> CostTable:
    """The cost table of step costs timed on this machine (rollout_trace.StepCosts)."""
    fixed, per_position = costs.prefill
    return CostTable(
        costs.models, lambda prompts, width: fixed + per_position * prompts * width, "measured"
    )


# -- what the drafters keep -------------------------------------------------------------------


@dataclass
class Drafts:
    """Per (sample, drafter), which of the sample's tokens the drafter drafted right, from the
    steps the run drafted for it: a step at position q that kept a of d drafts says tokens
    q .. q + a - 1 were drafted right and, when a < d, token q + a wrong. `offer` answers for
    any position: the drafts a chain from there keeps are the run of right tokens from it;
    a token no step covered is right with the drafter's recorded per-position acceptance
    (a seeded draw per sample, drafter and position, so that every query agrees). How many
    drafts the drafter offers (an n-gram match or a history walk may be short) comes from the
    sample's nearest recorded step; a history walk from inside a recorded one ends where that
    one did (its support fell there, whichever position it started from)."""

    seed: int = 0
    right: dict[tuple[int, str], dict[int, bool]] = field(default_factory=dict)
    offers: dict[tuple[int, str], tuple[list[int], list[int | None]]] = field(default_factory=dict)
    alpha: dict[str, float] = field(default_factory=dict)
    walks: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)  # history's
    kept: dict[tuple[int, str], list[int]] = field(default_factory=dict)  # as `offers`

    @staticmethod
    def of_run(run: Mapping[str, Any], seed: int = 0) -> Drafts:
        out = Drafts(seed)
        offers: dict[tuple[int, str], list[tuple[int, int | None, int]]] = defaultdict(list)
        walks: dict[int, list[tuple[int, int]]] = defaultdict(list)
        kept: Counter[str] = Counter()
        missed: Counter[str] = Counter()
        eagle_k = eagle_draft_length(run.get("config", {}).get("strategies", ()))
        for _, _, arm, rows in run["steps"]:
            if arm in (PREFILL, "plain") or rows is None:
                continue
            for sid, pos, dlen, acc, _, kind in rows:
                # A history step's rows without a long walk draft with EAGLE (its longest k).
                k = strategy(arm).k if kind == strategy(arm).drafter else eagle_k
                right = out.right.setdefault((sid, kind), {})
                for j in range(acc):
                    right[pos + j] = True
                if acc < dlen:
                    right[pos + acc] = False
                    missed[kind] += 1
                kept[kind] += acc
                # A full offer says the drafter had k to give and maybe more; not a history
                # walk's, which stops where its support falls (taken as no longer than seen).
                full = dlen >= k and kind != "history"
                offers[(sid, kind)].append((pos, None if full else dlen, acc))
                if kind == "history" and dlen:
                    walks[sid].append((pos, pos + dlen))
        for key, ev in offers.items():
            ev.sort(key=lambda e: e[0])
            out.offers[key] = ([e[0] for e in ev], [e[1] for e in ev])
            out.kept[key] = [e[2] for e in ev]
        for sid, spans in walks.items():
            spans.sort()
            out.walks[sid] = ([a for a, _ in spans], [b for _, b in spans])
        for d in kept | missed:
            out.alpha[d] = kept[d] / max(1, kept[d] + missed[d])
        return out

    def offer(self, sid: int, drafter: str, pos: int, k: int) -> tuple[int, int]:
        """(drafts the drafter offers, up to k; how many of them it drafted right) at `pos`."""
        if drafter not in self.alpha:
            return 0, 0
        got = self.offers.get((sid, drafter))
        offered, near = k, -1
        if got is not None:
            positions, offs = got
            near = bisect.bisect_left(positions, pos)
            if near == len(positions) or (
                near > 0 and pos - positions[near - 1] < positions[near] - pos
            ):
                near -= 1
            offered = min(k, offs[near] if offs[near] is not None else k)
        right = self.right.get((sid, drafter), {})
        if drafter == "history" and near >= 0:
            return self._walk(sid, pos, offered, right, self.kept[(sid, drafter)][near])
        n = 0
        while n < offered:
            ok = right.get(pos + n)
            if ok is None:
                rng = random.Random(f"{self.seed}/{sid}/{drafter}/{pos + n}")
                ok = rng.random() < self.alpha[drafter]
            if not ok:
                break
            n += 1
        return offered, n

    def _walk(
        self, sid: int, pos: int, offered: int, right: Mapping[int, bool], near_kept: int
    ) -> tuple[int, int]:
        """A history walk at `pos`: from inside a recorded walk it ends where that one did
        (its support fell there) and keeps that one's right tokens; elsewhere it keeps what
        the nearest recorded walk kept. Per-position acceptance says little here: a walk
        offers only what it is sure of, and stops where it is not."""
        starts, ends = self.walks.get(sid, ([], []))
        i = bisect.bisect_right(starts, pos) - 1
        if i < 0 or pos >= ends[i] or pos not in right:
            return offered, min(offered, near_kept)
        offered = min(offered, ends[i] - pos)
        n = 0
        while n < offered and right.get(pos + n):
            n += 1
        return offered, n


def eagle_draft_length(strategies: Sequence[str]) -> int:
    """The EAGLE rows' draft length in a history step: the longest EAGLE arm (0: none)."""
    return max((strategy(n).k for n in strategies if n.startswith("eagle/")), default=0)


# -- the simulation ---------------------------------------------------------------------------


@dataclass
class _Row:
    sid: int
    pos: int  # tokens emitted so far (the first comes from the prefill)
    length: int
    max_new: int
    prompt: int
    key: str = ""  # the prompt's tokens' key (the history drafter's answers are per prompt)


@dataclass
class SimResult:
    """One replayed pass: wall seconds, seconds per running-batch bucket (0 = prefill), steps
    per arm, and the SD row steps and the tokens they gained."""

    seconds: float = 0.0
    per_bucket: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    arms: Counter[str] = field(default_factory=Counter)
    draft_rows: int = 0
    draft_gained: int = 0
    steps: list[float] = field(default_factory=list)  # seconds of every step, prefills too


@dataclass
class _Offers:
    """One SD step's rows: drafts verified, drafts kept, the drafter of each, draft steps."""

    dlens: list[int]
    accs: list[int]
    kinds: list[str]
    draft_steps: int


class Simulator:
    """One engine's passes (its gate lives across them, as in the benchmark and in a worker)
    under `table`. The history arm (drafts from the prompt's earlier answers) is offered as
    the engine offers it: once at least half of the running rows' prompts have a finished
    answer, given at admission (the trace's earlier answers) or finished by this engine."""

    def __init__(self, config: Mapping[str, Any], table: CostTable) -> None:
        strategies = tuple(strategy(n) for n in config["strategies"])
        self.cfg = EngineConfig(
            max_batch=config["max_batch"],
            spec_mode=config["spec_mode"],
            gate=config["gate"],
            strategies=strategies,
            batch_threshold=config["batch_threshold"],
            seed=config["seed"],
            max_prefill_tokens=config.get("max_prefill_tokens", EngineConfig().max_prefill_tokens),
        )
        self.drafter = bool(config["drafter"])
        self.history = any(s.drafter == "history" for s in strategies)
        self.eagle_k = eagle_draft_length(config["strategies"])
        self.table = table
        self.bandit, self.gate_state = gate_for(self.cfg, None)
        self.gate_costs = (
            table.gate_model(self.cfg.bucket_sizes()) if self.cfg.measured_gate else None
        )
        self.answered: set[str] = set()  # prompts with a finished answer in the history
        self.engine: Any = None  # the recorded engine the passes ran on (a worker's count)
        self.versions: list[list[float]] = []  # [s, policy, drafter] of the pass replayed

    def run(self, run: Mapping[str, Any]) -> SimResult:
        """Replay one recorded pass."""
        if run.get("engine") != self.engine:  # a new engine: its history drafter starts empty
            self.engine, self.answered = run.get("engine"), set()
        self.versions = run.get("versions") or [[0.0, 0, int(self.drafter)]]
        drafts = Drafts.of_run(run, self.cfg.seed)
        lengths = {(r, i): n for r, i, n in run["samples"]}
        ids = {(r, i): sid for sid, (r, i, _) in enumerate(run["samples"])}
        waiting = sorted(run["groups"], key=lambda g: g[3])
        running: list[_Row] = []
        res = SimResult()
        while waiting or running:
            admitted = self._admit(waiting, running, res.seconds)
            if admitted:
                width = max(g[1] for g in admitted)
                dt = self.table.prefill_ms(len(admitted), width) / 1000
                res.seconds += dt
                res.per_bucket[0] += dt
                res.steps.append(dt)
                for req, prompt, n, _, max_new, *more in admitted:
                    key = self._opened(*more)
                    for i in range(n):
                        length = lengths.get((req, i), 1)
                        if length > 1:
                            running.append(_Row(ids[(req, i)], 1, length, max_new, prompt, key))
                        else:
                            self.answered.add(key)
                continue
            if not running:  # idle until the next prompt arrives
                res.seconds = max(res.seconds, waiting[0][3])
                continue
            dt = self._step(running, drafts, res)
            res.seconds += dt
            res.steps.append(dt)
            self.answered.update(r.key for r in running if r.pos >= r.length)
            running[:] = [r for r in running if r.pos < r.length]
        return res

    def _opened(self, past: int = 0, key: str = "") -> str:
        """A prompt joins the history drafter (engine: Admission._open): with earlier answers
        (or answers this engine finished), the gate's history estimate restarts once."""
        if self.history and key and (past or key in self.answered):
            self.answered.add(key)
            if self.gate_state is not None:
                self.gate_state.history_arrived()
        return key

    def _admit(self, waiting: list, running: list[_Row], now: float) -> list:
        """FIFO admission of whole prompts while slots and the prefill budget allow (the
        engine's Admission.schedule), among those that have arrived."""
        free = self.cfg.max_batch - len(running)
        admitted: list = []
        width = 0
        while waiting and waiting[0][3] <= now and waiting[0][2] <= free:
            w = max(width, waiting[0][1])
            if admitted and w * (len(admitted) + 1) > self.cfg.max_prefill_tokens:
                break
            admitted.append(waiting.pop(0))
            free -= admitted[-1][2]
            width = w
        return admitted

    def _choose(self, running: list[_Row], now: float) -> Strategy | None:
        """The engine's gate (Speculation.choose) for the running rows at pass time `now`."""
        cfg, b = self.cfg, len(running)
        if cfg.spec_mode == "off" or (not cfg.measured_gate and b > cfg.batch_threshold):
            return None
        available = {"ngram", "eagle"} if self.drafter else {"ngram"}
        if self.history and 2 * sum(r.key in self.answered for r in running) >= b:
            available.add("history")
        i = max(0, bisect.bisect_right([v[0] for v in self.versions], now) - 1)
        versions = (int(self.versions[i][1]), int(self.versions[i][2]))
        return choose_arm(self.bandit, self.gate_state, self.gate_costs, b, available, versions)

    def _step(self, running: list[_Row], drafts: Drafts, res: SimResult) -> float:
        """One decode step of the running rows; returns its seconds."""
        b = len(running)
        context = statistics.fmean(r.prompt + r.pos for r in running)
        cost = self.table.at(b, context)
        arm = self._choose(running, res.seconds)
        bucket = bucket_of(b)
        if arm is None:
            dt = cost.plain_ms / 1000
            for r in running:
                r.pos += 1
            if self.cfg.measured_gate:
                self.bandit.record_plain(b, dt)
            res.arms["plain"] += 1
            res.per_bucket[bucket] += dt
            return dt
        got = self._offers(running, drafts, arm)
        gained = []
        for r, dlen, acc in zip(running, got.dlens, got.accs, strict=True):
            g = min(1 + acc, r.length - r.pos)
            r.pos += g
            gained.append(g)
            if dlen:
                res.draft_rows += 1
                res.draft_gained += g
        dt = step_ms(cost, max(got.dlens), got.draft_steps) / 1000
        if self.gate_state is not None:  # per drafter, as Speculation._observe
            for kind in dict.fromkeys(got.kinds):
                rows = [i for i, k in enumerate(got.kinds) if k == kind]
                self.gate_state.observe(
                    kind, [got.dlens[i] for i in rows], [got.accs[i] for i in rows]
                )
        self.bandit.record(b, arm, sum(gained) / b, dt)
        res.arms[arm.name] += 1
        res.per_bucket[bucket] += dt
        return dt

    def _offers(self, running: list[_Row], drafts: Drafts, arm: Strategy) -> _Offers:
        """Each row's drafts under `arm` (Speculation._propose): up to k within its token cap;
        in a history step, rows whose walk is shorter than HISTORY_MIN_DRAFT draft with EAGLE
        (its longest k) when a drafter is set and `costs.fallback_pays` says so."""
        caps = [max(0, min(arm.k, r.max_new - r.pos - 1)) for r in running]
        got = [
            drafts.offer(r.sid, arm.drafter, r.pos, c) if c else (0, 0)
            for r, c in zip(running, caps, strict=True)
        ]
        kinds = [arm.drafter] * len(running)
        steps = arm.k if arm.drafter == "eagle" else 0
        if arm.drafter == "history" and self.drafter and self.eagle_k:
            short = [i for i, c in enumerate(caps) if c and got[i][0] < min(HISTORY_MIN_DRAFT, c)]
            k = min(self.eagle_k, max(caps))
            if short and self._fallback_pays(running, got, short, k):
                steps = k
                for i in short:
                    got[i] = drafts.offer(running[i].sid, "eagle", running[i].pos, min(caps[i], k))
                    kinds[i] = "eagle"
        return _Offers([d for d, _ in got], [min(a, d) for d, a in got], kinds, steps)

    def _fallback_pays(
        self, running: list[_Row], got: list[tuple[int, int]], short: list[int], k: int
    ) -> bool:
        """Speculation._fallback_pays on the gate's costs (no drafter backlog: the replay does
        not follow the positions EAGLE has yet to read)."""
        if self.gate_costs is None or self.gate_state is None:
            return True
        b = len(running)
        bucket = self.gate_state.bandit.bucket(b)
        cost = self.gate_costs.buckets.get(bucket)
        if cost is None:
            return True
        acceptance = self.gate_state.acceptance
        skip = set(short)
        walks = [d for i, (d, _) in enumerate(got) if i not in skip and d]
        alpha = acceptance["history"].alpha
        return fallback_pays(
            cost, bucket, b,
            history_rows=len(walks),
            history_tokens=sum(expected_tokens(alpha, 1.0, n) for n in walks),
            history_positions=sum(walks),
            fallback_rows=len(short),
            eagle_tokens=acceptance["eagle"].tokens_per_step(k),
            k=k,
        )  # fmt: skip


# -- reading a trace --------------------------------------------------------------------------


Passes = dict[tuple[int, str], list[dict[str, Any]]]


def mean_costs(a: StepCosts, b: StepCosts) -> StepCosts:
    """The mean of two timings of the same step costs (before and after a pass)."""
    models = {
        c: CostModel({n: _mix(m.buckets[n], b.models[c].buckets[n], 0.5) for n in m.buckets}, c)
        for c, m in a.models.items()
    }
    prefill = (_lerp(a.prefill[0], b.prefill[0], 0.5), _lerp(a.prefill[1], b.prefill[1], 0.5))
    return StepCosts(models, prefill)


def load(path: Path) -> tuple[dict[tuple[int, str], StepCosts], Passes]:
    """A trace's step costs per (repeat, mode) (the mean of the timings just before and just
    after that mode's passes), and its passes per (repeat, mode) in order."""
    costs: dict[tuple[int, str], StepCosts] = {}
    runs: Passes = defaultdict(list)
    for line in read_trace(path):
        if line["type"] == "costs":
            key = (line["rep"], line["mode"])
            got = StepCosts.from_dict(line)
            costs[key] = mean_costs(costs[key], got) if key in costs else got
        elif line["type"] == "run":
            runs[(line["rep"], line["mode"])].append(line)
    return costs, runs


def replay(passes: list[dict[str, Any]], table: CostTable) -> list[tuple[dict, SimResult]]:
    """Every pass of one engine (warm ones first) through one simulator: (pass, result) of the
    timed ones."""
    sim = Simulator(passes[0]["config"], table)
    out = []
    for p in passes:
        res = sim.run(p)
        if p.get("warm") is None:
            out.append((p, res))
    return out


@dataclass(frozen=True)
class Step:
    """One recorded engine step as the replay prices it: its seconds, running batch, the rows'
    mean context (prompt + tokens emitted before the step), its arm (PREFILL, "plain" or a
    strategy), the most drafts a row verified (0: none), for a prefill its prompts and padded
    width, and the EAGLE draft steps it ran (an EAGLE arm's k; a history step's longest EAGLE k
    when some row drafted with EAGLE)."""

    seconds: float
    batch: int
    context: float
    arm: str
    width: int = 0
    prompts: int = 0
    draft_steps: int = 0


def recorded_steps(p: Mapping[str, Any]) -> list[Step]:
    """A recorded pass's steps, each row's position followed through the pass as the replay
    does (a prefill admits its prompts' samples longer than one token at position 1; a plain
    step adds a token to every row; an SD step's rows say where they stood and what they
    gained), so that plain steps have a context too."""
    prompts = {g[0]: g[1] for g in p["groups"]}
    n = {g[0]: g[2] for g in p["groups"]}
    lengths = {(r, i): k for r, i, k in p["samples"]}
    ids = {(r, i): sid for sid, (r, i, _) in enumerate(p["samples"])}
    eagle_k = eagle_draft_length(p["config"]["strategies"])
    running: dict[int, list[int]] = {}  # sample -> [prompt, position, length]
    out = []
    for seconds, batch, arm, rows in p["steps"]:
        if arm == PREFILL:
            for r in rows:
                for i in range(n[r]):
                    if lengths.get((r, i), 1) > 1:
                        running[ids[(r, i)]] = [prompts[r], 1, lengths[(r, i)]]
            width = max(prompts[r] for r in rows)
            out.append(Step(seconds, batch, 0.0, PREFILL, width, len(rows)))
            continue
        for sid, pos, *_ in rows or ():
            running[sid][1] = pos
        context = statistics.fmean(v[0] + v[1] for v in running.values()) if running else 0.0
        if arm == "plain" or rows is None:
            for v in running.values():
                v[1] += 1
            out.append(Step(seconds, batch, context, "plain"))
        else:
            for sid, pos, _, _, gained, _ in rows:
                running[sid][1] = pos + gained
            k = strategy(arm).k if arm.startswith("eagle/") else 0
            k = eagle_k if any(r[5] == "eagle" for r in rows) and not k else k
            out.append(Step(seconds, batch, context, arm, max(r[2] for r in rows), 0, k))
        running = {sid: v for sid, v in running.items() if v[1] < v[2]}
    return out


def step_costs(p: Mapping[str, Any], table: CostTable) -> list[tuple[float, float]]:
    """(measured, predicted) seconds of every recorded step: the table's cost of the step as
    the engine took it (its batch, the rows' mean context, its arm and widest draft)."""
    out = []
    for s in recorded_steps(p):
        if s.arm == PREFILL:
            out.append((s.seconds, table.prefill_ms(s.prompts, s.width) / 1000))
            continue
        ms = step_ms(table.at(s.batch, s.context), s.width, s.draft_steps)
        out.append((s.seconds, ms / 1000))
    return out


# -- costs fitted on recorded steps -----------------------------------------------------------

# A decode step's ms, linear in these terms (B rows, C = mean context / 1000, w the most drafts
# a row verified, k EAGLE draft steps): a plain step, what verifying w drafts adds, drafting.
FIT_TERMS = ("1", "B", "B*C", "SD", "B*w", "B*w*C", "k", "k*B")


def _terms(batch: int, context: float, width: int, draft_steps: int) -> list[float]:
    b, c, k = float(batch), context / 1000, draft_steps
    if width == 0:
        return [1.0, b, b * c, 0.0, 0.0, 0.0, 0.0, 0.0]
    return [1.0, b, b * c, 1.0, b * width, b * width * c, k, k * b]


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with no negative coefficient: the most negative term is dropped and the
    rest refitted until none is (a cost cannot fall as batch, context or drafts grow)."""
    keep = list(range(x.shape[1]))
    while True:
        coef = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if not keep or coef.min() >= 0:
            break
        keep.pop(int(coef.argmin()))
    out = np.zeros(x.shape[1])
    out[keep] = coef
    return out


def fitted_table(passes: Sequence[Mapping[str, Any]], label: str = "in-run") -> CostTable:
    """The cost table of the engine's own recorded steps: least squares (nonnegative) of every
    decode step's wall ms on `FIT_TERMS`, which are exactly the engine's `BucketCost` form
    (plain, verify per width, draft per step), so `at` is that fit at any batch and context;
    a prefill's ms per padded prompt position is their recorded total over their positions.
    Seconds are fitted, not their ratios: a wall time is the sum of its steps'."""
    steps = [s for p in passes for s in recorded_steps(p)]
    decode = [s for s in steps if s.arm != PREFILL]
    x = np.array([_terms(s.batch, s.context, s.width, s.draft_steps) for s in decode])
    coef = _nonnegative_fit(x, np.array([1000 * s.seconds for s in decode]))
    p0, p1, p2, v0, v1, v2, d0, d1 = (float(c) for c in coef)
    ks = [strategy(n).k for p in passes for n in p["config"]["strategies"]] or [1]
    batches = sorted({1, *(1 << i for i in range(max(s.batch for s in decode).bit_length()))})

    def bucket(b: int, context: int) -> BucketCost:
        c = context / 1000
        plain = p0 + p1 * b + p2 * b * c
        verify = {w + 1: plain + v0 + v1 * b * w + v2 * b * w * c for w in range(1, max(ks) + 1)}
        return BucketCost(plain, verify, d0 + d1 * b)

    # The fit is bilinear in batch and context: CostTable's interpolation between two
    # contexts and any batch sizes reproduces it exactly.
    models = {c: CostModel({b: bucket(b, c) for b in batches}, c) for c in (0, 1024)}
    pre = [s for s in steps if s.arm == PREFILL]
    positions = max(1, sum(s.prompts * s.width for s in pre))
    per_position = sum(1000 * s.seconds for s in pre) / positions
    return CostTable(
        models,
        lambda prompts, width: per_position * prompts * width,
        label,
        dict(zip(FIT_TERMS, coef.tolist(), strict=True)),
    )


def measured(p: Mapping[str, Any]) -> tuple[float, dict[int, float]]:
    """A recorded pass's summed step seconds, and per running-batch bucket (0 = prefill)."""
    per: dict[int, float] = defaultdict(float)
    for seconds, batch, arm, _ in p["steps"]:
        per[0 if arm == PREFILL else bucket_of(batch)] += seconds
    return sum(per.values()), per


# -- validation and projection ----------------------------------------------------------------


def _q(xs: Sequence[float], f: float) -> float:
    return xs[min(len(xs) - 1, int(f * len(xs)))] if xs else float("nan")


def _pct(sim: float, real: float) -> str:
    return f"{100 * (sim / real - 1):+.1f}%" if real else "-"


def cross_fitted(runs: Passes) -> dict[int, CostTable]:
    """Per repeat, `fitted_table` on every pass of the other repeats (none with one repeat):
    held out, so that no pass is priced by costs fitted on its own steps."""
    reps = sorted({r for r, _ in runs})
    return {
        rep: fitted_table(
            [p for (r, _), ps in runs.items() if r != rep for p in ps],
            "repeat " + "+".join(str(r + 1) for r in reps if r != rep),
        )
        for rep in reps
        if len(reps) > 1
    }


@dataclass
class _Checked:
    """One timed pass replayed under one cost table, and its recorded steps priced by it."""

    p: dict[str, Any]
    res: SimResult
    pairs: list[tuple[float, float]]  # (measured, the table's) seconds per recorded step


def _check(passes: list[dict[str, Any]], table: CostTable) -> list[_Checked]:
    out = []
    for p, res in replay(passes, table):
        # SD off: the replay takes the recorded steps one for one (same batches and contexts);
        # otherwise each recorded step as the engine took it, at the table's costs.
        if p["config"]["spec_mode"] == "off":
            pairs = [(s[0], c) for s, c in zip(p["steps"], res.steps, strict=True)]
        else:
            pairs = step_costs(p, table)
        out.append(_Checked(p, res, pairs))
    return out


def _fit_line_text(t: CostTable) -> str:
    f = t.fit or {}
    return (
        f"plain {f['1']:.2f} + {f['B']:.3f} B + {f['B*C']:.3f} B*C ms; an SD step verifying w "
        f"drafts a row adds {f['SD']:.2f} + {f['B*w']:.3f} B*w + {f['B*w*C']:.3f} B*w*C, and "
        f"k EAGLE draft steps k x ({f['k']:.3f} + {f['k*B']:.3f} B) (B rows, C mean context / "
        "1000)"
    )


def validate(path: Path, tolerance: float = 0.10) -> bool:
    """Per repeat and mode, the recorded wall time against its replay under two cost sources:
    `isolated`, whole engine steps timed just before and after that mode's passes in that
    repeat (rollout_trace.measure_step_costs); `in-run`, `fitted_table` on the recorded steps
    of the OTHER repeats (every pass, warm ones included, both modes): cross-fitted, no run is
    priced by costs fitted on itself. Then the ratio of SD off to each other mode, the recorded
    steps priced at each table (the per-step error), and per bucket the same. True when every
    run and every ratio is within `tolerance` under the in-run costs (under the isolated ones
    where the trace has a single repeat)."""
    costs, runs = load(path)
    reps = sorted({r for r, _ in runs})
    fits = cross_fitted(runs)
    sources = {
        "isolated": {
            k: _check(ps, measured_table(costs[k])) for k, ps in runs.items() if k in costs
        },
        "in-run": {k: _check(ps, fits[k[0]]) for k, ps in runs.items() if k[0] in fits},
    }
    names = [n for n, got in sources.items() if got]
    if not names:
        print(f"{path}: no step costs and a single repeat: nothing to price the runs with")
        return False
    within = {n: [0, 0, 0, 0] for n in names}  # runs within, runs, ratios within, ratios

    def err(name: str, real: float, sim: float, slot: int, unit: str = "") -> str:
        within[name][slot] += abs(sim / real - 1) <= tolerance
        within[name][slot + 1] += 1
        return f"{sim:.2f}{unit} | {_pct(sim, real)}"

    head = " | ".join(f"{n} costs: simulated | error" for n in names)
    rows, ratios = [], []
    for rep in reps:
        real: dict[str, float] = {}  # mode -> measured wall s
        sim: dict[str, dict[str, float]] = defaultdict(dict)  # cost source -> mode -> s
        for (r, mode), passes in runs.items():
            if r != rep:
                continue
            for i, p in enumerate(q for q in passes if q.get("warm") is None):
                real[mode] = p["seconds"]
                cells = []
                for n in names:
                    got = sources[n].get((r, mode))
                    if got:
                        sim[n][mode] = got[i].res.seconds
                        cells.append(err(n, p["seconds"], got[i].res.seconds, 0))
                    else:
                        cells.append("- | -")
                rows.append(
                    f"| {rep + 1} | {mode} | {p['seconds']:.2f} | {measured(p)[0]:.2f} | "
                    + " | ".join(cells) + " |"
                )  # fmt: skip
        for mode in [m for m in real if m != "off" and "off" in real]:
            cells = [
                err(n, real["off"] / real[mode], sim[n]["off"] / sim[n][mode], 2, "x")
                if "off" in sim[n] and mode in sim[n]
                else "- | -"
                for n in names
            ]
            ratios.append(
                f"| {rep + 1} | off / {mode} | {real['off'] / real[mode]:.2f}x | "
                + " | ".join(cells) + " |"
            )  # fmt: skip

    in_run = "fitted on the other repeat's recorded steps" if fits else "none: a single repeat"
    print(f"replay of {path}: isolated costs (whole steps timed before and after each pass), "
          f"in-run costs ({in_run})\n")  # fmt: skip
    print(f"| repeat | mode | measured wall s | of which engine steps | {head} |")
    print("|---:|---|---:|---:|" + "---:|---:|" * len(names))
    print("\n".join(rows))
    print(f"\n| repeat | ratio | measured | {head} |\n|---:|---|---:|" + "---:|---:|" * len(names))
    print("\n".join(ratios))
    for rep, t in fits.items():
        print(f"\nin-run costs for repeat {rep + 1}, fitted on {t.label}: {_fit_line_text(t)}")
    print("\nper step: the recorded steps priced at the table's costs")
    print(
        "| repeat | mode | costs | decode steps measured / sim | SD steps measured / sim "
        "| recorded steps at the table's costs | per step measured / table p10 / p50 / p90 |"
    )
    print("|---:|---|---|---:|---:|---:|---:|")  # fmt: skip
    lines = []
    for rep, mode in runs:
        for n in names:
            for c in sources[n].get((rep, mode), []):
                steps_s, per = measured(c.p)
                per_step = sorted(m / t for m, t in c.pairs if t > 0)
                sd = sum(1 for s in c.p["steps"] if s[2] not in ("plain", PREFILL))
                n_steps = sum(1 for s in c.p["steps"] if s[2] != PREFILL)
                sim_sd = sum(k for a, k in c.res.arms.items() if a != "plain")
                print(
                    f"| {rep + 1} | {mode} | {n} | {n_steps} / {sum(c.res.arms.values())} "
                    f"| {sd} / {sim_sd} | {_pct(sum(t for _, t in c.pairs), steps_s)} "
                    f"| {_q(per_step, 0.1):.2f} / {_q(per_step, 0.5):.2f} / "
                    f"{_q(per_step, 0.9):.2f} |"
                )
                keys = sorted(set(per) | set(c.res.per_bucket))
                lines.append(f"  repeat {rep + 1} {mode}, {n} costs: " + ", ".join(
                    f"{'prefill' if b == 0 else f'<={b}'} {per.get(b, 0.0):.2f} / "
                    f"{c.res.per_bucket.get(b, 0.0):.2f} "
                    f"({_pct(c.res.per_bucket.get(b, 0.0), per.get(b, 0.0))})"
                    for b in keys
                ))  # fmt: skip
    print("\nper running-batch bucket (0 = prefill): measured / simulated seconds (error)")
    print("\n".join(lines))
    print()
    for n in names:
        a, b, c, d = within[n]
        verdict = "yes" if a == b and c == d else "NO"
        print(f"{n} costs within +-{100 * tolerance:.0f}% (every run and ratio): {verdict} "
              f"({a} of {b} runs, {c} of {d} ratios)")  # fmt: skip
    gate = within["in-run" if "in-run" in within else names[0]]
    return gate[0] == gate[1] and gate[2] == gate[3]


def gpu_table(device: str, shape: str, ks: Sequence[int], batches: Sequence[int]) -> CostTable:
    """PROJECTION: gpu_model's roofline costs of `shape` on `device` as a cost table."""
    from benchmarks import gpu_model as g

    dev, shp = g.DEVICES[device], g.SHAPES[shape]
    models = {c: g.cost_model(dev, shp, batches, c, ks) for c in (64, 1024, 2048)}
    return CostTable(
        models,
        lambda prompts, width: g.forward_ms(dev, shp, prompts, width, width),
        f"{device} {shape} (projection)",
    )


def project(path: Path, devices: Sequence[str], shapes: Sequence[str]) -> None:
    """PROJECTION: the recorded SD-off and TLT (adaptive) passes replayed under gpu_model's
    costs; the rollout speedup per device x policy shape, per repeat and on the measured CPU
    costs beside them."""
    costs, runs = load(path)
    reps = sorted({r for r, m in runs if m == "adaptive" and (r, "off") in runs})
    cfg = runs[(reps[0], "adaptive")][0]["config"]
    ks = sorted({strategy(n).k for n in cfg["strategies"]})
    batches = EngineConfig(max_batch=cfg["max_batch"]).bucket_sizes()
    lengths = sorted(n for _, _, n in runs[(reps[0], "off")][-1]["samples"])
    q = lambda f: lengths[min(len(lengths) - 1, int(f * len(lengths)))]  # noqa: E731
    print(f"PROJECTION (not a measurement): the trace's passes ({len(lengths)} samples, "
          f"lengths p50 {q(0.5)}, p90 {q(0.9)}, max {lengths[-1]}; acceptance as recorded) "
          "replayed under gpu_model's roofline costs, the engine's gate deciding from "
          "them\n")  # fmt: skip
    print(
        "| costs | SD-off rollout s | TLT rollout s | TLT rollout speedup | TLT's SD step share |"
    )
    print("|---|---:|---:|---:|---:|")
    for rep in reps:
        real = [runs[(rep, m)][-1]["seconds"] for m in ("off", "adaptive")]
        print(f"| this CPU, repeat {rep + 1} (measured) | {real[0]:.3f} | {real[1]:.3f} "
              f"| {real[0] / real[1]:.2f}x | - |")  # fmt: skip
    tables = [(f"this CPU, repeat {r + 1} (simulated, measured costs)",
               measured_table(costs[(r, "adaptive")]), r) for r in reps]  # fmt: skip
    tables += [(gpu_table(d, s, ks, batches).label, gpu_table(d, s, ks, batches), rep)
               for d in devices for s in shapes for rep in reps]  # fmt: skip
    for label, table, rep in tables:
        off = replay(runs[(rep, "off")], table)[-1][1]
        tlt = replay(runs[(rep, "adaptive")], table)[-1][1]
        label = f"{label}, repeat {rep + 1}" if "projection" in label else label
        sd = sum(n for a, n in tlt.arms.items() if a != "plain") / max(1, sum(tlt.arms.values()))
        print(f"| {label} | {off.seconds:.3f} | {tlt.seconds:.3f} "
              f"| {off.seconds / tlt.seconds:.2f}x | {100 * sd:.0f}% |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="replay under isolated and in-run (held-out) step costs")
    v.add_argument("trace", type=Path)
    v.add_argument("--tolerance", type=float, default=0.10)
    pr = sub.add_parser("project", help="PROJECTION: replay under gpu_model's H100/H200 costs")
    pr.add_argument("trace", type=Path)
    pr.add_argument("--devices", default="H100,H200")
    pr.add_argument("--shapes", default="Qwen2.5-1.5B,Qwen2.5-7B,Qwen2.5-32B")
    args = ap.parse_args(argv)
    if args.cmd == "validate" and args.trace.is_dir():  # a demo's (grpo_demo.py --trace DIR)
        from benchmarks.sim_demo import validate_demo

        return 0 if validate_demo(args.trace, args.tolerance) else 1
    if args.cmd == "validate":
        return 0 if validate(args.trace, args.tolerance) else 1
    if args.trace.is_dir():
        from benchmarks.sim_demo import project_demo

        project_demo(args.trace, args.devices.split(","), args.shapes.split(","))
        return 0
    project(args.trace, args.devices.split(","), args.shapes.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
