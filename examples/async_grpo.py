"""The demo's asynchronous GRPO run: the next step's rollout runs while the trainer updates.

Each step's request is bounded (`bound_groups` = the step's prompts, `carried=True`): its stream
ends once that many whole groups are done, whichever of the job's requests they answer (oldest
first); with requests in flight together a step does not wait for its slowest groups: they
carry to the next step. Requests are sent `LOOKAHEAD` steps ahead, so the daemon rolls out the
next prompts while the trainer trains; the new weights are pushed mid-rollout and the job
(policy_switch "next_step") moves its running samples to them between decode steps, recording
per token which version sampled it. A group with a token more than `max_staleness` versions
old is never returned.

Off-policy tokens are not hidden from the loss: the update is PPO's clipped surrogate with the
ratio p / p_behaviour, the behaviour being the daemon's logprob of the version that sampled
each token (the importance ratio of the stale sample, clipped: a trust region around the policy
that sampled it). `decoupled_pg_loss` (AReaL's decoupled PPO: the ratio clipped against the
trainer's own weights, each token weighted by proximal / behaviour probability truncated at
`IS_CAP`) is the alternative `benchmarks/bench_async.py` compares; with one update pass per
step it has no trust region and lost held-out reward here (docs/demo.md).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from examples.cpu_time import demo_cpu, torch_threads
from examples.grpo_trainer import (
    GRPOTrainer,
    Scored,
    UpdateStats,
    clipped_surrogate,
    group_advantages,
)
from examples.task import decode, load_tokenizer, reward
from examples.task.dataset import TaskDataset
from examples.task.workload import STOP_TOKEN_ID
from tltd_clients import RolloutClient, RolloutSample, by_prompt

# Truncated importance weight (proximal / behaviour): a token the current policy finds far more
# likely than the stale one that sampled it counts at most this much.
IS_CAP = 2.0
MAX_STALENESS = 2  # versions (AReaL's eta): the job never sends older groups
LOOKAHEAD = 2  # requests sent ahead of the step being trained: two steps' prompts in flight


def decoupled_pg_loss(cap: float = IS_CAP) -> Any:
    """The decoupled PPO surrogate, with `clipped_pg_loss`'s signature (the behaviour logprobs
    in its `old_logprobs`): -w * min(r * A, clip(r) * A) per token, with r = p / p_prox
    (p_prox: these weights, no gradient) and w = min(cap, p_prox / p_behaviour)."""

    def loss(
        logprobs: Tensor,
        behaviour: Tensor,
        advantages: Tensor,
        mask: Tensor,
        clip: float,
        token_level: bool = False,
    ) -> tuple[Tensor, Tensor]:
        prox = logprobs.detach()
        weight = torch.exp(prox - behaviour).clamp(max=cap)
        ratio = torch.exp(logprobs - prox)
        return clipped_surrogate(ratio, advantages, mask, clip, token_level, weight)

    return loss


def token_staleness(samples: list[RolloutSample], version: int) -> list[int]:
    """Per output token: `version` less the policy version that sampled it."""
    out: list[int] = []
    for s in samples:
        spans = s.policy_spans or [(0, s.policy_version)]
        ends = [first for first, _ in spans[1:]] + [len(s.token_ids)]
        for (first, v), end in zip(spans, ends, strict=True):
            out += [version - v] * (end - first)
    return out


@dataclass(frozen=True)
class AsyncRow:
    step: int
    wait_s: float  # the trainer waiting for the step's groups (after its previous update)
    update_s: float  # update and push
    step_s: float  # between the ends of consecutive updates (the first: from the run's start)
    groups: int
    carried: int  # groups sent by a later request than their own
    staleness_mean: float  # per token, versions behind the policy being updated
    staleness_max: int
    partial: float  # share of samples whose tokens came from more than one version
    mean_reward: float


class _Pending(threading.Thread):
    """One bounded request, streamed in the background."""

    def __init__(self, client: RolloutClient, prompts: list[list[int]], n: int, **kw: Any):
        super().__init__(daemon=True)
        self.client, self.prompts, self.n, self.kw = client, prompts, n, kw
        self.samples: list[RolloutSample] = []
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            self.samples = self.client.generate(
                self.prompts, n=self.n, bound_groups=len(self.prompts), carried=True, **self.kw
            )
        except Exception as exc:  # surfaced by result()
            self.error = exc

    def result(self) -> list[RolloutSample]:
        self.join()
        if self.error is not None:
            raise self.error
        return self.samples


class AsyncRun:
    """The asynchronous TLT run: one job, one trainer, rollout overlapping the update."""

    def __init__(
        self,
        cfg: Any,
        target: str,
        dataset: TaskDataset,
        model: Path,
        drafter: Path | None,
        *,
        max_staleness: int = MAX_STALENESS,
        lookahead: int = LOOKAHEAD,
        decoupled: bool = False,
        job_id: str = "grpo-async",
        token_budget: int = 0,
    ) -> None:
        """`lookahead`: requests sent ahead of the step being trained (0: the next one only
        after the update is pushed, a synchronous run); `decoupled`: decoupled PPO instead of
        the clipped ratio against the behaviour logprobs; `token_budget`: tokens a sample may
        emit per step (0: no budget), the rest paused and resumed by later steps' requests."""
        self.cfg, self.dataset, self.model = cfg, dataset, model
        self.job_id, self.lookahead, self.token_budget = job_id, lookahead, token_budget
        self.tok = load_tokenizer(model)
        self.trainer = GRPOTrainer(model, lr=cfg.lr, seed=cfg.seed, kl_coef=cfg.kl)
        if decoupled:
            self.trainer.pg_loss = decoupled_pg_loss()
        self.client = RolloutClient(target)
        self.client.create_job(
            model, job_id=self.job_id, speculative="auto", online_training=True,
            initial_drafter=drafter, policy_switch="next_step", max_staleness=max_staleness,
        )  # fmt: skip
        self.work: dict[str, list[Any]] = {}  # request id -> its (problem, prompt ids) items
        self.rows: list[AsyncRow] = []
        self.stats: list[UpdateStats] = []  # each update's
        self.cpu_s = 0.0

    def _submit(self, step: int) -> _Pending:
        work = self.dataset.batch(step)
        rid = self._rid(step)
        self.work[rid] = work
        return _Pending(
            self.client, [ids for _, ids in work], self.cfg.n, request_id=rid,
            temperature=1.0, max_new_tokens=self.cfg.max_new_tokens,
            stop_token_ids=[STOP_TOKEN_ID], seed=self.cfg.seed * 1000 + step,
            max_tokens=self.token_budget,
        )  # fmt: skip

    def run(
        self, print_row: Any = None, cpu: Any = lambda: 0.0, keep: Any = None
    ) -> list[AsyncRow]:
        """Every step; the leftover groups are dropped with the job at the end. `cpu()`: CPU
        seconds so far, read when the first step's timing starts and after the last update
        (`cpu_s`); `keep(step, seconds, model)` after each update (a copy of the weights, in
        the step's time: the rollouts go on meanwhile)."""
        self.client.generate(
            [self.dataset.held_out[0][1]], n=1, temperature=0.0, max_new_tokens=4
        )  # fmt: skip - warm-up, not timed
        ahead, steps = self.lookahead, self.cfg.steps
        last, cpu0 = time.perf_counter(), cpu()
        pending = [self._submit(k) for k in range(min(max(1, ahead), steps))]
        for step in range(steps):
            t0 = time.perf_counter()
            samples = pending.pop(0).result()
            waited = time.perf_counter() - t0
            if ahead and step + ahead < steps:
                pending.append(self._submit(step + ahead))  # rolls out during the update
            row = self._update(step, samples, waited, last)
            if not ahead and step + 1 < steps:
                pending.append(self._submit(step + 1))
            last = time.perf_counter()
            self.rows.append(row)
            if keep is not None:
                keep(step + 1, sum(r.step_s for r in self.rows), self.trainer.model)
            if print_row is not None:
                print_row(row)
        self.cpu_s = cpu() - cpu0
        self.client.raw.cancel_job(self.job_id, "demo run finished")
        return self.rows

    def _update(self, step: int, samples: list[RolloutSample], waited: float, last: float):
        t0 = time.perf_counter()
        scored, rewards = self._score(samples)
        # Half the cores while the daemon's workers roll out the next steps; all without.
        cores = os.cpu_count() or 2
        with torch_threads(max(1, cores // 2) if self.lookahead else cores):
            self.stats.append(self.trainer.update(scored))
        self.client.push_policy(self.trainer.model.state_dict(), note=f"async step {step + 1}")
        now = time.perf_counter()
        stale = token_staleness(samples, step)
        groups = by_prompt(samples)
        return AsyncRow(
            step=step, wait_s=waited, update_s=now - t0, step_s=now - last,
            groups=len(groups), carried=sum(g[0].request_id != self._rid(step) for g in groups),
            staleness_mean=sum(stale) / max(1, len(stale)), staleness_max=max(stale, default=0),
            partial=sum(len(s.policy_spans) > 1 for s in samples) / max(1, len(samples)),
            mean_reward=sum(rewards) / max(1, len(rewards)),
        )  # fmt: skip

    def _rid(self, step: int) -> str:
        return f"{self.job_id}-step-{step}"

    def _score(self, samples: list[RolloutSample]) -> tuple[list[Scored], list[float]]:
        """Rewards and GRPO advantages per group; a carried group's prompt is its own."""
        groups = by_prompt(samples)
        rewards = [
            [reward(self.work[s.request_id][s.prompt_index][0], decode(self.tok, s.token_ids))
             for s in g]
            for g in groups
        ]  # fmt: skip
        scored = [
            Scored(list(self.work[s.request_id][s.prompt_index][1]), s.token_ids, s.logprobs, r, a)
            for g, rs, adv in zip(groups, rewards, group_advantages(rewards), strict=True)
            for s, r, a in zip(g, rs, adv, strict=True)
        ]
        return scored, [r for rs in rewards for r in rs]

    def close(self) -> None:
        self.client.close()


# ---- what the run cost, and its report -------------------------------------------------------


@dataclass(frozen=True)
class AsyncOutcome:
    rows: list[AsyncRow]
    wall_s: float  # the steps' wall time (the sum of step_s)
    cpu_s: float  # the daemon's and the trainer's CPU seconds over those steps
    cores: int


def run_async(
    cfg: Any,
    daemon: Any,
    dataset: TaskDataset,
    model: Path,
    drafter: Path | None,
    keep: Any = None,
):
    """The asynchronous TLT run, timed and its CPU counted over the steps; (outcome, trainer).
    `keep(step, seconds, model)`: called after each update (the held-out curves)."""
    run = AsyncRun(cfg, daemon.target, dataset, model, drafter)
    try:
        rows = run.run(print_async_row, cpu=lambda: demo_cpu(daemon.proc.pid), keep=keep)
    finally:
        run.close()
    outcome = AsyncOutcome(rows, sum(r.step_s for r in rows), run.cpu_s, os.cpu_count() or 1)
    return outcome, run.trainer


ASYNC_HEADER = (
    "async step | wait s | update s | step s | groups (carried) | staleness mean/max | "
    "partial | reward"
)


def print_async_row(r: AsyncRow) -> None:
    if r.step == 0:
        print(f"\n{ASYNC_HEADER}", flush=True)
    print(
        f"  {r.step:8d} | {r.wait_s:6.1f} | {r.update_s:8.1f} | {r.step_s:6.1f} | "
        f"{r.groups:6d} ({r.carried:2d})     | {r.staleness_mean:9.2f} / {r.staleness_max:<3d} | "
        f"{100 * r.partial:6.1f}% | {r.mean_reward:.3f}",
        flush=True,
    )


def print_async_summary(outcome: AsyncOutcome, results: dict, scores: dict) -> None:
    """End-to-end step speedup against the synchronous SD-off run, measured, beside this
    machine's bound for it (the synchronous TLT step's work, rollout and update CPU-seconds of
    the daemon and the trainer, spread over every core with nothing idle), staleness, and the
    held-out reward, paired over prompts."""
    from examples.heldout import paired

    rows, steps = outcome.rows, max(1, len(outcome.rows))
    off_rows, tlt_rows = results.get("off", []), results.get("tlt", [])
    off = sum(r.step_s for r in off_rows) / max(1, len(off_rows))
    mean = outcome.wall_s / steps
    line = f"asynchronous TLT: {mean:.1f} s per step against {off:.1f} s synchronous SD-off: "
    line += f"end-to-end step speedup {off / mean:.2f}x (measured)"
    if tlt_rows:
        work = sum(r.rollout_cpu + r.update_cpu for r in tlt_rows) / len(tlt_rows)
        line += (
            f"; bound {off / (work / outcome.cores):.2f}x (the synchronous TLT step's work, "
            f"{work:.1f} CPU-s, over {outcome.cores} cores with nothing idle)"
        )
    print(line + f"; the asynchronous run's own CPU {outcome.cpu_s / steps:.1f} s per step")
    stale = [round(r.staleness_mean, 2) for r in rows]
    worst = max((r.staleness_max for r in rows), default=0)
    partial = 100 * sum(r.partial for r in rows) / steps
    print(
        f"  off-policy tokens, not hidden: staleness per step (versions behind the policy "
        f"updated) {stale}, max {worst}; partial (tokens of two versions) {partial:.0f}% of "
        f"samples; carried groups {sum(r.carried for r in rows)}; the loss clips each token's "
        f"ratio to the behaviour logprob of the version that sampled it"
    )
    first, last = scores["initial"], scores["async"]
    delta, se = paired(first.rewards, last.rewards, first.prompts or None)
    line = f"  held out: {last.mean:.3f}, change {delta:+.3f} +- {se:.3f} (over prompts)"
    if "tlt" in scores:
        d2, se2 = paired(scores["tlt"].rewards, last.rewards, first.prompts or None)
        line += f"; async - synchronous TLT at the end {d2:+.3f} +- {se2:.3f}"
    print(line, flush=True)
