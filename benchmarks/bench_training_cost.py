"""What drafter training in the rollout's tail costs the rollout: the same rollout with the
job's online training on and off, side by side on one `tltd serve`.

Two jobs on the same policy and the same offline-fitted initial drafter, speculative decoding
adaptive in both: `train-on` trains its drafter online, `train-off` does not. The daemon runs
as `make demo` runs it (2 CPU slots, `training_window = "rollout"`: a round starts on a
device the tail has left idle and yields when the job's last sample is done). Rounds alternate
the two jobs, in rotating order, each rolling out the same step of the demo's dataset
(`--prompts` x `--n` at temperature 1, the same seed for both); after a warm-up rollout of
each job, so that `train-on` has the fresh samples a round needs from the first timed one.

Per job: rollout wall time (median over `--repeats`, min-max beside it), and the device-seconds
inside its rollout windows spent training and left idle. The two jobs' rollouts are the same
workload but not the same tokens (sampled, with drafts that differ once an online version is
promoted): each round prints its longest sample, which sets the tail, and the repeats show the
spread. CPU slots share the machine's cores, caches and memory bandwidth (and the daemon's
process), so training on an idle slot can slow the slot still decoding, as it could not on a
GPU of its own; on a machine with other work the figures say little.

    python benchmarks/bench_training_cost.py [--repeats 3] [--prompts 16] [--n 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.grpo_demo import DRAFTER, MODEL, Daemon, DemoConfig, rollout  # noqa: E402
from examples.task.dataset import build_dataset  # noqa: E402
from tltd_clients import RolloutClient  # noqa: E402

JOBS = {"train-on": True, "train-off": False}


def window(daemon: Daemon, before: dict[str, float]) -> tuple[float, float]:
    """Training and idle device-seconds since `before`."""
    after = daemon.device_seconds()
    return (
        after.get("training", 0.0) - before.get("training", 0.0),
        after.get("idle", 0.0) - before.get("idle", 0.0),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=DemoConfig.max_new_tokens)
    args = ap.parse_args(argv)
    cfg = DemoConfig(prompts=args.prompts, n=args.n, max_new_tokens=args.max_new_tokens)
    dataset = build_dataset(cfg.prompts, max(cfg.prompts, cfg.train_prompts))
    prompts = [ids for _, ids in dataset.batch(0)]
    print(
        f"workload: {len(prompts)} prompts x {cfg.n} samples at temperature 1 (the demo's "
        f"step 0), max {cfg.max_new_tokens} new tokens; {args.repeats} rounds, 2 CPU slots",
        flush=True,
    )
    times: dict[str, list[float]] = {job: [] for job in JOBS}
    tokens: dict[str, list[int]] = {job: [] for job in JOBS}
    spent: dict[str, list[tuple[float, float]]] = {job: [] for job in JOBS}
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(Path(tmp), cfg.cpu_slots)
        client = RolloutClient(daemon.target)
        try:
            for job, online in JOBS.items():
                client.create_job(
                    MODEL, job_id=job, speculative="auto", online_training=online,
                    initial_drafter=DRAFTER,
                )  # fmt: skip
                rollout(client, prompts, cfg, seed=10_000, label=f"{job} warm-up")
            for r in range(args.repeats):
                order = list(JOBS) if r % 2 == 0 else list(reversed(JOBS))
                for job in order:
                    client.job_id = job  # the job client.stream rolls out for
                    before = daemon.device_seconds()
                    samples, _, wall = rollout(client, prompts, cfg, seed=r, label=f"{job} {r}")
                    times[job].append(wall)
                    tokens[job].append(max(s.num_tokens for s in samples))
                    spent[job].append(window(daemon, before))
                    train, idle = spent[job][-1]
                    print(f"  round {r} {job}: rollout {wall:.1f}s, longest sample "
                          f"{tokens[job][-1]} tokens, training/idle device-s "
                          f"{train:.1f}/{idle:.1f}", flush=True)  # fmt: skip
                    _settle(client)
        finally:
            client.close()
            daemon.stop()
    _print_table(times, spent)
    return 0


def _settle(client: RolloutClient, timeout: float = 60.0) -> None:
    """Until no device trains (the rollout window closed: training yields at its end)."""
    deadline = time.monotonic() + timeout
    while any(d.state == "training" for d in client.raw.list_devices()):
        if time.monotonic() > deadline:
            return
        time.sleep(0.2)


def _print_table(times: dict[str, list[float]], spent: dict[str, list]) -> None:
    print(f"\n{'job':<11}{'rollout s (median)':>19}{'min-max':>16}{'training dev-s':>16}"
          f"{'idle dev-s':>12}{'harvest':>9}")  # fmt: skip
    for job in JOBS:
        train = sum(t for t, _ in spent[job])
        idle = sum(i for _, i in spent[job])
        harvest = train / (train + idle) if train + idle else 0.0
        t = times[job]
        print(f"{job:<11}{statistics.median(t):>19.1f}{f'{min(t):.1f}-{max(t):.1f}':>16}"
              f"{train:>16.1f}{idle:>12.1f}{harvest:>9.0%}")  # fmt: skip
    on, off = statistics.median(times["train-on"]), statistics.median(times["train-off"])
    print(f"\nrollout with online training / without: {on / off:.3f}x "
          f"({(on / off - 1) * 100:+.1f}%; median of {len(times['train-on'])} each)")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
