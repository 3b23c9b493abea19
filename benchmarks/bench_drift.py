"""Drift: a frozen drafter vs the online drafter trained only in the rollouts' idle windows.

A small Qwen2-shaped policy is first trained on data mix A (a noisy token permutation process),
then taken through U policy updates: real AdamW fine-tuning steps on a data mix that shifts
from A to B (share of B = u / U). At every RL step u:

1. rollout: the current policy decodes greedily, with long-tailed lengths, on D emulated
   devices (shards run one after another here, each timed); the step lasts as long as the
   slowest shard and every other device is idle for the difference;
2. measure: mean accepted length (greedy k-chains, the engine's SD rule at temperature 0) of
   (a) the drafter frozen at version 0 and (b) the online drafter, on this step's fresh
   rollouts, which neither drafter has seen;
3. harvest: the online drafter trains on the buffer (one-step offset) for exactly the idle
   device-seconds of this step (sum over devices), stopping mid-step when the window closes;
4. policy update (the trainer's step), loaded into the engine in place.

Version 0 is the drafter fitted on the initial policy's rollouts. Prints one row per step and
the final ratio online / frozen (TLT reports +42%; the issue asks for >= +30%).

    python benchmarks/bench_drift.py [--updates 10] [--devices 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tltd.domain import SamplingParams  # noqa: E402
from workers.drafter.buffer import TrainingBuffer  # noqa: E402
from workers.drafter.trainer import Stop, Trainer, TrainerConfig  # noqa: E402
from workers.drafter.versions import HeldOut, mean_accepted_length  # noqa: E402
from workers.engine.api import EngineConfig, Request  # noqa: E402
from workers.engine.eagle import EagleDrafter  # noqa: E402
from workers.engine.engine import Engine  # noqa: E402

VOCAB = 48
PROMPT = 6


class Mix:
    """Two token processes: next = f(prev) with prob 0.9, else random; A and B differ in f."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = {name: torch.randperm(VOCAB, generator=g) for name in ("A", "B")}

    def sample(self, rng: random.Random, n: int, share_b: float) -> list[int]:
        table = self.table["B" if rng.random() < share_b else "A"]
        ids = [rng.randrange(VOCAB), rng.randrange(VOCAB)]
        while len(ids) < n:
            nxt = int(table[ids[-1]]) if rng.random() < 0.9 else rng.randrange(VOCAB)
            ids.append(nxt)
        return ids


def make_policy(path: Path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True))
    model.save_pretrained(path)
    return model


def finetune(model, opt, mix: Mix, rng: random.Random, steps: int, share_b: float) -> float:
    """Real policy training steps (next-token cross-entropy on the data mix)."""
    model.train()
    loss = torch.zeros(())
    for _ in range(steps):
        batch = torch.tensor([mix.sample(rng, 48, share_b) for _ in range(32)])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def rollout(engine: Engine, mix: Mix, rng: random.Random, share_b: float, devices: int,
            per_device: int) -> tuple[list[HeldOut], list[float]]:
    """Greedy, long-tailed rollouts on `devices` emulated devices; returns samples + times."""
    samples: list[HeldOut] = []
    times = []
    for d in range(devices):
        reqs = []
        for i in range(per_device):
            length = min(200, int(12 / (1 - rng.random()) ** 0.7))  # power-law tail
            reqs.append(Request(f"d{d}-{i}", mix.sample(rng, PROMPT, share_b),
                                SamplingParams(n=1, temperature=0.0, max_new_tokens=length),
                                return_hidden_states=True))
        t0 = time.perf_counter()
        outs = engine.generate(reqs)
        times.append(time.perf_counter() - t0)
        by_id = {r.request_id: r for r in reqs}
        for o in outs:
            prompt = list(by_id[o.request_id].prompt_ids)
            samples.append(HeldOut(torch.tensor(prompt + o.token_ids), len(prompt),
                                   o.hidden_states))
    return samples, times


def train_for(trainer: Trainer, seconds: float) -> int:
    deadline = time.perf_counter() + seconds
    steps = 0
    while time.perf_counter() < deadline:
        res = trainer.train_step(lambda: time.perf_counter() >= deadline)
        if isinstance(res, Stop):
            break
        steps += 1
    return steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--per-device", type=int, default=8)
    ap.add_argument("--policy-steps", type=int, default=25, help="fine-tuning steps per update")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    mix = Mix(seed=1)
    with tempfile.TemporaryDirectory() as d:
        policy = make_policy(Path(d) / "policy")
        opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
        pre = finetune(policy, opt, mix, rng, 300, share_b=0.0)
        policy.save_pretrained(Path(d) / "policy")
        engine = Engine(str(Path(d) / "policy"), EngineConfig(spec_mode="off", max_batch=64))
        target = engine.model
        cfg = TrainerConfig(items_per_micro=4, micro_per_step=2, lr=3e-3, warmup_steps=10,
                            row_len=256)

        # Version 0: fitted on the initial policy's rollouts, then frozen.
        buf = TrainingBuffer(64 << 20)
        samples, _ = rollout(engine, mix, rng, 0.0, args.devices, args.per_device * 2)
        for s in samples:
            buf.add_output(s.token_ids[: s.response_start].tolist(),
                           s.token_ids[s.response_start :].tolist(), 0, 0, s.hidden)
        online = Trainer(EagleDrafter.random_init(target, seed=0), buf, cfg)
        for _ in range(300):
            online.train_step()
        frozen = EagleDrafter.random_init(target, seed=0)
        frozen.load_state_dict(online.drafter.state_dict())
        frozen.eval()

        load = os.getloadavg()[0]
        print(f"drift: policy pre-trained on mix A (loss {pre:.2f}), {args.updates} updates of "
              f"{args.policy_steps} AdamW steps shifting to mix B; {args.devices} emulated "
              f"devices x {args.per_device} long-tailed greedy rollouts; k={args.k}; "
              f"load average {load:.1f}")
        print(f"{'step':>4}{'share B':>8}{'policy loss':>12}{'frozen':>8}{'online':>8}"
              f"{'ratio':>7}{'step s':>8}{'idle dev-s':>11}{'idle %':>7}{'train steps':>12}")
        total_idle = total_dev = 0.0
        ratio = 0.0
        ploss = pre
        for u in range(args.updates + 1):
            share = u / args.updates
            samples, times = rollout(engine, mix, rng, share, args.devices, args.per_device)
            online.drafter.eval()
            acc_f = mean_accepted_length(frozen, samples, args.k)
            acc_o = mean_accepted_length(online.drafter, samples, args.k)
            online.drafter.train()
            ratio = acc_o / acc_f
            wall = max(times)
            idle = sum(wall - t for t in times)
            total_idle += idle
            total_dev += wall * args.devices
            for s in samples:
                buf.add_output(s.token_ids[: s.response_start].tolist(),
                               s.token_ids[s.response_start :].tolist(), u + 1, u + 1, s.hidden)
            steps = train_for(online, idle)
            print(f"{u:>4}{share:>8.2f}{ploss:>12.3f}{acc_f:>8.2f}{acc_o:>8.2f}{ratio:>7.2f}"
                  f"{wall:>8.2f}{idle:>11.2f}{100 * idle / (wall * args.devices):>7.1f}"
                  f"{steps:>12}")
            if u < args.updates:
                ploss = finetune(policy, opt, mix, rng, args.policy_steps,
                                 share_b=(u + 1) / args.updates)
                engine.load_policy({k: v.detach() for k, v in policy.state_dict().items()},
                                   version=u + 1)
        print(f"idle device time harvested for drafter training: {total_idle:.1f} s of "
              f"{total_dev:.1f} device-s ({100 * total_idle / total_dev:.1f}%)")
        print(f"final accepted length online / frozen: {ratio:.2f} "
              f"({'PASS' if ratio >= 1.3 else 'FAIL'}: >= 1.30 required)")


if __name__ == "__main__":
    main()
