"""`make demo-agent`: GRPO over multi-turn agent sessions of a real `tltd serve`.

    python examples/agent_demo.py            # 12 RL steps, held-out reward before and after
    python examples/agent_demo.py --quick    # 2 tiny steps, a smoke test

The agent is the task's policy with a calculator (examples/task/calculator.py): a turn ends
when the policy writes `=` after a line's operands, and the environment writes their sum; up to
`calls` calls per session, after which the policy computes alone. Each session is one daemon
session (docs/sessions.md): the prompt, then per turn the tool's output (environment tokens,
loss mask 0) and what the policy sampled (mask 1, with its behaviour logprob and policy
version). The reward is the final answer's (1 or 0).

Why a calculator and not a checker that answers "wrong, check again" after the answer: the
shipped policy was never trained on text after its `<eos>` or its `answer:` marker, and in-process
it got 0 of 24 such retries right (after "check", a re-posed prompt, or both). The calculator's
output is what the policy would have written next, so every turn stays in the policy's format.

Each RL step: per prompt a group of n sessions (`OpenSessionGroup`), every session run turn by
turn, all at once -> close each and take its trajectory -> group-normalised advantages -> one
clipped policy-gradient update on the trajectories' sampled tokens, the ratio taken against
the daemon's behaviour logprobs -> push the new weights in-band (the next step's turns run on
them). The held-out prompts are run the same way with fixed seeds, before and after, paired.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.cpu_time import torch_threads  # noqa: E402
from examples.grpo_demo import DEMO_LR, MODEL, Daemon, run_then_stop  # noqa: E402
from examples.grpo_trainer import GRPOTrainer, Scored, group_advantages  # noqa: E402
from examples.heldout import HeldOutScore, paired  # noqa: E402
from examples.task import decode, load_tokenizer, reward  # noqa: E402
from examples.task.calculator import CALL, calculator  # noqa: E402
from examples.task.dataset import HELD_OUT_SAMPLING_SEED, Item, TaskDataset, build_dataset  # noqa: E402
from examples.task.reasoning import ANSWER_MARKER  # noqa: E402
from examples.task.workload import STOP_TOKEN_ID  # noqa: E402
from tltd.v1 import rollout_pb2  # noqa: E402
from tltd_clients import RolloutClient, TltClient  # noqa: E402

# Seeds of a turn: base + (session number * TURN_SEEDS + turn), so that no two turns of a step
# share one and the held-out turns are the same before and after.
TURN_SEEDS = 64


@dataclass(frozen=True)
class AgentConfig:
    steps: int = 12  # 6 epochs of the training set
    prompts: int = 16  # per step
    train_prompts: int = 32
    held_out_prompts: int = 32
    n: int = 8  # sessions per prompt (the GRPO group)
    held_out_n: int = 16  # chosen after 8 gave +2.6 standard errors (docs/sessions.md)
    max_new_tokens: int = 1024  # sampled per session, all turns together
    calls: int = 4  # calculator calls per session
    lr: float = DEMO_LR
    seed: int = 0
    cpu_slots: int = 2
    # The update's torch threads (0: every core, the rollout being over by then). 1: on a
    # machine other jobs loaded, a 2-thread update took 183 s against 14-24 s on one (threads
    # spin waiting for descheduled peers); the measured runs (docs/sessions.md) used 1.
    update_threads: int = 1


QUICK = AgentConfig(
    steps=2, prompts=2, train_prompts=2, held_out_prompts=2, n=4, held_out_n=2,
    max_new_tokens=96, calls=2,
)  # fmt: skip


@dataclass(frozen=True)
class Episode:
    """One closed session: its trajectory (the daemon's), how its turns went, and its reward."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    prompt_length: int
    inputs: list[list[int]]  # per turn: the environment's tokens before it (none on the first)
    outputs: list[int]  # per turn: how many tokens the policy sampled
    calls: int
    reward: float = 0.0

    @property
    def turns(self) -> int:
        return len(self.outputs)

    @property
    def answer_ids(self) -> list[int]:
        return self.token_ids[self.prompt_length :]

    def sampled(self) -> int:
        return sum(self.loss_mask[self.prompt_length :])

    def environment(self) -> int:
        return len(self.answer_ids) - self.sampled()


# ---- one session, turn by turn -------------------------------------------------------------


class Agent:
    """Runs sessions of a job: the policy's turns through the daemon, the calculator here."""

    def __init__(self, client: TltClient, job_id: str, cfg: AgentConfig, model: Path) -> None:
        self.client, self.job_id, self.cfg = client, job_id, cfg
        self.tok = load_tokenizer(model)
        self.call_id = self.tok.token_to_id(CALL)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def run(self, session_id: str, seed: int) -> tuple[list[list[int]], list[int], int]:
        """The session's turns until the policy stops without a call, or its budget of sampled
        tokens or calls is spent: (each turn's input, each turn's sampled count, calls)."""
        answer: list[int] = []  # sampled and environment tokens after the prompt
        inputs: list[int] = []
        script: tuple[list[list[int]], list[int]] = ([], [])
        calls = sampled = turn = 0
        while sampled < self.cfg.max_new_tokens:
            tool = calls < self.cfg.calls
            sp = rollout_pb2.SamplingParams(
                temperature=1.0, max_new_tokens=self.cfg.max_new_tokens - sampled,
                stop_token_ids=[STOP_TOKEN_ID, self.call_id] if tool else [STOP_TOKEN_ID],
                seed=seed + turn,
            )  # fmt: skip
            out = self.client.turn(session_id, turn, inputs, sampling=sp).turn
            turn += 1
            script[0].append(inputs)
            script[1].append(len(out.token_ids))
            answer += [*inputs, *out.token_ids]
            sampled += len(out.token_ids)
            if not (tool and out.token_ids and out.token_ids[-1] == self.call_id):
                break
            inputs = self.encode(calculator(decode(self.tok, answer)))
            calls += 1
        return script[0], script[1], calls

    def rollout(self, items: list[Item], n: int, seed: int, tag: str) -> list[Episode]:
        """n sessions per item (a group each), all run at once, closed; in (prompt, sample)
        order, each with its reward."""
        work = []
        for i, (_, ids) in enumerate(items):
            group = self.client.open_session_group(self.job_id, ids, n, f"{self.job_id}.{tag}.p{i}")
            work += [(i, k, s.session_id) for k, s in enumerate(group.sessions)]

        def one(w: tuple[int, int, str]) -> Episode:
            i, k, sid = w
            inputs, outputs, calls = self.run(sid, seed + (i * n + k) * TURN_SEEDS)
            t = self.client.close_session(sid).trajectory
            ep = Episode(i, k, list(t.token_ids), list(t.loss_mask), list(t.logprobs),
                         list(t.policy_versions), int(t.prompt_length), inputs, outputs,
                         calls)  # fmt: skip
            text = decode(self.tok, ep.answer_ids)
            return replace(ep, reward=reward(items[i][0], text))

        with ThreadPoolExecutor(max_workers=len(work)) as pool:
            return list(pool.map(one, work))


def to_scored(episodes: list[Episode]) -> list[Scored]:
    """The trainer's samples: everything after the prompt, trained where the mask is 1, with
    GRPO advantages per prompt group."""
    groups: dict[int, list[Episode]] = {}
    for ep in episodes:
        groups.setdefault(ep.prompt_index, []).append(ep)
    advantages = group_advantages([[ep.reward for ep in g] for g in groups.values()])
    return [
        Scored(
            ep.token_ids[: ep.prompt_length],
            ep.answer_ids,
            ep.logprobs[ep.prompt_length :],
            ep.reward,
            a,
            loss_mask=ep.loss_mask[ep.prompt_length :],
        )
        for g, adv in zip(groups.values(), advantages, strict=True)
        for ep, a in zip(g, adv, strict=True)
    ]


# ---- the run -------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentRow:
    step: int
    reward: float
    turns: float  # per session
    calls: float  # per session
    sampled: int  # tokens, mask 1
    environment: int  # tokens, mask 0
    versions: tuple[int, int]  # the lowest and highest policy version of a sampled token
    logprob_gap: float
    rollout_s: float
    update_s: float


ROW_HEADER = (
    "step  reward  turns  calls  sampled  env tok  versions  logprob gap  rollout s  update s"
    "  step s"
)


def print_row(r: AgentRow) -> None:
    print(
        f"{r.step:4d}  {r.reward:6.3f}  {r.turns:5.2f}  {r.calls:5.2f}  {r.sampled:7d}  "
        f"{r.environment:7d}  {r.versions[0]:>3d}-{r.versions[1]:<4d}  {r.logprob_gap:11.1e}  "
        f"{r.rollout_s:9.1f}  {r.update_s:8.1f}  {r.rollout_s + r.update_s:6.1f}",
        flush=True,
    )


def sampled_versions(episodes: list[Episode]) -> tuple[int, int]:
    vs = [v for ep in episodes for v, m in zip(ep.versions, ep.loss_mask, strict=True) if m]
    return (min(vs, default=0), max(vs, default=0))


class AgentRun:
    """One RL run: a job on the daemon, the trainer, and the step loop."""

    def __init__(self, cfg: AgentConfig, daemon: Daemon, dataset: TaskDataset, model: Path):
        self.cfg, self.dataset = cfg, dataset
        self.job_id = "agent-grpo"
        self.client = RolloutClient(daemon.target)
        self.client.create_job(model, job_id=self.job_id, speculative="off", online_training=False)
        self.agent = Agent(self.client.raw, self.job_id, cfg, model)
        self.trainer = GRPOTrainer(model, lr=cfg.lr, seed=cfg.seed)
        self.episodes: list[list[Episode]] = []  # per step, for checks

    def step(self, step: int) -> AgentRow:
        """Roll out the step's groups of sessions, update the policy, push it."""
        items = self.dataset.batch(step)
        t0 = time.perf_counter()
        episodes = self.agent.rollout(items, self.cfg.n, self.cfg.seed * 10**6, f"s{step}")
        rollout_s = time.perf_counter() - t0
        self.episodes.append(episodes)
        scored = to_scored(episodes)
        t1 = time.perf_counter()
        with torch_threads(self.cfg.update_threads or os.cpu_count() or 1):
            stats = self.trainer.update(scored)
        self.client.push_policy(self.trainer.model.state_dict(), note=f"agent step {step + 1}")
        count = max(1, len(episodes))
        row = AgentRow(
            step=step,
            reward=sum(ep.reward for ep in episodes) / count,
            turns=sum(ep.turns for ep in episodes) / count,
            calls=sum(ep.calls for ep in episodes) / count,
            sampled=sum(ep.sampled() for ep in episodes),
            environment=sum(ep.environment() for ep in episodes),
            versions=sampled_versions(episodes),
            logprob_gap=stats.max_logprob_gap,
            rollout_s=rollout_s,
            update_s=time.perf_counter() - t1,
        )
        print_row(row)
        return row

    def close(self) -> None:
        self.client.close()


def held_out(
    daemon: Daemon, checkpoint: Path, dataset: TaskDataset, cfg: AgentConfig, label: str
) -> HeldOutScore:
    """The held-out reward of a policy: its own job, the held-out prompts' sessions with fixed
    seeds (the same turns' seeds for every policy, so scores pair sample by sample)."""
    t0 = time.perf_counter()
    job_id = f"agent-held-out-{label}"
    with RolloutClient(daemon.target) as client:
        client.create_job(checkpoint, job_id=job_id, speculative="off", online_training=False)
        agent = Agent(client.raw, job_id, cfg, checkpoint)
        episodes = agent.rollout(dataset.held_out, cfg.held_out_n, HELD_OUT_SAMPLING_SEED, "h")
        client.raw.cancel_job(job_id, "held-out score taken")
    texts = [decode(agent.tok, ep.answer_ids) for ep in episodes]
    out = HeldOutScore(
        rewards=[ep.reward for ep in episodes],
        lengths=[ep.sampled() for ep in episodes],
        guesses=[t.lstrip().startswith(ANSWER_MARKER) for t in texts],
        prompts=[ep.prompt_index for ep in episodes],
    )
    turns = sum(ep.turns for ep in episodes) / max(1, len(episodes))
    print(
        f"  held out ({label}): reward {out.mean:.3f}, guesses {out.guess_share:.2f}, "
        f"turns {turns:.2f}, sampled {out.mean_length:.0f} tokens "
        f"({time.perf_counter() - t0:.0f}s)",
        flush=True,
    )
    return out


@dataclass
class Outcome:
    rows: list[AgentRow]
    before: HeldOutScore
    after: HeldOutScore
    run: AgentRun
    seconds: float


def train(cfg: AgentConfig, daemon: Daemon, model: Path, work_dir: Path) -> Outcome:
    """Held-out score, the RL steps, held-out score of the final policy."""
    t0 = time.perf_counter()
    dataset = build_dataset(cfg.prompts, cfg.train_prompts, cfg.held_out_prompts, model_dir=model)
    before = held_out(daemon, model, dataset, cfg, "initial")
    run = AgentRun(cfg, daemon, dataset, model)
    try:
        print(f"\n{ROW_HEADER}", flush=True)
        rows = [run.step(step) for step in range(cfg.steps)]
        run.client.raw.cancel_job(run.job_id, "agent run finished")
    finally:
        run.close()
    final = run.trainer.save(work_dir / "final-agent")
    after = held_out(daemon, final, dataset, cfg, "final")
    return Outcome(rows, before, after, run, time.perf_counter() - t0)


def summary(out: Outcome) -> str:
    diff, se = paired(out.before.rewards, out.after.rewards, out.before.prompts)
    ses = diff / se if se > 0 else float("nan")
    rows = out.rows
    sampled = sum(r.sampled for r in rows)
    env = sum(r.environment for r in rows)
    return (
        f"held-out reward {out.before.mean:.3f} -> {out.after.mean:.3f}: {diff:+.3f} +- {se:.3f} "
        f"({ses:+.1f} standard errors over prompts, paired); guesses "
        f"{out.before.guess_share:.2f} -> {out.after.guess_share:.2f}\n"
        f"{len(rows)} steps: {sampled} sampled tokens trained on, {env} environment tokens "
        f"masked out; largest trainer/daemon logprob gap "
        f"{max((r.logprob_gap for r in rows), default=0.0):.1e}; "
        f"{out.seconds / 60:.1f} min (held-out scores included)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 tiny steps")
    names = ("steps", "prompts", "n", "held-out-n", "calls", "max-new-tokens", "seed",
             "update-threads")  # fmt: skip
    for name in names:
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--lr", type=float, help=f"the trainer's AdamW lr (default {DEMO_LR})")
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--work-dir", type=Path, help="keep checkpoints and the daemon's data")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else AgentConfig()
    given = {k: v for k, v in vars(args).items() if k in vars(cfg) and v is not None}
    cfg = AgentConfig(**(vars(cfg) | given))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the demo prints its own progress
    with tempfile.TemporaryDirectory(prefix="tltd-agent-") as tmp:
        work_dir = (args.work_dir or Path(tmp)).resolve()
        work_dir.mkdir(parents=True, exist_ok=True)
        print(f"starting tltd serve ({cfg.cpu_slots} CPU slots)", flush=True)
        daemon = Daemon(work_dir, cfg.cpu_slots)

        def run() -> None:
            print(
                f"daemon at {daemon.target}; {cfg.steps} GRPO steps, {cfg.prompts} prompts x "
                f"{cfg.n} sessions, up to {cfg.calls} calculator calls and {cfg.max_new_tokens} "
                f"sampled tokens per session; held out {cfg.held_out_prompts} x "
                f"{cfg.held_out_n}",
                flush=True,
            )
            print(summary(train(cfg, daemon, args.model.resolve(), work_dir)), flush=True)

        return run_then_stop(daemon, "agent demo", run)


if __name__ == "__main__":
    raise SystemExit(main())
