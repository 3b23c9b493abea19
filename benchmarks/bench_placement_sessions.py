"""Where a session's turns run, the rules of `session_placement` side by side in one run:
prefix-cache hits and session latency on two workers under a skewed mix of sessions.

    python benchmarks/bench_placement_sessions.py           # 2 x 24-turn + 16 x 4-turn, 3 rounds
    python benchmarks/bench_placement_sessions.py --quick   # a smoke test (tests/engine)

The daemon (`tltd.daemon.Daemon`, the parts `tltd serve` runs: the supervisor with 2 real torch
rollout worker processes of one thread each, the gRPC server, SQLite; drafter training off) runs
on an event loop in a thread of this process, so that one daemon and its two workers serve
every rule: between rounds the supervisor's scheduler config is rebuilt from the settings with
another `session_placement` (one daemon per rule would start six workers, a minute of this
machine). Sessions go through the real client over gRPC. The job runs the project's own policy
(models/tiny-policy) with speculative decoding off. The rules: "sticky" (the default: the
worker holding the session's KV, waited for while full, unless it is busier than the other by
more than a quarter of its capacity, counting the turns queued for it), "hash" (rendezvous
hashing of the session id, whatever the load: a full worker's turns wait for it) and
"round_robin" (session turns handed to the workers in rotation, the KV ignored).

Workload, one round: `--long` sessions of `--long-turns` turns and `--short` of
`--short-turns`, all opened at once, each driven by its own client thread (one RL step's
episodes, the long ones being the hot sessions: the case where routing that ignores load sends
them to one engine). A session's prompt has `--prompt` tokens; each turn samples exactly
`--answer` tokens (greedy, no stop token) and the environment then appends `--env` tokens
(fixed pseudo-random tokens per session and turn) before the next. Rounds rotate the rules
(sticky, hash, round_robin, sticky, ...) so that the machine's load drifts over all of them;
the session ids differ per round (so does the hash's split of them). A session's KV waits in
its worker's prefix cache only between its turns (a turn takes it out while it runs): with the
environment answering at once (`--env-ms 0`) and the default 256 MiB, nothing is evicted;
`--env-ms` (the environment's time per step) and `--cache-mb` (`worker_prefix_cache_mb`) put
the cache under pressure, where a worker given more sessions than its share drops KV.
`--capacity` (`worker_max_batch`) bounds the sequences a worker runs at once and `--inflight`
runs the sessions as a closed loop, that many at a time (a rollout manager keeping its agents
busy): with both at the workers' total capacity, a turn placed on a busier worker waits.

Per rule: turns run, how they split over the two workers, the prefix-cache hit rate over the
turns that can hit (every turn but a session's first; the daemon's
`tltd_prefix_cache_lookups_total`), prompt positions prefilled (`tltd_prefill_tokens_total`,
source computed), p50 / p90 session latency (open to last turn done, over every session of
every round), the wall time of its rounds, and the ratio of each figure to sticky's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = ROOT / "models" / "tiny-policy"
RULES = ("sticky", "hash", "round_robin")
JOB = "bench-placement"


@dataclass(frozen=True)
class Workload:
    long: int
    long_turns: int
    short: int
    short_turns: int
    prompt: int
    answer: int
    env: int
    rounds: int
    env_ms: int = 0  # the environment's time per step (a tool call), in each session's time
    inflight: int = 0  # sessions run at once, the next opened as one closes; 0: all at once

    def sessions(self, tag: str, order: int = 0) -> list[tuple[str, int]]:
        """(session id, turns) of one round: the long sessions first or, run `inflight` at a
        time, in an order shuffled by `order` (the round's: alike for every rule)."""
        out = [(f"{tag}-long-{i}", self.long_turns) for i in range(self.long)] + [
            (f"{tag}-short-{i:02d}", self.short_turns) for i in range(self.short)
        ]
        if self.inflight:
            random.Random(order).shuffle(out)
        return out

    @property
    def turns(self) -> int:
        return self.long * self.long_turns + self.short * self.short_turns


@dataclass
class Counts:
    """The daemon's prefix-cache counters, per device (its metrics registry)."""

    hits: dict[str, float] = field(default_factory=dict)
    misses: dict[str, float] = field(default_factory=dict)
    computed: float = 0.0  # prompt positions a forward ran over
    reused: float = 0.0  # prompt positions restored from a session's kept KV

    def minus(self, before: Counts) -> Counts:
        def sub(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
            return {k: v - b.get(k, 0.0) for k, v in a.items()}

        return Counts(
            sub(self.hits, before.hits),
            sub(self.misses, before.misses),
            self.computed - before.computed,
            self.reused - before.reused,
        )

    @property
    def lookups(self) -> int:
        return round(sum(self.hits.values()) + sum(self.misses.values()))


class LocalDaemon:
    """The daemon on an event loop in a thread of this process (`use` picks the rule)."""

    def __init__(self, scratch: Path, cache_mb: int | None, capacity: int | None = None) -> None:
        from tltd.daemon import Daemon
        from tltd.settings import load_settings
        from tltd.store import Store
        from tltd.store.migrate import upgrade

        self.settings = load_settings(
            None, env={}, overrides={
                "port": 0, "data_dir": str(scratch / "data"), "cpu_slots": 2,
                "drafter_training": False, "worker_prefix_cache_mb": cache_mb,
            } | ({"worker_max_batch": capacity} if capacity else {}),
        )  # fmt: skip
        Path(self.settings.data_dir).mkdir(parents=True)
        upgrade(self.settings.resolved_database_url)
        self.store = Store(self.settings.resolved_database_url)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.daemon = self.call(_make(Daemon, self.settings, self.store, None))  # None: CPU slots
        self.call(self.daemon.start())
        self.target = f"127.0.0.1:{self.daemon.api.port}"

    def call(self, coro, timeout: float = 180.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def use(self, rule: str) -> None:
        """Place sessions' turns by `rule` from now on (no turn runs between rounds)."""
        from tltd.daemon import scheduler_config

        settings = replace(self.settings, session_placement=rule)
        self.daemon.supervisor.sched_cfg = scheduler_config(settings)

    def prepare(self, w: Workload) -> None:
        """The job, and both workers loaded and past their first forwards (not timed)."""
        from tltd.v1 import common_pb2, rollout_pb2
        from tltd_clients.client import TltClient

        spec = common_pb2.SpeculativeConfig(mode=common_pb2.SPECULATIVE_MODE_OFF)
        with TltClient(self.target) as c:
            c.create_job(str(MODEL), job_id=JOB, speculative=spec)
            # Idle workers load the newest job while no work waits: both, before any work.
            deadline = time.monotonic() + 120
            while not _ready(c.list_workers()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the workers did not load the job in 120 s")
                time.sleep(0.1)
            sp = rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=w.answer)
            list(c.generate(JOB, [_tokens(7000 + i, w.prompt) for i in range(8)], sampling=sp))
        # Its prefills reach the metrics with the workers' next heartbeats: not in a round's.
        while self.counts().computed < 8 * w.prompt:
            if time.monotonic() > deadline:
                raise RuntimeError("the warm-up's prefills never reached the metrics")
            time.sleep(0.1)

    def counts(self) -> Counts:
        """The daemon's prefix-cache counters (its process-wide metrics registry)."""
        from tltd.metrics import METRICS

        out = Counts()
        devices = {h.device.device_id for h in self.daemon.supervisor.handles.values()}
        for d in devices:  # a worker without turns shows 0
            out.hits[d] = out.misses[d] = 0.0
        for family in METRICS.registry.collect():
            for s in family.samples:
                # The registry is the process's: other daemons run here (a test process) left
                # counters of devices not this daemon's.
                if s.labels.get("device_id", "") not in devices:
                    continue
                if s.name == "tltd_prefix_cache_lookups_total":
                    into = out.hits if s.labels["result"] == "hit" else out.misses
                    into[s.labels["device_id"]] = into.get(s.labels["device_id"], 0.0) + s.value
                elif s.name == "tltd_prefill_tokens_total":
                    if s.labels["source"] == "computed":
                        out.computed += s.value
                    else:
                        out.reused += s.value
        return out

    def stop(self) -> None:
        try:
            self.call(self.daemon.shutdown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(30)
            self.store.close()


async def _make(cls, *args):
    """Build `cls` on the daemon's loop (its parts bind to the running loop)."""
    return cls(*args)


def _ready(workers) -> bool:
    rollout = [x for x in workers if x.kind == "rollout"]
    return len(rollout) == 2 and all(x.job_id == JOB and x.state == "ready" for x in rollout)


def _tokens(seed: int, count: int) -> list[int]:
    """Fixed pseudo-random tokens in 3..53 (the policy's vocabulary, clear of pad, bos, eos),
    another sequence for every seed: sessions of one prompt would share its prefill."""
    rng = random.Random(seed)
    return [rng.randrange(3, 54) for _ in range(count)]


def run_session(target: str, sid: str, turns: int, w: Workload, seed: int) -> float:
    """One session's turns back to back; seconds from its open to its last turn done."""
    from tltd.v1 import rollout_pb2
    from tltd_clients.client import TltClient

    sp = rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=w.answer)
    with TltClient(target) as c:
        start = time.perf_counter()
        c.open_session(JOB, _tokens(seed, w.prompt), session_id=sid)
        for t in range(turns):
            if t and w.env_ms:
                time.sleep(w.env_ms / 1000)  # its KV waits in the worker's prefix cache
            env = _tokens(1000 * seed + t, w.env) if t else []
            out = c.turn(sid, t, env, sampling=sp).turn
            if len(out.token_ids) != w.answer:
                raise RuntimeError(f"{sid} turn {t}: {len(out.token_ids)} tokens")
        seconds = time.perf_counter() - start
        c.close_session(sid)
    return seconds


@dataclass
class Result:
    rule: str
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    turns: int = 0
    sessions: int = 0
    counts: Counts = field(default_factory=Counts)

    def add(self, counts: Counts) -> None:
        for name in ("hits", "misses"):
            into = getattr(self.counts, name)
            for k, v in getattr(counts, name).items():
                into[k] = into.get(k, 0.0) + v
        self.counts.computed += counts.computed
        self.counts.reused += counts.reused

    @property
    def hit_rate(self) -> float:
        """Hits over the turns that can hit (a session's first turn has nothing kept)."""
        return sum(self.counts.hits.values()) / max(1, self.turns - self.sessions)

    def p(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def run_round(d: LocalDaemon, w: Workload, n: int, res: Result) -> None:
    """Every session of round `n` at once under rule `res.rule`; adds its figures to `res`."""
    d.use(res.rule)
    before = d.counts()
    # Prompts of their own in every round of every rule (see `_tokens`).
    first = 1 + (n * len(RULES) + RULES.index(res.rule)) * (w.long + w.short)
    sessions, seed = w.sessions(f"{res.rule}-r{n}", order=n), first
    start = time.perf_counter()
    # A session at a time per thread: all at once, or `inflight` of them (a closed loop).
    with ThreadPoolExecutor(w.inflight or len(sessions)) as pool:
        futures = [
            pool.submit(run_session, d.target, sid, turns, w, seed + i)
            for i, (sid, turns) in enumerate(sessions)
        ]
        latencies = [f.result() for f in futures]
    res.wall += time.perf_counter() - start
    # The counters come with the workers' heartbeats: wait for every turn's lookup.
    deadline = time.monotonic() + 30
    while (got := d.counts().minus(before)).lookups < w.turns and time.monotonic() < deadline:
        time.sleep(0.2)
    if got.lookups != w.turns:
        raise RuntimeError(f"{res.rule}: {got.lookups} prefix lookups for {w.turns} turns")
    res.latencies += latencies
    res.turns += w.turns
    res.sessions += len(sessions)
    res.add(got)


def _pace(w: Workload) -> str:
    if not w.inflight:
        return "all at once"
    return f"{w.inflight} at a time in a shuffled order (the next opened as one ends)"


def _ratio(x: float, base: float) -> str:
    return f"{x / base:5.2f}x" if base else "    -"


def table(results: list[Result]) -> str:
    head = (
        "rule        | turns | per worker | hit rate | x sticky | prefilled | x sticky | "
        "p50 s | p90 s | x sticky | wall s | x sticky"
    )
    lines = [head, "-" * len(head)]
    base = results[0]
    for r in results:
        split = "/".join(
            str(round(r.counts.hits.get(k, 0) + r.counts.misses.get(k, 0)))
            for k in sorted(set(r.counts.hits) | set(r.counts.misses))
        )
        lines.append(
            f"{r.rule:11s} | {r.turns:5d} | {split:>10s} | {100 * r.hit_rate:7.1f}% | "
            f"{_ratio(r.hit_rate, base.hit_rate):>8s} | {round(r.counts.computed):9d} | "
            f"{_ratio(r.counts.computed, base.counts.computed):>8s} | {r.p(0.5):5.2f} | "
            f"{r.p(0.9):5.2f} | {_ratio(r.p(0.9), base.p(0.9)):>8s} | {r.wall:6.1f} | "
            f"{_ratio(r.wall, base.wall):>8s}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small workload, 1 round")
    p.add_argument("--long", type=int, default=2, help="long sessions per round")
    p.add_argument("--long-turns", type=int, default=24)
    p.add_argument("--short", type=int, default=16, help="short sessions per round")
    p.add_argument("--short-turns", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per session")
    p.add_argument("--answer", type=int, default=16, help="tokens sampled per turn")
    p.add_argument("--env", type=int, default=32, help="environment tokens per turn")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache-mb", type=int, help="worker_prefix_cache_mb (default: the daemon's)")
    p.add_argument("--env-ms", type=int, default=0, help="environment time per step (ms)")
    p.add_argument(
        "--inflight",
        type=int,
        default=0,
        help="sessions at once, the next opened as one ends (0: all at once)",
    )
    p.add_argument(
        "--capacity",
        type=int,
        help="worker_max_batch: sequences a worker runs at once (default: the daemon's)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.long, args.long_turns, args.short, args.short_turns = 1, 6, 4, 2
        args.prompt, args.answer, args.env, args.rounds = 32, 4, 8, 1
    w = Workload(
        args.long, args.long_turns, args.short, args.short_turns,
        args.prompt, args.answer, args.env, args.rounds, args.env_ms, args.inflight,
    )  # fmt: skip
    print(
        f"workload per round: {w.long} sessions of {w.long_turns} turns and {w.short} of "
        f"{w.short_turns}, {_pace(w)} ({w.turns} turns); prompt {w.prompt} tokens, each turn "
        f"samples {w.answer} (greedy, no stop) then the environment adds {w.env} after "
        f"{w.env_ms} ms; "
        f"{w.rounds} round(s) per rule, rotated; 2 torch workers, model {MODEL.name}, SD off; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-placement-") as tmp:
        d = LocalDaemon(Path(tmp), args.cache_mb, args.capacity)
        print(
            f"prefix cache: {d.settings.worker_prefix_cache_mb} MiB per worker; a worker runs "
            f"at most {d.settings.worker_max_batch} sequences at once"
        )
        try:
            d.prepare(w)
            results = [Result(rule) for rule in RULES]
            for n in range(w.rounds):
                for res in results:
                    run_round(d, w, n, res)
        finally:
            d.stop()
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
