"""Length-aware placement on a node with several rollout workers: the tail it saves, simulated.

One RL step's request (the rollout workload's prompts x n samples) is placed onto W workers by
the daemon's own pure scheduler (`tltd.scheduler.schedule`), once with the prompts' predicted
lengths (their answers in the previous epoch: what the daemon reads from the store) and once
without (every sample weighs its max_new_tokens, so placement balances sample counts: the
placement without prediction). Each worker is then a continuous-batching engine whose step
takes `a + c * batch` ms (measured on the shipped policy in this run, plain decoding, or given
with --step-ms) and emits one token per running sample per step; a worker takes more work
from the scheduler whenever a sample finishes, as the daemon's tick does.

What is simulated, and why: the placement question is which worker gets which samples, and
the answer depends only on the samples' lengths and the workers' step costs. Sample lengths
come from the task's reference answers (examples/task/reasoning.py: the answers the policy was
trained on, per sample a geometric number of re-checks, guesses at the task's rate), drawn
anew per epoch, so a prompt's prediction is only as good as its previous epoch is at
foretelling this one: per-sample re-checks make one prompt's samples differ several-fold, which
bounds what any length predictor can do on this task.

Reported per placement: the step's makespan and its tail (from the moment 90% of the samples
are done to the last one), medians over --repeats workloads with their spread, and the ratio
of the prediction-free placement's figure to the length-aware one's.

    python benchmarks/bench_placement.py [--workers 2] [--prompts 16] [--samples 8]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.task.reasoning import GUESS_RATE, make_problem, sample_checks  # noqa: E402
from examples.task.workload import MAX_NEW_TOKENS, WORKLOAD_CARE, rollout_prompts  # noqa: E402
from tltd.scheduler import (  # noqa: E402
    DeviceView,
    JobView,
    PendingWork,
    RolloutWorkerView,
    SchedulerConfig,
    Snapshot,
    schedule,
)

JOB = "job"


def sample_lengths(problems: list, samples: int, rng: random.Random) -> list[list[int]]:
    """Per prompt, `samples` answer lengths in tokens (characters + <eos>), capped."""
    out = []
    for p in problems:
        row = []
        for _ in range(samples):
            guess = rng.random() < GUESS_RATE
            checks = sample_checks(rng, p.care)
            answer = make_problem(p.start, p.step, p.count, checks=checks, guess=guess, care=p.care)
            row.append(min(len(answer.solution) + 1, MAX_NEW_TOKENS))
        out.append(row)
    return out


@dataclass
class Worker:
    """One simulated engine: the remaining true and predicted tokens of what it runs."""

    worker_id: str
    left: list[float] = field(default_factory=list)  # true tokens still to emit, per sample
    predicted: list[float] = field(default_factory=list)  # predicted tokens still to emit

    def view(self, now: float) -> RolloutWorkerView:
        remaining = int(sum(max(p, 1.0) for p in self.predicted))
        return RolloutWorkerView(
            self.worker_id,
            f"dev-{self.worker_id}",
            JOB,
            True,
            running_samples=len(self.left),
            remaining_tokens=remaining,
            idle_since=None if self.left else now,
        )


def simulate(
    lengths: list[list[int]],
    predicted: list[int | None],
    workers: int,
    step_ms: tuple[float, float],
    cfg: SchedulerConfig,
) -> list[float]:
    """Finish times (s) of every sample of one request placed by the scheduler."""
    a, c = step_ms
    pool = [Worker(f"w{i}") for i in range(workers)]
    waiting = {i: list(lengths[i]) for i in range(len(lengths))}  # prompt -> lengths not placed
    done: list[float] = []
    now = 0.0
    total = sum(len(v) for v in lengths)
    while len(done) < total:
        pending = tuple(
            PendingWork("r", i, JOB, len(v), MAX_NEW_TOKENS, 0.0, predicted_tokens=predicted[i])
            for i, v in waiting.items()
            if v
        )
        if pending:
            snap = Snapshot(
                now,
                tuple(DeviceView(f"dev-{w.worker_id}", True) for w in pool),
                tuple(w.view(now) for w in pool),
                (),
                pending,
                (JobView(JOB, online_training=False),),
            )
            by_id = {w.worker_id: w for w in pool}
            for asg in schedule(snap, cfg).assignments:
                w = by_id[asg.worker_id]
                for _ in range(asg.samples):
                    w.left.append(float(waiting[asg.prompt_index].pop()))
                    guess = predicted[asg.prompt_index]
                    w.predicted.append(float(MAX_NEW_TOKENS if guess is None else guess))
        busy = [w for w in pool if w.left]
        # Advance to the next finish: worker w emits one token per sample every a + c*b ms.
        rate = {w.worker_id: 1000.0 / (a + c * len(w.left)) for w in busy}  # tokens/s/sample
        dt = min(min(w.left) / rate[w.worker_id] for w in busy)
        now += dt
        for w in busy:
            step = rate[w.worker_id] * dt
            w.left = [x - step for x in w.left]
            w.predicted = [p - step for p in w.predicted]
            keep = [i for i, x in enumerate(w.left) if x > 1e-9]
            done += [now] * (len(w.left) - len(keep))
            w.left = [w.left[i] for i in keep]
            w.predicted = [w.predicted[i] for i in keep]
    return sorted(done)


def tail_s(finish: list[float]) -> float:
    """Time from 90% of the samples done to the last."""
    return finish[-1] - finish[int(0.9 * len(finish)) - 1]


def measure_step_ms(threads: int) -> tuple[float, float]:
    """a, c of `a + c * batch` ms for the shipped policy's plain decode step, fitted over a
    few batch sizes (least squares)."""
    import torch

    from tltd.domain import SamplingParams
    from tltd_workers.engine.engine import Engine, EngineConfig

    torch.set_num_threads(threads)
    model = str(Path(__file__).resolve().parents[1] / "models" / "tiny-policy")
    points = []
    for b in (1, 16, 64):
        e = Engine(model, EngineConfig(max_batch=b, max_seq_len=512, spec_mode="off"))
        sp = SamplingParams(n=b, temperature=1.0, max_new_tokens=48, seed=1)  # no stop token
        e.add_request("r", [1, 5, 6, 7, 8], sp)
        e.step()  # prefill
        for _ in range(4):
            e.step()  # warm
        t0 = time.perf_counter()
        for _ in range(24):
            e.step()
        points.append((b, 1000 * (time.perf_counter() - t0) / 24))
    mb = statistics.fmean(b for b, _ in points)
    mt = statistics.fmean(t for _, t in points)
    c = sum((b - mb) * (t - mt) for b, t in points) / sum((b - mb) ** 2 for b, _ in points)
    return max(mt - c * mb, 0.0), max(c, 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--care", default=",".join(map(str, WORKLOAD_CARE)))
    ap.add_argument("--max-per-worker", type=int, default=64, help="engine batch capacity")
    ap.add_argument("--repeats", type=int, default=20, help="workloads (seeds) simulated")
    ap.add_argument("--step-ms", default=None, help="a,c of a + c*batch ms (default: measure)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.step_ms:
        a, c = (float(x) for x in args.step_ms.split(","))
    else:
        a, c = measure_step_ms(args.threads)
    care = [int(x) for x in args.care.split(",")]
    cfg = SchedulerConfig(max_samples_per_worker=args.max_per_worker)
    rows: dict[str, list[tuple[float, float]]] = {"count": [], "length": []}
    for r in range(args.repeats):
        problems = [p for p, _ in rollout_prompts(args.prompts, args.seed + r, care=care)]
        rng = random.Random(1000 + r)
        previous = sample_lengths(problems, args.samples, rng)  # the prompt's last epoch
        now = sample_lengths(problems, args.samples, rng)  # this epoch's samples
        guess = [round(statistics.fmean(v)) for v in previous]
        for name, pred in (("count", [None] * len(problems)), ("length", guess)):
            finish = simulate(now, pred, args.workers, (a, c), cfg)
            rows[name].append((finish[-1], tail_s(finish)))
    print(
        f"workload: {args.prompts} prompts x {args.samples} samples, care {args.care}, "
        f"answer lengths from the task's reference answers (per-sample re-checks, guesses at "
        f"{GUESS_RATE:.0%}), {args.workers} workers of at most {args.max_per_worker} samples; "
        f"step {a:.2f} + {c:.3f} x batch ms; {args.repeats} workloads"
    )
    print(
        "\n| placement | makespan s (median [min-max]) | tail s: 90% done -> last "
        "| makespan vs count | tail vs count |"
    )
    print("|---|---:|---:|---:|---:|")
    base_m = [m for m, _ in rows["count"]]
    base_t = [t for _, t in rows["count"]]
    for name, label in (("count", "no prediction"), ("length", "length-aware")):
        ms = [m for m, _ in rows[name]]
        ts = [t for _, t in rows[name]]
        rm = statistics.median(b / m for b, m in zip(base_m, ms, strict=True))
        rt = statistics.median(b / t for b, t in zip(base_t, ts, strict=True) if t > 0)
        print(
            f"| {label} | {statistics.median(ms):.2f} [{min(ms):.2f}-{max(ms):.2f}] "
            f"| {statistics.median(ts):.2f} [{min(ts):.2f}-{max(ts):.2f}] "
            f"| {rm:.2f}x | {rt:.2f}x |"
        )
    print(
        "\nratios: per workload, the no-prediction placement's figure over this one's "
        "(median); > 1 means length-aware placement finishes sooner."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
