"""Multi-turn sessions with and without prefix (KV) reuse, side by side in one run.

    python benchmarks/bench_sessions.py           # 8, 16 and as many turns as the context holds
    python benchmarks/bench_sessions.py --quick   # 4, 8 and 12 short turns (a smoke test)
    python benchmarks/bench_sessions.py --task calculator   # the agentic task's sessions

Each row runs the same sessions through the torch engine twice, on the project's own policy
(models/tiny-policy): "reuse" keys each turn by its session (as the daemon does, so the engine
keeps the session's KV and a turn prefills only its new tokens) and "stateless" re-sends the
whole sequence every turn (a full prefill: what a session cost before prefix reuse). Workload:
`--sessions` sessions step their turns together (each turn of all sessions is one batch); a
session starts with a `--prompt`-token prompt, each turn samples exactly `--answer` tokens
(greedy, no stop token) and the environment then appends `--env` tokens (fixed pseudo-random
tokens per session and turn) before the next turn. Per row: prompt positions prefilled (and
the share reuse saved), turn latency p50 / p99 (the wall time of one turn of all sessions),
the whole run's time and its ratio stateless / reuse, and whether every turn's tokens are
identical in both arms. `--task calculator` runs the agentic task's sessions instead
(`run_task_arm`): each a problem of turns - 1 steps, the policy calling the calculator at the
end of every line and its output appended, as examples/agent_demo.py runs them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = ROOT / "models" / "tiny-policy"
DRAFTER = ROOT / "models" / "tiny-policy-eagle"


@dataclass(frozen=True)
class Workload:
    sessions: int
    prompt: int
    answer: int
    env: int
    max_seq_len: int

    def most_turns(self) -> int:
        """Turns whose whole sequence fits the context."""
        return (self.max_seq_len - self.prompt) // (self.answer + self.env)


@dataclass(frozen=True)
class Arm:
    prefilled: int
    reused: int
    latencies: list[float]
    seconds: float
    tokens: list[list[list[int]]]  # per session, per turn, its sampled tokens


@dataclass(frozen=True)
class Row:
    turns: int
    reuse: Arm
    stateless: Arm

    @property
    def saved(self) -> float:
        return 1 - self.reuse.prefilled / max(1, self.stateless.prefilled)

    @property
    def identical(self) -> bool:
        return self.reuse.tokens == self.stateless.tokens


def _tokens(vocab: int, seed: int, count: int) -> list[int]:
    """Fixed pseudo-random tokens >= 3 (clear of the pad, bos and eos ids)."""
    return [3 + (seed * 7919 + j * 104729) % (vocab - 3) for j in range(count)]


def run_arm(engine, w: Workload, turns: int, keyed: bool, tag: str) -> Arm:
    """All sessions' turns, turn by turn; what the engine prefilled and reused for them."""
    from tltd.domain import SamplingParams
    from tltd_workers.engine.engine import Request

    vocab = engine.model.config.vocab_size
    sp = SamplingParams(n=1, temperature=0.0, max_new_tokens=w.answer, stop_token_ids=())
    contexts = [_tokens(vocab, s, w.prompt) for s in range(w.sessions)]
    tokens: list[list[list[int]]] = [[] for _ in range(w.sessions)]
    before = engine.prefix.stats.prefilled_tokens, engine.prefix.stats.reused_tokens
    latencies: list[float] = []
    start = time.perf_counter()
    for t in range(turns):
        reqs = []
        for s, ctx in enumerate(contexts):
            if t:
                ctx += _tokens(vocab, 1000 * s + t, w.env)
            key = f"{tag}-{s}" if keyed else ""
            reqs.append(Request(f"{tag}-{s}-{t}", list(ctx), sp, cache_key=key))
        t0 = time.perf_counter()
        outs = {o.request_id: o for o in engine.generate(reqs)}
        latencies.append(time.perf_counter() - t0)
        for s, ctx in enumerate(contexts):
            out = outs[f"{tag}-{s}-{t}"].token_ids
            tokens[s].append(list(out))
            ctx += out
    seconds = time.perf_counter() - start
    prefilled = engine.prefix.stats.prefilled_tokens - before[0]
    return Arm(prefilled, engine.prefix.stats.reused_tokens - before[1], latencies, seconds, tokens)


def run_task_arm(engine, w: Workload, turns: int, keyed: bool, tag: str) -> Arm:
    """`run_arm` on the agentic task (examples/agent_demo.py's): each session a problem of
    `turns - 1` steps, the policy (greedy) writing until it calls the calculator (`=`) or
    stops, the calculator's output appended before the next turn; a session ends when the
    policy stops without a call."""
    from examples.task import decode, load_tokenizer
    from examples.task.calculator import CALL, calculator
    from examples.task.workload import STOP_TOKEN_ID, rollout_prompts
    from tltd.domain import SamplingParams
    from tltd_workers.engine.engine import Request

    tok = load_tokenizer(MODEL)
    call = tok.token_to_id(CALL)
    sp = SamplingParams(
        n=1, temperature=0.0, max_new_tokens=w.answer, stop_token_ids=(STOP_TOKEN_ID, call)
    )
    items = rollout_prompts(w.sessions, seed=turns, model_dir=MODEL, num_steps=turns - 1)
    contexts = [list(ids) for _, ids in items]
    answers: list[list[int]] = [[] for _ in contexts]  # after the prompt: sampled and tool
    tokens: list[list[list[int]]] = [[] for _ in contexts]
    before = engine.prefix.stats.prefilled_tokens, engine.prefix.stats.reused_tokens
    latencies: list[float] = []
    start = time.perf_counter()
    active = list(range(len(contexts)))
    while active:
        key = (lambda s: f"{tag}-{s}") if keyed else (lambda s: "")
        reqs = [
            Request(f"{tag}-{s}-{len(tokens[s])}", contexts[s] + answers[s], sp, cache_key=key(s))
            for s in active
        ]
        t0 = time.perf_counter()
        outs = {o.request_id: o.token_ids for o in engine.generate(reqs)}
        latencies.append(time.perf_counter() - t0)
        for s in list(active):
            out = list(outs[f"{tag}-{s}-{len(tokens[s])}"])
            tokens[s].append(out)
            answers[s] += out
            if out and out[-1] == call and len(tokens[s]) < turns:
                answers[s] += tok.encode(calculator(decode(tok, answers[s])),
                                         add_special_tokens=False).ids  # fmt: skip
            else:
                active.remove(s)
    seconds = time.perf_counter() - start
    prefilled = engine.prefix.stats.prefilled_tokens - before[0]
    return Arm(prefilled, engine.prefix.stats.reused_tokens - before[1], latencies, seconds, tokens)


def _engine(w: Workload, spec: str):
    """`spec`: off, fixed (n-gram drafts, k 4) or eagle (the shipped EAGLE drafter, k 4)."""
    from tltd_workers.engine.bandit import Strategy
    from tltd_workers.engine.eagle import EagleDrafter
    from tltd_workers.engine.engine import Engine, EngineConfig

    cfg = EngineConfig(
        max_batch=max(1, w.sessions), max_seq_len=w.max_seq_len,
        spec_mode="off" if spec == "off" else "fixed",
        strategies=(Strategy("eagle" if spec == "eagle" else "ngram", 4),),
        batch_threshold=max(1, w.sessions),
    )  # fmt: skip
    engine = Engine(str(MODEL), cfg)
    if spec == "eagle":
        engine.set_drafter(EagleDrafter.from_pretrained(DRAFTER, engine.model), 1)
    return engine


def _described(w: Workload, spec: str, threads: int, task: bool) -> str:
    if task:
        what = (
            f"{w.sessions} sessions of the agentic task stepped together, each a problem of "
            f"turns - 1 steps: the policy (greedy) writes until it calls the calculator (at "
            f"most {w.answer} tokens a turn), the calculator's output is appended; problems "
            f"of at most 24 steps (25 turns); context {w.max_seq_len}"
        )
    else:
        what = (
            f"{w.sessions} sessions stepped together, prompt {w.prompt} tokens, each turn "
            f"samples {w.answer} tokens (greedy, no stop) then the environment adds {w.env}; "
            f"context {w.max_seq_len} (at most {w.most_turns()} turns)"
        )
    return f"workload: {what}; model {MODEL.name}; SD {spec}; {threads} thread(s)"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def table(rows: list[Row]) -> str:
    head = (
        "turns | arm       | prefilled | reused  | saved | turn p50 ms | turn p99 ms | "
        "run s  | ratio | identical"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        for name, arm in (("reuse", r.reuse), ("stateless", r.stateless)):
            reuse = name == "reuse"
            lines.append(
                f"{r.turns:5d} | {name:9s} | {arm.prefilled:9d} | {arm.reused:7d} | "
                f"{(f'{100 * r.saved:4.1f}%' if reuse else '    -'):>5s} | "
                f"{1000 * statistics.median(arm.latencies):11.1f} | "
                f"{1000 * _pct(arm.latencies, 0.99):11.1f} | {arm.seconds:6.2f} | "
                f"{(f'{r.stateless.seconds / r.reuse.seconds:4.2f}x' if reuse else '    -'):>5s} | "
                f"{('yes' if r.identical else 'NO') if reuse else ''}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short turns and context (smoke test)")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--answer", type=int, default=32, help="tokens sampled per turn")
    p.add_argument("--env", type=int, default=24, help="environment tokens per turn")
    p.add_argument("--max-seq-len", type=int, default=2304, help="the engine's context")
    p.add_argument("--turns", default="8,16,max", help="comma-separated; max = what fits")
    p.add_argument(
        "--spec", default="off", choices=("off", "fixed", "eagle"),
        help="fixed: n-gram SD; eagle: the shipped EAGLE drafter (models/tiny-policy-eagle)",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--task", default="synthetic", choices=("synthetic", "calculator"),
        help="calculator: the agentic task's sessions (a problem of turns - 1 steps, the "
        "policy calling the calculator; --answer caps a turn, --prompt and --env unused)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.prompt, args.answer, args.env, args.max_seq_len = 2, 8, 4, 3, 96
        args.turns = "4,8,max"
    import torch

    torch.set_num_threads(args.threads)
    w = Workload(args.sessions, args.prompt, args.answer, args.env, args.max_seq_len)
    task = args.task == "calculator"
    if task:  # a turn of the task: a line of ~21 tokens (its tool output included)
        w = replace(w, prompt=64, answer=max(w.answer, 24), env=0)
    most = w.most_turns()
    if task:
        from examples.task.reasoning import MAX_STEPS

        most = min(most, MAX_STEPS + 1)  # the task's longest problem, a turn per step and one
    counts = [most if x == "max" else min(int(x), most) for x in args.turns.split(",")]
    print(_described(w, args.spec, args.threads, task))
    reusing, stateless = _engine(w, args.spec), _engine(w, args.spec)
    arm = run_task_arm if task else run_arm
    for engine in (reusing, stateless):  # first forwards allocate: not in either arm's time
        arm(engine, w, 2, False, "warm-up")
    rows = []
    for i, turns in enumerate(counts):
        tag = f"r{i}"
        rows.append(
            Row(turns, arm(reusing, w, turns, True, tag), arm(stateless, w, turns, False, tag))
        )
    print(table(rows))
    if task:
        print("turns done per session: " + "; ".join(
            f"{r.turns}: {sorted({len(t) for t in r.reuse.tokens})}" for r in rows
        ))  # fmt: skip
    if args.spec != "off":
        print("drafts accepted / drafted, warm-up included: " + ", ".join(
            f"{name} {e.stats.summary()['tokens']['accepted']} / "
            f"{e.stats.summary()['drafted_tokens']}"
            for name, e in (("reuse", reusing), ("stateless", stateless))
        ))  # fmt: skip
    return 0 if all(r.identical for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
