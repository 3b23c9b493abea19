"""Replay recorded rollouts under a device's step costs: continuous batching with the engine's gate.

    python benchmarks/sim_rollout.py validate TRACE     # vs the wall times the trace measured
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

`validate` feeds the step costs timed in the same run (rollout_trace.measure_step_costs) and
prints, per run and per running-batch bucket, measured against simulated wall time.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rollout_trace import PREFILL, StepCosts, read_trace, strategy  # noqa: E402
from tltd_workers.engine.bandit import Strategy  # noqa: E402
from tltd_workers.engine.costs import BucketCost, CostModel  # noqa: E402
from tltd_workers.engine.engine import EngineConfig, gate_for  # noqa: E402
from tltd_workers.engine.gate import choose_arm  # noqa: E402

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
    drafts the drafter offers (an n-gram match may be short) comes from the sample's
    nearest recorded step."""

    seed: int = 0
    right: dict[tuple[int, str], dict[int, bool]] = field(default_factory=dict)
    offers: dict[tuple[int, str], tuple[list[int], list[int | None]]] = field(default_factory=dict)
    alpha: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def of_run(run: Mapping[str, Any], seed: int = 0) -> Drafts:
        out = Drafts(seed)
        offers: dict[tuple[int, str], list[tuple[int, int | None]]] = defaultdict(list)
        kept: Counter[str] = Counter()
        missed: Counter[str] = Counter()
        for _, _, arm, rows in run["steps"]:
            if arm in (PREFILL, "plain") or rows is None:
                continue
            k = strategy(arm).k
            for sid, pos, dlen, acc, _, kind in rows:
                right = out.right.setdefault((sid, kind), {})
                for j in range(acc):
                    right[pos + j] = True
                if acc < dlen:
                    right[pos + acc] = False
                    missed[kind] += 1
                kept[kind] += acc
                offers[(sid, kind)].append((pos, dlen if dlen < k else None))
        for key, ev in offers.items():
            ev.sort(key=lambda e: e[0])
            out.offers[key] = ([p for p, _ in ev], [o for _, o in ev])
        for d in kept | missed:
            out.alpha[d] = kept[d] / max(1, kept[d] + missed[d])
        return out

    def offer(self, sid: int, drafter: str, pos: int, k: int) -> tuple[int, int]:
        """(drafts the drafter offers, up to k; how many of them it drafted right) at `pos`."""
        if drafter not in self.alpha:
            return 0, 0
        got = self.offers.get((sid, drafter))
        offered = k
        if got is not None:
            positions, offs = got
            i = bisect.bisect_left(positions, pos)
            if i == len(positions) or (i > 0 and pos - positions[i - 1] < positions[i] - pos):
                i -= 1
            offered = min(k, offs[i] if offs[i] is not None else k)
        right = self.right.get((sid, drafter), {})
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


# -- the simulation ---------------------------------------------------------------------------


@dataclass
class _Row:
    sid: int
    pos: int  # tokens emitted so far (the first comes from the prefill)
    length: int
    max_new: int
    prompt: int


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


class Simulator:
    """One engine's passes (its gate lives across them, as in the benchmark) under `table`."""

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
        self.table = table
        self.bandit, self.gate_state = gate_for(self.cfg, None)
        self.gate_costs = (
            table.gate_model(self.cfg.bucket_sizes()) if self.cfg.measured_gate else None
        )

    def run(self, run: Mapping[str, Any]) -> SimResult:
        """Replay one recorded pass."""
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
                for req, prompt, n, _, max_new in admitted:
                    for i in range(n):
                        length = lengths.get((req, i), 1)
                        if length > 1:
                            running.append(_Row(ids[(req, i)], 1, length, max_new, prompt))
                continue
            if not running:  # idle until the next prompt arrives
                res.seconds = max(res.seconds, waiting[0][3])
                continue
            dt = self._step(running, drafts, res)
            res.seconds += dt
            res.steps.append(dt)
            running[:] = [r for r in running if r.pos < r.length]
        return res

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

    def _choose(self, b: int) -> Strategy | None:
        """The engine's gate (Speculation.choose) for a batch of b speculative rows."""
        cfg = self.cfg
        if cfg.spec_mode == "off" or (not cfg.measured_gate and b > cfg.batch_threshold):
            return None
        available = {"ngram", "eagle"} if self.drafter else {"ngram"}
        return choose_arm(
            self.bandit, self.gate_state, self.gate_costs, b, available, (0, int(self.drafter))
        )

    def _step(self, running: list[_Row], drafts: Drafts, res: SimResult) -> float:
        """One decode step of the running rows; returns its seconds."""
        b = len(running)
        context = statistics.fmean(r.prompt + r.pos for r in running)
        cost = self.table.at(b, context)
        arm = self._choose(b)
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
        dlens, accs, gained = [], [], []
        for r in running:
            cap = max(0, min(arm.k, r.max_new - r.pos - 1))
            dlen, match = drafts.offer(r.sid, arm.drafter, r.pos, cap) if cap else (0, 0)
            acc = min(match, dlen)
            g = min(1 + acc, r.length - r.pos)
            r.pos += g
            dlens.append(dlen)
            accs.append(acc)
            gained.append(g)
            if dlen:
                res.draft_rows += 1
                res.draft_gained += g
        draft = arm.k * cost.draft_ms if arm.drafter == "eagle" else 0.0
        dt = (cost.verify(max(dlens)) + draft) / 1000 if max(dlens) else cost.plain_ms / 1000
        if self.gate_state is not None:
            self.gate_state.observe(arm.drafter, dlens, accs)
        self.bandit.record(b, arm, sum(gained) / b, dt)
        res.arms[arm.name] += 1
        res.per_bucket[bucket] += dt
        return dt


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


def step_costs(p: Mapping[str, Any], table: CostTable) -> list[tuple[float, float]]:
    """(measured, predicted) seconds of every recorded step: the table's cost of the step as
    the engine took it (its batch, the rows' mean context, its arm and widest draft)."""
    prompts = {g[0]: g[1] for g in p["groups"]}
    prompt_of = [prompts[r] for r, _, _ in p["samples"]]
    rows_at = [prompt_of[0]]
    out = []
    for seconds, batch, arm, rows in p["steps"]:
        if arm == PREFILL:
            width = max(prompts[r] for r in rows)
            out.append((seconds, table.prefill_ms(len(rows), width) / 1000))
            continue
        if rows is not None:
            rows_at = [prompt_of[sid] + pos for sid, pos, *_ in rows]
        cost = table.at(batch, statistics.fmean(rows_at))  # plain: the last SD step's context
        if arm == "plain" or rows is None:
            out.append((seconds, cost.plain_ms / 1000))
            continue
        s, width = strategy(arm), max(r[2] for r in rows)
        draft = s.k * cost.draft_ms if s.drafter == "eagle" else 0.0
        out.append(
            (seconds, (cost.verify(width) + draft) / 1000 if width else cost.plain_ms / 1000)
        )
    return out


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


def validate(path: Path, tolerance: float = 0.10) -> bool:
    """Per repeat and mode: the recorded wall time against the replay under the step costs timed
    in that repeat; the ratio of SD off to each other mode; per bucket the same. True when every
    run and every ratio is within `tolerance`."""
    costs, runs = load(path)
    ok = True
    rows, ratios, buckets = [], [], []
    for rep in sorted({r for r, _ in runs}):
        walls: dict[str, tuple[float, float]] = {}
        for (r, mode), passes in runs.items():
            if r != rep:
                continue
            table = measured_table(costs[(rep, mode)])
            for p, res in replay(passes, table):
                steps_s, per = measured(p)
                # SD off: the replay takes the recorded steps one for one (same batches and
                # contexts); otherwise each recorded step as the engine took it, at table costs.
                if p["config"]["spec_mode"] == "off":
                    pairs = [(s[0], c) for s, c in zip(p["steps"], res.steps, strict=True)]
                else:
                    pairs = step_costs(p, table)
                per_step = sorted(m / c for m, c in pairs if c > 0)
                fixed = sum(c for _, c in pairs)
                walls[mode] = (p["seconds"], res.seconds)
                err = res.seconds / p["seconds"] - 1
                ok &= abs(err) <= tolerance
                sd = sum(1 for s in p["steps"] if s[2] not in ("plain", PREFILL))
                n_steps = sum(1 for s in p["steps"] if s[2] != PREFILL)
                rows.append(
                    f"| {rep + 1} | {mode} | {p['seconds']:.2f} | {steps_s:.2f} "
                    f"| {res.seconds:.2f} "
                    f"| {100 * err:+.1f}% | {n_steps} / {sum(res.arms.values())} "
                    f"| {sd} / {sum(n for a, n in res.arms.items() if a != 'plain')} "
                    f"| {_pct(fixed, steps_s)} | {_q(per_step, 0.1):.2f} / {_q(per_step, 0.5):.2f}"
                    f" / {_q(per_step, 0.9):.2f} |"
                )
                cells = [
                    f"{per.get(b, 0.0):.2f} / {res.per_bucket.get(b, 0.0):.2f} "
                    f"({_pct(res.per_bucket.get(b, 0.0), per.get(b, 0.0))})"
                    for b in sorted(set(per) | set(res.per_bucket))
                ]
                keys = sorted(set(per) | set(res.per_bucket))
                buckets.append((rep, mode, keys, cells))
        base = walls.get("off")
        for mode, (real, sim) in walls.items():
            if mode == "off" or base is None:
                continue
            r_real, r_sim = base[0] / real, base[1] / sim
            ok &= abs(r_sim / r_real - 1) <= tolerance
            ratios.append(
                f"| {rep + 1} | off / {mode} | {r_real:.2f}x | {r_sim:.2f}x "
                f"| {_pct(r_sim, r_real)} |"
            )
    print(f"replay of {path} under the step costs timed in the same run (per repeat)\n")
    print("| repeat | mode | measured wall s | of which engine steps | simulated s | error "
          "| decode steps measured / sim | SD steps measured / sim | recorded steps at the "
          "table's costs | per step measured / table p10 / p50 / p90 |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print("\n| repeat | ratio | measured | simulated | error |\n|---:|---|---:|---:|---:|")
    print("\n".join(ratios))
    print("\nper running-batch bucket (0 = prefill): measured / simulated seconds (error)")
    for rep, mode, keys, cells in buckets:
        print(f"  repeat {rep + 1} {mode}: " + ", ".join(
            f"{'prefill' if b == 0 else f'<={b}'} {c}" for b, c in zip(keys, cells, strict=True)
        ))  # fmt: skip
    print(f"\nwithin +-{100 * tolerance:.0f}% (every run and ratio): {'yes' if ok else 'NO'}")
    return ok


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
    v = sub.add_parser("validate", help="replay under the step costs timed in the same run")
    v.add_argument("trace", type=Path)
    v.add_argument("--tolerance", type=float, default=0.10)
    pr = sub.add_parser("project", help="PROJECTION: replay under gpu_model's H100/H200 costs")
    pr.add_argument("trace", type=Path)
    pr.add_argument("--devices", default="H100,H200")
    pr.add_argument("--shapes", default="Qwen2.5-1.5B,Qwen2.5-7B,Qwen2.5-32B")
    args = ap.parse_args(argv)
    if args.cmd == "validate":
        return 0 if validate(args.trace, args.tolerance) else 1
    project(args.trace, args.devices.split(","), args.shapes.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
