"""Multi-turn sessions with and without prefix (KV) reuse, side by side in one run.

    python benchmarks/bench_sessions.py           # 8, 16 and as many turns as the context holds
    python benchmarks/bench_sessions.py --quick   # 4, 8 and 12 short turns (a smoke test)

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
identical in both arms.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
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
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.prompt, args.answer, args.env, args.max_seq_len = 2, 8, 4, 3, 96
        args.turns = "4,8,max"
    import torch

    torch.set_num_threads(args.threads)
    w = Workload(args.sessions, args.prompt, args.answer, args.env, args.max_seq_len)
    counts = [w.most_turns() if x == "max" else int(x) for x in args.turns.split(",")]
    counts = [min(c, w.most_turns()) for c in counts]
    print(
        f"workload: {w.sessions} sessions stepped together, prompt {w.prompt} tokens, each "
        f"turn samples {w.answer} tokens (greedy, no stop) then the environment adds {w.env}; "
        f"context {w.max_seq_len} (at most {w.most_turns()} turns); model {MODEL.name}; "
        f"SD {args.spec}; {args.threads} thread(s)"
    )
    reusing, stateless = _engine(w, args.spec), _engine(w, args.spec)
    for engine in (reusing, stateless):  # first forwards allocate: not in either arm's time
        run_arm(engine, w, 2, False, "warm-up")
    rows = []
    for i, turns in enumerate(counts):
        tag = f"r{i}"
        rows.append(
            Row(
                turns,
                run_arm(reusing, w, turns, True, tag),
                run_arm(stateless, w, turns, False, tag),
            )
        )
    print(table(rows))
    if args.spec != "off":
        print("drafts accepted / drafted, warm-up included: " + ", ".join(
            f"{name} {e.stats.summary()['tokens']['accepted']} / "
            f"{e.stats.summary()['drafted_tokens']}"
            for name, e in (("reuse", reusing), ("stateless", stateless))
        ))  # fmt: skip
    return 0 if all(r.identical for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
