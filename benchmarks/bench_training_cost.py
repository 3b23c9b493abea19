"""What drafter training in the rollout's tail costs the rollout: the same rollout with the
job's online training on and off, side by side.

Two `tltd serve` daemons, set up as `make demo` sets up its own (2 CPU slots,
`training_window = "rollout"`: a round starts on a slot the tail has left idle and yields when
the job's last sample is done), each with one job on the same policy and the same
offline-fitted initial drafter: `train-on` trains its drafter online, `train-off` does not.
Both daemons run all the time; a round rolls out the same step of the demo's dataset
(`--prompts` x `--n` at temperature 1, the round's seed) on one, then on the other, in
alternating order, while the other sits idle. Each job keeps its own workers (on one daemon
the two jobs would take turns on the slots, and a worker's job switch would land in one
job's rollout and not the other's). A warm-up rollout per job comes first, so that
`train-on` has the fresh samples a round needs from the first timed one.

`--speculative off` (the default) rolls out with speculative decoding off, so both jobs
sample **the same tokens** from the same seeds (each round says whether they did): the two
rollouts are the same work, and their ratio is what training on the idle slot costs the slot
still decoding, alone (CPU slots share the machine's cores, caches, memory bandwidth and the
daemon's process; a GPU of its own would not be shared). Training still runs: the job trains
on every sample it stores, whatever drafted it. `--speculative auto` rolls out with the
jobs' drafters, as the demo does; the rollouts then differ once a trained version is
promoted, and the ratio also carries the drafts' effect and the sampled tails' variance.

Per round: both wall times and their ratio (paired: the same minute of the machine), and the
device-seconds inside the rollout window spent training and left idle. The result is the
median of the per-round ratios, with min-max.

    python benchmarks/bench_training_cost.py [--repeats 7] [--prompts 16] [--n 8]
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
    """Training and idle device-seconds since `before`; a trainer's start-up (the device held
    for training, its trainer not up yet) counts as idle."""
    after = daemon.device_seconds()
    loading = after.get("loading", 0.0) - before.get("loading", 0.0)
    return (
        after.get("training", 0.0) - before.get("training", 0.0) - loading,
        after.get("idle", 0.0) - before.get("idle", 0.0) + loading,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=DemoConfig.max_new_tokens)
    ap.add_argument(
        "--speculative", choices=("off", "auto"), default="off",
        help="the rollouts' speculative mode: off = both jobs sample the same tokens",
    )  # fmt: skip
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
    spent: dict[str, list[tuple[float, float]]] = {job: [] for job in JOBS}
    same: list[bool] = []
    with tempfile.TemporaryDirectory() as tmp:
        daemons: dict[str, Daemon] = {}
        clients: dict[str, RolloutClient] = {}
        try:
            for job, online in JOBS.items():
                (Path(tmp) / job).mkdir()
                daemons[job] = Daemon(Path(tmp) / job, cfg.cpu_slots)
                clients[job] = RolloutClient(daemons[job].target)
                clients[job].create_job(
                    MODEL, job_id=job, speculative="auto", online_training=online,
                    initial_drafter=DRAFTER,
                )  # fmt: skip
                rollout(clients[job], prompts, cfg, 10_000, f"{job} warm-up", args.speculative)
                _settle(clients[job])
            for r in range(args.repeats):
                order = list(JOBS) if r % 2 == 0 else list(reversed(JOBS))
                outputs: dict[str, dict[tuple[int, int], list[int]]] = {}
                for job in order:
                    before = daemons[job].device_seconds()
                    samples, _, wall = rollout(
                        clients[job], prompts, cfg, seed=r, label=f"{job} {r}",
                        speculative=args.speculative,
                    )  # fmt: skip
                    times[job].append(wall)
                    outputs[job] = {(s.prompt_index, s.sample_index): s.token_ids for s in samples}
                    spent[job].append(window(daemons[job], before))
                    train, idle = spent[job][-1]
                    longest = max(len(t) for t in outputs[job].values())
                    print(f"  round {r} {job}: rollout {wall:.2f}s, longest sample {longest} "
                          f"tokens, training/idle device-s {train:.1f}/{idle:.1f}",
                          flush=True)  # fmt: skip
                    _settle(clients[job])
                same.append(outputs["train-on"] == outputs["train-off"])
                print(f"  round {r}: on / off {times['train-on'][-1] / times['train-off'][-1]:.3f}x"
                      f", same tokens: {'yes' if same[-1] else 'no'}", flush=True)  # fmt: skip
        finally:
            for client in clients.values():
                client.close()
            for daemon in daemons.values():
                daemon.stop()
    _print_table(times, spent, same)
    return 0


def _settle(client: RolloutClient, timeout: float = 60.0) -> None:
    """Until no device trains (the rollout window closed: training yields at its end)."""
    deadline = time.monotonic() + timeout
    while any(d.state == "training" for d in client.raw.list_devices()):
        if time.monotonic() > deadline:
            return
        time.sleep(0.2)


def _print_table(times: dict[str, list[float]], spent: dict[str, list], same: list[bool]) -> None:
    print(f"\n{'job':<11}{'rollout s (median)':>19}{'min-max':>16}{'training dev-s':>16}"
          f"{'idle dev-s':>12}{'harvest':>9}")  # fmt: skip
    for job in JOBS:
        train = sum(t for t, _ in spent[job])
        idle = sum(i for _, i in spent[job])
        harvest = train / (train + idle) if train + idle else 0.0
        t = times[job]
        print(f"{job:<11}{statistics.median(t):>19.2f}{f'{min(t):.2f}-{max(t):.2f}':>16}"
              f"{train:>16.1f}{idle:>12.1f}{harvest:>9.0%}")  # fmt: skip
    ratios = [on / off for on, off in zip(times["train-on"], times["train-off"], strict=True)]
    med = statistics.median(ratios)
    print(
        f"\nrollout with online training / without, paired per round: {med:.3f}x "
        f"({(med - 1) * 100:+.1f}%) [{min(ratios):.3f}-{max(ratios):.3f}], "
        f"median of {len(ratios)} rounds; same tokens in {sum(same)} of {len(same)} rounds"
    )


if __name__ == "__main__":
    raise SystemExit(main())
