"""What a drafter trainer on the idle CPU slot costs the slot still decoding: a rollout tail's
decode steps timed with the trainer running and stopped, in alternating windows.

The rollout-level comparison (`bench_training_cost.py`) carries the machine's own drift: on a
shared 2-core VM the same seeded rollout takes 10-20 s from one minute to the next, so a few
per cent cannot be resolved there. This benchmark isolates the mechanism instead. One
process decodes a tail the way a rollout worker does (the shipped policy, one torch thread,
a fixed running batch that decodes to the end without stopping, speculative decoding as
`--speculative` says). Beside it, a drafter trainer runs as the daemon runs one: its own
process at nice 19 with one torch thread, the project's `Trainer` on the shipped drafter,
on the task's answers (target features recomputed, as from the store). The trainer is
stopped (SIGSTOP) and resumed (SIGCONT) every `--window` seconds, and each window's decode
steps are timed. Adjacent windows are paired (training / stopped), so the machine's drift and
the growing context cancel; the result is the median of the pairs' ratios, with min-max.

Workload per batch size: samples of the rollout workload's longest prompt at temperature 1,
stopped at the stop token as in a rollout, the running batch topped up to B as samples end
(a tail at batch B), for `--seconds` per decode. The trainer takes the core the other slot
leaves idle, sharing caches and memory bandwidth with the decoding one: the figure is what
online training costs a tail's decode on a colocated CPU node, not on a GPU with its own
memory.

    python benchmarks/bench_training_contention.py [--batches 1,4] [--speculative off,auto]
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.task.workload import MAX_NEW_TOKENS, MODEL_DIR, STOP_TOKEN_ID, rollout_prompts  # noqa: E402
from tltd.domain import SamplingParams  # noqa: E402
from tltd_workers.engine.bandit import Strategy  # noqa: E402
from tltd_workers.engine.eagle import EagleDrafter  # noqa: E402
from tltd_workers.engine.engine import Engine, EngineConfig  # noqa: E402
from tltd_workers.engine.transformer import load_model  # noqa: E402

DRAFTER_DIR = ROOT / "models" / "tiny-policy-eagle"

# The trainer process: the daemon's TrainerConfig defaults, the demo's answers as its data.
TRAINER = """
import os, sys, torch
sys.path.insert(0, {root!r})
from examples.task.reasoning import make_dataset
from examples.task.tokenizer import encode_answer, encode_prompt, load_tokenizer
from tltd_workers.drafter.buffer import TrainingBuffer
from tltd_workers.drafter.trainer import Trainer
from tltd_workers.engine.eagle import EagleDrafter
from tltd_workers.engine.transformer import load_model
os.nice({nice})
torch.set_num_threads(1)
target = load_model({model!r})
drafter = EagleDrafter.from_pretrained({drafter!r}, target)
tok = load_tokenizer({model!r})
buf = TrainingBuffer(64 << 20, keep_hidden=False)
for p in make_dataset(256, seed=5, care=(4, 8)):
    prompt = encode_prompt(tok, p.prompt)
    answer = encode_answer(tok, p.solution)
    buf.add(prompt + answer, len(prompt), policy_version=0, step=0)
trainer = Trainer(drafter, buf)
print("ready", flush=True)
while True:
    trainer.train_step()
"""


def start_trainer(nice: int) -> subprocess.Popen:
    code = TRAINER.format(root=str(ROOT), model=str(MODEL_DIR), drafter=str(DRAFTER_DIR), nice=nice)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        raise RuntimeError("the trainer process did not start")
    time.sleep(2.0)  # a few optimizer steps: past the first step's allocations
    return proc


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def make_engine(speculative: str, batch: int, prompt: list[int]) -> Engine:
    model = load_model(MODEL_DIR)
    cfg = EngineConfig(
        max_batch=batch,
        max_seq_len=len(prompt) + MAX_NEW_TOKENS + 1,
        spec_mode="adaptive" if speculative == "auto" else "off",
        strategies=tuple(Strategy(d, k) for d in ("ngram", "eagle") for k in (2, 4, 6)),
    )
    engine = Engine(model, cfg)
    if speculative == "auto":
        engine.set_drafter(EagleDrafter.from_pretrained(DRAFTER_DIR, model), version=1)
    return engine


def windows(
    engine: Engine, prompt: list[int], batch: int, seconds: float, trainer: subprocess.Popen,
    window: float, seed: int,
) -> list[tuple[str, float, float]]:  # fmt: skip
    """Decode for `seconds`, the running batch topped up to `batch` samples of the prompt as
    samples end, toggling the trainer every `window` s; per window: ('train' | 'stopped',
    seconds per emitted token, the trainer's share of a core)."""
    started = 0

    def top_up() -> None:
        nonlocal started
        while len(engine.running) + len(engine.waiting) < batch:
            engine.add_request(
                f"tail-{started}", prompt,
                SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS,
                               stop_token_ids=(STOP_TOKEN_ID,), seed=seed * 100_000 + started),
            )  # fmt: skip
            started += 1

    out: list[tuple[str, float, float]] = []
    running = True  # the trainer runs at the start
    end = time.perf_counter() + seconds
    t0, emitted, cpu0 = time.perf_counter(), 0, cpu_seconds(trainer.pid)
    while time.perf_counter() < end:
        top_up()
        before = sum(len(s.tokens) for s in engine.running)
        done = engine.step()
        emitted += sum(len(s.tokens) for s in engine.running) - before
        emitted += sum(len(o.token_ids) for o in done) if done else 0
        now = time.perf_counter()
        if now - t0 >= window:
            share = (cpu_seconds(trainer.pid) - cpu0) / (now - t0)
            if emitted:
                out.append(("train" if running else "stopped", (now - t0) / emitted, share))
            running = not running
            os.kill(trainer.pid, signal.SIGCONT if running else signal.SIGSTOP)
            t0, emitted, cpu0 = time.perf_counter(), 0, cpu_seconds(trainer.pid)
    if not running:
        os.kill(trainer.pid, signal.SIGCONT)
    return out[2:]  # the first pair includes the prefill and the gate's first measurements


def paired_ratios(seq: list[tuple[str, float, float]]) -> list[float]:
    """Each training window against the stopped window next to it (train / stopped)."""
    ratios = []
    for (a, x, _), (_, y, _) in zip(seq[::2], seq[1::2], strict=False):
        train, stopped = (x, y) if a == "train" else (y, x)
        ratios.append(train / stopped)
    return ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--speculative", default="off,auto", help="some of off,auto")
    ap.add_argument("--seconds", type=float, default=15.0, help="decode time per repeat")
    ap.add_argument("--window", type=float, default=0.5, help="seconds per on/off window")
    ap.add_argument("--repeats", type=int, default=2, help="decodes per configuration")
    ap.add_argument("--nice", type=int, default=19, help="the trainer's (the daemon's: 19)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    _, prompt = max(rollout_prompts(16), key=lambda pp: pp[0].num_steps)
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.speculative.split(",")
    print(
        f"decode: B rows of the workload's longest prompt at temperature 1, topped up as "
        f"samples end, {args.seconds:g} s per decode, 1 torch thread; trainer: nice {args.nice}, "
        f"1 thread, the shipped drafter on the task's answers; windows of {args.window} s, "
        f"trainer running / stopped in turn; {args.repeats} decodes per row",
        flush=True,
    )
    trainer = start_trainer(args.nice)
    rows = []
    try:
        for mode in modes:
            for b in batches:
                ratios: list[float] = []
                per: dict[str, list[float]] = {"train": [], "stopped": []}
                busy: list[float] = []
                for r in range(args.repeats):
                    engine = make_engine(mode, b, prompt)
                    seq = windows(engine, prompt, b, args.seconds, trainer, args.window, seed=r)
                    ratios += paired_ratios(seq)
                    for state, s, share in seq:
                        per[state].append(s)
                        if state == "train":
                            busy.append(share)
                rows.append((mode, b, per, ratios, statistics.median(busy)))
                print(
                    f"  speculative {mode}, batch {b}: {len(ratios)} pairs, median "
                    f"{statistics.median(ratios):.3f}x",
                    flush=True,
                )
    finally:
        os.kill(trainer.pid, signal.SIGCONT)
        trainer.kill()
        trainer.wait()
    print("\n| speculative | batch | ms/token, trainer stopped | ms/token, trainer running "
          "| running / stopped, paired (median [min-max]) | pairs "
          "| trainer's core share |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, b, per, ratios, busy in rows:
        print(
            f"| {mode} | {b} | {statistics.median(per['stopped']) * 1e3:.2f} | "
            f"{statistics.median(per['train']) * 1e3:.2f} | "
            f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}] | "
            f"{len(ratios)} | {busy:.0%} |"
        )
    # Pooled: the geometric mean of every pair's ratio and its standard error (the pairs'
    # noise is symmetric in the log: a window's batch composition and acceptance vary).
    logs = [math.log(x) for *_, ratios, _ in rows for x in ratios]
    mean = statistics.fmean(logs)
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    print(
        f"\npooled over the rows: running / stopped {math.exp(mean):.3f}x "
        f"(geometric mean of {len(logs)} pairs; 95% interval "
        f"{math.exp(mean - 1.96 * se):.3f}-{math.exp(mean + 1.96 * se):.3f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
