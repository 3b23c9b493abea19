"""Speculative decoding on the long-tail rollout workload: off / n-gram / EAGLE / adaptive / history

Workload: `--prompts` prompts of the count-up task x `--samples` samples at temperature 1,
stop at <eos> or `--max-new-tokens` (examples/task/workload.py). Answer lengths are long-tailed
per prompt (problem size, and care: by default half the prompts at care 4, half at 8) and per
sample (the policy re-checks its work a random number of times, at rate care / 10). The length
quantiles and the share of SD-off time per running-batch bucket are printed above the table,
the per-bucket gain of each mode below it. Modes run
interleaved, `--repeats` times each; every figure is the median over the repeats, with the
spread (min-max) beside it.

`--epochs E` rolls the same prompts out E times through each mode's one engine (as an RL job
revisits its prompts every epoch; new seeds each epoch, the policy unchanged): one table per
epoch, and for the history mode its drafter's accepted length and draft share per bucket and
where each bucket's time went.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rollout_trace import Recorder, measure_step_costs, write_line  # noqa: E402
from examples.task.reasoning import reward  # noqa: E402
from examples.task.tokenizer import decode, load_tokenizer  # noqa: E402
from examples.task.workload import (  # noqa: E402
    MAX_NEW_TOKENS,
    MODEL_DIR,
    STOP_TOKEN_ID,
    WORKLOAD_CARE,
    rollout_prompts,
)
from tltd.domain import FinishReason, SamplingParams  # noqa: E402
from tltd_workers.engine.bandit import Strategy  # noqa: E402
from tltd_workers.engine.datatypes import HISTORY_DRAFT_LENGTHS  # noqa: E402
from tltd_workers.engine.eagle import EagleDrafter  # noqa: E402
from tltd_workers.engine.engine import Engine, EngineConfig, Request, SampleOutput  # noqa: E402
from tltd_workers.engine.transformer import CausalLM, load_model  # noqa: E402

DEFAULT_DRAFTER = Path(__file__).resolve().parents[1] / "models" / "tiny-policy-eagle"
KS = (2, 4, 6)
# mode -> (drafters, gate): "threshold" speculates at running batch <= --threshold (TLT's GPU
# setting, 32); "measured" wherever the engine's measured costs say speculation pays.
MODES: dict[str, tuple[tuple[str, ...], str]] = {
    "off": ((), "threshold"),
    "ngram": (("ngram",), "measured"),  # TLT-Base: the model-free drafter only
    "eagle": (("eagle",), "measured"),
    "adaptive": (("ngram", "eagle"), "measured"),  # TLT: both drafters, bandit per bucket
    "adaptive@32": (("ngram", "eagle"), "threshold"),  # ablation: the fixed GPU gate
    # adaptive + drafts from the prompt's earlier answers (previous epochs, live siblings)
    "history": (("ngram", "eagle", "history"), "measured"),
}
# Engine time per bucket, from its stats: what a step spends drafting, verifying (the target
# forward, the accept rule and emitting), decoding plainly; "other" is the rest of the step.
PHASES = ("draft", "verify", "plain")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def bucket_of(batch: int) -> int:
    """Running-batch bucket: the smallest power of two >= batch."""
    return 1 << max(0, batch - 1).bit_length()


@dataclass
class Run:
    """One timed pass of the workload in one mode."""

    mode: str
    seconds: float
    outputs: list[SampleOutput]
    reward: float
    summary: dict
    bandit: dict
    gate: dict
    # running-batch bucket -> [decode seconds, tokens emitted]; bucket 0 = prefill
    per_bucket: dict[int, list[float]] = field(default_factory=dict)
    # bucket -> row steps, history draft rows, history accepted drafts, draft/verify/plain s,
    # steps
    detail: dict[int, list[float]] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


def requests_for(work: list, args: argparse.Namespace, tag: str, seed: int) -> list[Request]:
    """One engine request per prompt, `args.samples` seeded samples each."""
    return [
        Request(
            f"{tag}{i}",
            p,
            SamplingParams(
                n=args.samples,
                temperature=args.temperature,
                max_new_tokens=args.max_new_tokens,
                stop_token_ids=(STOP_TOKEN_ID,),
                seed=seed + i,
            ),
            prompt_index=i,
        )
        for i, (_, p) in enumerate(work)
    ]


def _counters(engine: Engine) -> list[float]:
    """History draft rows and accepted drafts, and the engine's draft/verify/plain seconds."""
    st = engine.stats
    return [
        st.drafter_rows["history"],
        st.drafter_accepted["history"],
        st.draft_seconds,
        st.verify_seconds,
        st.plain_seconds,
    ]


def timed_generate(
    engine: Engine, requests: list[Request], recorder: Recorder | None = None
) -> tuple[list[SampleOutput], dict[int, list[float]], dict[int, list[float]]]:
    """Run `requests` to completion, timing every engine step by its running-batch bucket;
    also per bucket: row steps, the history drafter's draft rows and accepted drafts, and the
    engine's draft / verify / plain seconds (Run.detail). `recorder`: a trace of every step
    (rollout_trace.py)."""
    for r in requests:
        engine.add_request(r.request_id, r.prompt_ids, r.sampling, prompt_index=r.prompt_index)
    outs: list[SampleOutput] = []
    per_bucket: dict[int, list[float]] = {}
    detail: dict[int, list[float]] = {}
    while engine.has_work():
        batch = len(engine.running)
        before = sum(len(s.tokens) for s in engine.running)
        counters = _counters(engine)
        if recorder is not None:
            recorder.before()
        t0 = time.perf_counter()
        done = engine.step()
        seconds = time.perf_counter() - t0
        if recorder is not None:
            recorder.after(seconds, done)
        after = sum(len(s.tokens) for s in engine.running) + sum(len(o.token_ids) for o in done)
        # A step that admitted prompts prefilled them (and decoded nothing).
        key = 0 if engine.running and len(engine.running) > batch else bucket_of(max(batch, 1))
        cell = per_bucket.setdefault(key, [0.0, 0.0])
        cell[0] += seconds
        cell[1] += after - before
        more = detail.setdefault(key, [0.0] * 7)
        more[0] += batch if key else 0
        more[6] += 1
        for j, (a, b) in enumerate(zip(counters, _counters(engine), strict=True)):
            more[1 + j] += b - a
        outs.extend(done)
    return outs, per_bucket, detail


def make_engine(
    mode: str, model: CausalLM, drafter: EagleDrafter | None, max_batch: int, max_seq: int,
    args: argparse.Namespace,
) -> Engine:  # fmt: skip
    """A fresh engine for one mode (its bandit and cost estimates start empty)."""
    drafters, gate = MODES[mode]
    strategies = tuple(
        Strategy(d, k) for d in drafters for k in (args.history_ks if d == "history" else args.ks)
    )
    engine = Engine(
        model,
        EngineConfig(
            max_batch=max_batch,
            max_seq_len=max_seq,
            spec_mode="adaptive" if drafters else "off",
            gate=gate,
            strategies=strategies or EngineConfig().strategies,
            batch_threshold=args.threshold,
            draft_confidence=args.confidence,
            seed=args.seed,
            dtype=DTYPES[args.dtype],
            device=args.device,
        ),
    )
    if "eagle" in drafters:
        assert drafter is not None
        engine.set_drafter(drafter, version=1)
    return engine


def run_mode(
    mode: str,
    model: CausalLM,
    drafter: EagleDrafter | None,
    work: list,
    warm: list,
    args: argparse.Namespace,
    rep: int = 0,
) -> list[Run]:
    """The workload through a fresh engine in one mode, after the `warm` passes, once per
    epoch (`args.epochs`): one Run each.

    The warm passes run other prompts of the same distribution through the same engine,
    untimed: in a daemon the engine's bandit and estimates live across a job's rollouts (every
    RL step replays the same distribution), so exploring untried arms is not a cost of every
    rollout. Each epoch then rolls out the same prompts with new seeds through that engine
    (what the history drafter learns from). Stats are reset before every timed epoch.
    With `args.trace`, every pass (warm ones too) is recorded there as one trace line.
    """
    every = [work, *warm]
    engine = make_engine(
        mode,
        model,
        drafter,
        max(len(w) for w in every) * args.samples,
        max(len(p) for w in every for _, p in w) + args.max_new_tokens + 1,
        args,
    )
    trace = args.trace
    for j, w in enumerate(warm):
        warm_requests = requests_for(w, args, f"warm{j}-", 10_000 * (j + 1))
        if trace is None:
            engine.generate(warm_requests)
            continue
        rec = Recorder(engine)
        t0 = time.perf_counter()
        timed_generate(engine, warm_requests, rec)
        line = rec.run(time.perf_counter() - t0, mode=mode, rep=rep, epoch=-1, warm=j)
        write_line(trace, line)
    tok = load_tokenizer(args.model)
    runs = []
    for epoch in range(args.epochs):
        engine.stats.reset()
        requests = requests_for(work, args, f"e{epoch}-w", args.seed + 1_000_003 * epoch)
        rec = Recorder(engine) if trace is not None else None
        t0 = time.perf_counter()
        outs, per_bucket, detail = timed_generate(engine, requests, rec)
        seconds = time.perf_counter() - t0
        if rec is not None and trace is not None:
            write_line(trace, rec.run(seconds, mode=mode, rep=rep, epoch=epoch, warm=None))
        rewards = [reward(work[o.prompt_index][0], decode(tok, o.token_ids)) for o in outs]
        runs.append(
            Run(
                mode,
                seconds,
                outs,
                sum(rewards) / len(rewards),
                engine.stats.summary(),
                engine.strategy_snapshot() if MODES[mode][0] else {},
                engine.gate_snapshot() if MODES[mode][0] else {},
                per_bucket,
                detail,
            )
        )
    return runs


def length_stats(outs: list[SampleOutput]) -> dict[str, float]:
    """Quantiles of the answer lengths (tokens) and the share stopped by max_new_tokens."""
    lengths = sorted(len(o.token_ids) for o in outs)
    n = len(lengths)

    def q(p: float) -> int:
        return lengths[min(n - 1, int(p * n))]

    capped = sum(o.finish_reason == FinishReason.LENGTH for o in outs)
    return {
        "n": n, "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": lengths[-1],
        "p99/p50": q(0.99) / max(q(0.5), 1), "max/p50": lengths[-1] / max(q(0.5), 1),
        "capped": capped / n,
    }  # fmt: skip


def time_share(run: Run, gate: int) -> float:
    """Share of the run's decode time spent at running batch <= gate."""
    decode = {b: c for b, c in run.per_bucket.items() if b}
    total = sum(c[0] for c in decode.values())
    return sum(c[0] for b, c in decode.items() if b <= gate) / total if total else 0.0


def _spread(values: list[float], spec: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, spec)
    return f"{format(med, spec)} [{format(min(values), spec)}-{format(max(values), spec)}]"


def print_workload(runs: list[Run]) -> None:
    """Length quantiles and the SD-off time per running-batch bucket (from the off runs)."""
    s = length_stats(runs[0].outputs)
    print(
        f"answer lengths (tokens, {s['n']} samples): p50 {s['p50']}, p90 {s['p90']}, "
        f"p99 {s['p99']}, max {s['max']}; p99/p50 {s['p99/p50']:.1f}, max/p50 "
        f"{s['max/p50']:.1f}; stopped by max_new_tokens {100 * s['capped']:.1f}%"
    )
    buckets = sorted(b for r in runs for b in r.per_bucket)
    buckets = sorted(set(buckets))
    total = [sum(c[0] for c in r.per_bucket.values()) for r in runs]
    print("share of SD-off time per running-batch bucket (0 = prefill):")
    cells = []
    for b in buckets:
        shares = [r.per_bucket.get(b, [0.0, 0.0])[0] / t for r, t in zip(runs, total, strict=True)]
        label = "prefill" if b == 0 else f"<={b}"
        cells.append(f"{label} {100 * statistics.median(shares):.0f}%")
    print("  " + ", ".join(cells))


def print_table(runs: dict[str, list[Run]]) -> None:
    """One row per mode: median wall time and ratio to off over the interleaved repeats, and
    the longest answer of each run. The accept rule reproduces plain decoding, so every mode
    samples SD-off's tokens (the same `tokens`, `longest` and `reward` in every row): the
    wall times compare the same work, tail included."""
    base = runs["off"]
    print(
        "| mode        | wall s | wall vs off (median [min-max]) | tok/s vs off | tokens "
        "| longest [min-max] | mean acc len | SD steps | reward |"
    )
    print(
        "|-------------|-------:|-------------------------------:|-------------:|-------:"
        "|------------------:|-------------:|---------:|-------:|"
    )
    for mode, rs in runs.items():
        ratios = [b.seconds / r.seconds for b, r in zip(base, rs, strict=True)]
        tps = [
            (r.tokens / r.seconds) / (b.tokens / b.seconds) for b, r in zip(base, rs, strict=True)
        ]
        mal = [r.summary["mean_accepted_length"] or 0.0 for r in rs]
        share = [r.summary["sd_step_share"] or 0.0 for r in rs]
        print(
            f"| {mode:<11} | {statistics.median(r.seconds for r in rs):6.1f} "
            f"| {_spread(ratios, '.2f') + 'x':>30} | {statistics.median(tps):11.2f}x "
            f"| {int(statistics.median(r.tokens for r in rs)):6d} "
            f"| {_spread([max(len(o.token_ids) for o in r.outputs) for r in rs], '.0f'):>17} "
            f"| {statistics.median(mal):12.2f} | {100 * statistics.median(share):7.0f}% "
            f"| {statistics.median(r.reward for r in rs):6.3f} |"
        )


def print_bucket_gains(runs: dict[str, list[Run]]) -> None:
    """Per running-batch bucket: each mode's decode throughput over SD off's (median of the
    repeats), and the arm the adaptive bandit used most there."""
    buckets = sorted({b for rs in runs.values() for r in rs for b in r.per_bucket if b})
    modes = [m for m in runs if m != "off"]
    print("\nper-bucket gain (decode tok/s vs SD off, median of repeats):")
    print("| bucket | off tok/s | " + " | ".join(modes) + " | adaptive's most used arm |")
    print("|---:|---:|" + "---:|" * len(modes) + "---|")

    def tps(r: Run, b: int) -> float | None:
        s, t = r.per_bucket.get(b, [0.0, 0.0])
        return t / s if s else None

    for b in buckets:
        off = [x for r in runs["off"] if (x := tps(r, b))]
        if not off:
            continue
        cells = []
        for m in modes:
            gains = [
                x / o for r, o in zip(runs[m], off, strict=False) if (x := tps(r, b)) is not None
            ]
            cells.append(f"{statistics.median(gains):.2f}x" if gains else "-")
        arm = "-"
        if "adaptive" in runs and runs["adaptive"][-1].bandit:
            per = runs["adaptive"][-1].bandit
            near = [k for k in per if k >= b]
            used = per[min(near)] if near else {}
            counts = {n: v["count"] for n, v in used.items() if v.get("count")}
            arm = max(counts, key=counts.get) if counts else "-"  # type: ignore[arg-type]
        print(f"| <={b} | {statistics.median(off):.0f} | " + " | ".join(cells) + f" | {arm} |")


def print_gate(gate: dict) -> None:
    """The measured gate of the last adaptive run: costs, predicted and measured gains."""
    costs = (gate.get("costs") or {}).get("buckets", {}) if gate.get("costs") else {}
    print(
        f"\nmeasured gate (last adaptive run): speculates at buckets {gate['speculating_buckets']}"
    )
    print("| bucket | plain ms | predicted arm | predicted gain | measured arm | measured gain |")
    print("|---:|---:|---|---:|---|---:|")
    for b, v in gate["buckets"].items():
        c = costs.get(b) or costs.get(str(b)) or {}
        plain = c.get("plain_ms")
        cells = [
            f"{plain:.1f}" if isinstance(plain, float) else "-",
            str(v.get("predicted_arm", "-")),
            _gain(v.get("predicted_gain")),
            str(v.get("measured_arm", "-")),
            _gain(v.get("measured_gain")),
        ]
        print(f"| <={b} | " + " | ".join(cells) + " |")


def print_history(runs: list[Run]) -> None:
    """Per bucket (medians of the repeats): the history drafter's accepted length and the
    share of row steps it drafted for, and where the history mode's step time went."""
    buckets = sorted({b for r in runs for b in r.detail if b})
    print("\nhistory mode per bucket (median of repeats): history drafter and step time")
    print(
        "| bucket | history acc len | history draft share | ms/step draft | verify | plain "
        "| other |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b in buckets:
        cells = [r.detail.get(b) for r in runs]
        cells = [c for c in cells if c and c[0]]
        if not cells:
            continue
        acc = [(c[2] + c[1]) / c[1] for c in cells if c[1]]
        share = [c[1] / c[0] for c in cells]
        # ms per step: the bucket's wall time over its steps, split by the engine's phases
        per_step = []
        for r, c in zip(runs, cells, strict=False):
            n_steps = max(1.0, c[6])
            wall = r.per_bucket.get(b, [0.0])[0]
            phases = c[3:6]
            per_step.append([1000 * x / n_steps for x in [*phases, wall - sum(phases)]])
        med = [statistics.median(x[i] for x in per_step) for i in range(4)]
        print(
            f"| <={b} | {statistics.median(acc) if acc else 0:.2f} "
            f"| {100 * statistics.median(share):.0f}% | "
            + " | ".join(f"{x:.1f}" for x in med)
            + " |"
        )


def _gain(x: object) -> str:
    return f"{x:.2f}x" if isinstance(x, float) else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=MODEL_DIR)
    ap.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny workload")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument(
        "--care",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=WORKLOAD_CARE,
        help="re-check rates in tenths, alternating over the prompts (e.g. 4,8 or 7)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threshold", type=int, default=32, help="fixed gate of the @32 ablation")
    ap.add_argument(
        "--ks",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=KS,
        help="draft lengths the bandit chooses from, e.g. 2,4,6",
    )
    ap.add_argument(
        "--confidence",
        type=float,
        default=EngineConfig().draft_confidence,
        help="EAGLE: verify drafts while their cumulative confidence >= this",
    )
    ap.add_argument(
        "--history-ks",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        default=HISTORY_DRAFT_LENGTHS,
        help="draft-length caps of the history drafter's arms",
    )
    ap.add_argument("--epochs", type=int, default=1, help="rollouts of the same prompts")
    ap.add_argument("--modes", default=",".join(MODES), help=f"some of {','.join(MODES)}")
    ap.add_argument(
        "--warmup", type=int, default=1, help="untimed passes (other prompts) per engine first"
    )
    ap.add_argument("--warm-prompts", type=int, help="prompts per warm pass (default: half)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of every mode")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="engine weights and activations"
    )
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    ap.add_argument("--json", type=Path, help="write each epoch's per-mode medians here")
    ap.add_argument(
        "--trace",
        type=Path,
        help="record every pass's steps and this machine's step costs here (JSON lines), "
        "for benchmarks/sim_rollout.py",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.max_new_tokens = 2, 2, min(args.max_new_tokens, 48)
        args.repeats = 1
    modes = [m for m in args.modes.split(",") if m]
    if "off" not in modes:
        modes.insert(0, "off")
    torch.set_num_threads(args.threads)

    model = load_model(args.model, DTYPES[args.dtype], args.device)
    drafter = None
    if args.drafter.is_dir():
        drafter = EagleDrafter.from_pretrained(args.drafter, model)
    elif any("eagle" in MODES[m][0] for m in modes):
        print(f"no drafter at {args.drafter}: skipping the EAGLE modes", flush=True)
        modes = [m for m in modes if "eagle" not in MODES[m][0]]
    work = rollout_prompts(args.prompts, args.seed, args.model, args.care)
    print(
        f"workload: {args.prompts} prompts x {args.samples} samples, "
        f"care {'/'.join(map(str, args.care))}, "
        f"T={args.temperature}, max_new_tokens {args.max_new_tokens}, threads {args.threads}, "
        f"{args.dtype} on {args.device}, {args.repeats} interleaved repeats after "
        f"{args.warmup} untimed warm-up "
        f"pass(es) of {args.warm_prompts or max(1, args.prompts // 2)} other prompts",
        flush=True,
    )
    warm_n = args.warm_prompts or max(1, args.prompts // 2)
    warm = [
        rollout_prompts(warm_n, args.seed + 1 + j, args.model, args.care)
        for j in range(args.warmup)
    ]
    # epoch -> mode -> one Run per repeat; modes interleaved within every repeat
    runs: list[dict[str, list[Run]]] = [{m: [] for m in modes} for _ in range(args.epochs)]
    if args.trace is not None:
        args.trace.write_text("")
    for rep in range(args.repeats):
        for mode in modes:
            if args.trace is not None:  # step costs timed just before, under the same load
                record_costs(args, model, drafter, len(work) * args.samples, rep, mode)
            for epoch, r in enumerate(run_mode(mode, model, drafter, work, warm, args, rep)):
                runs[epoch][mode].append(r)
                print(f"  [{rep + 1}/{args.repeats}] {mode} epoch {epoch + 1}: {r.seconds:.1f}s")
            if args.trace is not None:  # and just after: the load may change during the pass
                record_costs(args, model, drafter, len(work) * args.samples, rep, mode)
            sys.stdout.flush()
    for epoch, per_mode in enumerate(runs):
        if args.epochs > 1:
            print(f"\n=== epoch {epoch + 1} of {args.epochs} ===")
        print()
        print_workload(per_mode["off"])
        print()
        print_table(per_mode)
        print(
            "\nSD steps: share of sample decode steps that speculated. mean acc len: tokens a "
            "sample gains per SD step (accepted drafts + 1)."
        )
        print_bucket_gains(per_mode)
        if "adaptive" in per_mode:
            print_gate(per_mode["adaptive"][-1].gate)
        if "history" in per_mode:
            print_history(per_mode["history"])
    if args.json:
        write_json(args.json, runs, args.device)
    return 0


def record_costs(
    args: argparse.Namespace,
    model: CausalLM,
    drafter: EagleDrafter | None,
    rows: int,
    rep: int,
    mode: str,
) -> None:
    """Time whole engine steps at the batch sizes and contexts a pass runs at (a short and a
    long context; the shortest and longest draft) into the trace, for `mode`'s passes of
    repeat `rep` (timed before and after them)."""
    batches = [1 << i for i in range(rows.bit_length()) if 1 << i < rows] + [rows]
    contexts = (64, min(1024, args.max_new_tokens))
    t0 = time.perf_counter()
    ks = (min(args.ks), max(args.ks))
    costs = measure_step_costs(model, drafter, batches, ks, contexts, steps=6)
    write_line(args.trace, {"type": "costs", "rep": rep, "mode": mode, **costs.as_dict()})
    print(f"  [{rep + 1}/{args.repeats}] step costs timed in {time.perf_counter() - t0:.1f}s")


def write_json(path: Path, runs: list[dict[str, list[Run]]], device: str) -> None:
    """Per epoch and mode the medians of wall seconds, mean accepted length and SD step
    share; the device, and the most memory allocated on it when it is CUDA."""

    def med(rs: list[Run], key: str) -> float:
        return statistics.median(r.summary[key] or 0.0 for r in rs)

    epochs = [
        {m: {"seconds": statistics.median(r.seconds for r in rs),
             "mean_accepted_length": med(rs, "mean_accepted_length"),
             "sd_step_share": med(rs, "sd_step_share")} for m, rs in per_mode.items() if rs}
        for per_mode in runs
    ]  # fmt: skip
    cuda = device.startswith("cuda")
    mem = torch.cuda.max_memory_allocated(device) if cuda else 0
    path.write_text(json.dumps({"device": device, "cuda_max_memory_bytes": mem,
                                "epochs": epochs}, indent=1))  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
