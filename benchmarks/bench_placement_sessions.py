"""Where a session's turns run, the rules of `session_placement` side by side in one run:
prefix-cache hits and session latency on two workers under a skewed mix of sessions.

    python benchmarks/bench_placement_sessions.py           # 2 x 24-turn + 16 x 4-turn, 3 rounds
    python benchmarks/bench_placement_sessions.py --quick   # a smoke test (tests/engine)
    python benchmarks/bench_placement_sessions.py --nodes 2 [--quick]   # two nodes, PostgreSQL

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

Two nodes (`--nodes 2`): where a session's turns run when two real `tltd serve` processes
(`bench_control_plane.Daemon`) share one PostgreSQL database (`TLTD_TEST_PG_URL`'s server),
each with one torch rollout worker (`--cpu-slots 1`), drafter training off, `--capacity` as
`worker_max_batch`, every other setting the default (a 1 s `session_affinity_seconds`, a
0.5 s `claim_interval_seconds`). The rule is a daemon's setting, so each rule's round runs on
a fresh pair of nodes on a fresh database, rules rotated per round; in one round every rule
gets the same prompts and the clients the same picks of nodes. A session is opened at a node
and each of its turns (and its close) sent to a node picked by a generator seeded per session:
either node, as a trainer's load balancer that does not know where the KV is; the daemons
route the turn. A turn is a request of one unit. While another node is up, the node admitting
it leases nothing to itself at admission (`AdmissionClaim`: `admission_capacity` is 0 then):
the unit is queued, the admitting node claims at once and NOTIFY wakes the other, and a node
claims (`claim_units`) the oldest queued units its free slots fit. The rules:
  "sticky"  `session_placement=sticky`: a turn after the first prefers the node that ran the
            turn before (`SessionService._preferred_node`: the owner of that turn's unit),
            which holds its KV; the other node skips the unit until 1 s after its creation
            (`session_affinity_seconds`), then either node may claim it (the preferred one
            claims it sooner when it has a free slot)
  "none"    `session_placement=round_robin`: no unit prefers a node (only sticky sets one),
            so whichever node claims the unit first runs it: the admitting node claims
            without waiting for NOTIFY, but only into a free slot, and in a closed loop at
            the nodes' total capacity the free slot is often the one the session's turn
            before just left (its KV's node: fewer moves than the clients' random picks)
Inside a node of one worker the rule picks nothing. The figures come from each node's own
Prometheus endpoint (`metrics_port`, a free port picked here; 0 turns it off), read over
HTTP and summed over both nodes before and after each round; the split is per node. Below
the table, from the store: the turns that preferred a node and those of them run on the other
one, the turns run on another node than the turn before, and the latency of the turns after
a session's first, from send to answer (one of 1 s or more may have waited out the affinity,
or a full node's slot: under "none" too). A hit is a lookup that reused some positions: a turn
back on a node that ran an earlier turn of its session but not the last reuses that much.

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
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = ROOT / "models" / "tiny-policy"
RULES = ("sticky", "hash", "round_robin")
# --nodes 2: the rule's name in the table -> the nodes' `session_placement`.
NODE_RULES = {"sticky": "sticky", "none": "round_robin"}
NODE_NAMES = ("node-a", "node-b")
JOB = "bench-placement"
PG_ADMIN_URL = os.environ.get("TLTD_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


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
    computed_by: dict[str, float] = field(default_factory=dict)  # --nodes 2: per node
    repins: dict[str, float] = field(default_factory=dict)  # one daemon: re-pins by reason

    def minus(self, before: Counts) -> Counts:
        def sub(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
            return {k: v - b.get(k, 0.0) for k, v in a.items()}

        return Counts(
            sub(self.hits, before.hits),
            sub(self.misses, before.misses),
            self.computed - before.computed,
            self.reused - before.reused,
            repins=sub(self.repins, before.repins),
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
        for family in METRICS.registry.collect():  # no device label: deltas are this daemon's
            for s in family.samples:
                if s.name == "tltd_session_repins_total":
                    out.repins[s.labels["reason"]] = s.value
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


class NodePair:
    """Two `tltd serve` processes (`bench_control_plane.Daemon`) on one PostgreSQL database,
    one torch rollout worker each, sessions placed by `placement`; metrics on a free port."""

    def __init__(
        self, url: str, scratch: Path, placement: str, capacity: int | None, cache_mb: int | None
    ) -> None:
        from benchmarks.bench_control_plane import Daemon

        self.url, self.nodes, self.ports = url, [], []
        try:
            for name in NODE_NAMES:  # one after the other: the first migrates the database
                port = _free_port()
                env = {"TLTD_NODE_ID": name, "TLTD_SESSION_PLACEMENT": placement,
                       "TLTD_METRICS_PORT": str(port)}  # fmt: skip
                if capacity:
                    env["TLTD_WORKER_MAX_BATCH"] = str(capacity)
                if cache_mb is not None:
                    env["TLTD_WORKER_PREFIX_CACHE_MB"] = str(cache_mb)
                self.nodes.append(Daemon(ROOT, url, scratch / name, 1, [], env=env))
                self.ports.append(port)
        except BaseException:
            self.stop()
            raise
        self.targets = [d.target for d in self.nodes]

    def prepare(self, w: Workload) -> None:
        """The job, and both nodes' workers loaded and past their first forwards (not timed):
        requests of 8 prompts, alternately at each node, until both nodes prefilled some."""
        from tltd.v1 import common_pb2, rollout_pb2
        from tltd_clients.client import TltClient

        spec = common_pb2.SpeculativeConfig(mode=common_pb2.SPECULATIVE_MODE_OFF)
        sp = rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=w.answer)
        deadline = time.monotonic() + 180
        with TltClient(self.targets[0]) as c:
            c.create_job(str(MODEL), job_id=JOB, speculative=spec)
        for target in self.targets:
            with TltClient(target) as c:
                while not any(x.kind == "rollout" and x.job_id == JOB and x.state == "ready"
                              for x in c.list_workers()):  # fmt: skip
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{target}: no worker loaded the job in 180 s")
                    time.sleep(0.1)
        sent = 0
        while min(self.counts().computed_by.values()) <= 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the warm-up's prefills did not reach both nodes' metrics")
            with TltClient(self.targets[sent // 8 % 2]) as c:
                list(c.generate(JOB, [_tokens(7000 + sent + i, w.prompt) for i in range(8)],
                                sampling=sp))  # fmt: skip
            sent += 8
            # Its prefills reach the metrics with the workers' next heartbeats.
            while self.counts().computed < sent * w.prompt and time.monotonic() < deadline:
                time.sleep(0.1)

    def counts(self) -> Counts:
        """Both nodes' prefix-cache counters over HTTP, keyed by node (one worker each)."""
        from prometheus_client.parser import text_string_to_metric_families

        out = Counts()
        for name, port in zip(NODE_NAMES, self.ports, strict=True):
            url = f"http://127.0.0.1:{port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as r:
                text = r.read().decode()
            out.hits[name] = out.misses[name] = out.computed_by[name] = 0.0
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name == "tltd_prefix_cache_lookups_total":
                        into = out.hits if s.labels["result"] == "hit" else out.misses
                        into[name] += s.value
                    elif s.name == "tltd_prefill_tokens_total":
                        if s.labels["source"] == "computed":
                            out.computed += s.value
                            out.computed_by[name] += s.value
                        else:
                            out.reused += s.value
        return out

    def moves(self) -> list[int]:
        """Session turns past the first: [preferring a node, run on another node than the
        preferred one, run on another node than the previous turn] (the store's units)."""
        from sqlalchemy import create_engine, text
        from sqlalchemy.pool import NullPool

        engine = create_engine(self.url, poolclass=NullPool)
        try:
            with engine.connect() as conn:
                row = conn.execute(text(_MOVES)).one()
        finally:
            engine.dispose()
        return [int(x or 0) for x in row]

    def stop(self) -> None:
        for d in self.nodes:
            d.stop()


_MOVES = """
WITH t AS (
  SELECT st.turn_index, w.preferred_node, w.owner_node,
         LAG(w.owner_node) OVER (PARTITION BY st.session_id ORDER BY st.turn_index) AS before
  FROM session_turns st JOIN work_units w ON w.request_id = st.request_id
)
SELECT count(*) FILTER (WHERE preferred_node IS NOT NULL),
       count(*) FILTER (WHERE preferred_node IS NOT NULL AND owner_node <> preferred_node),
       count(*) FILTER (WHERE turn_index > 0 AND owner_node <> before)
FROM t
"""


def _free_port() -> int:
    """A port free now (the daemon binds it a moment later)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tokens(seed: int, count: int) -> list[int]:
    """Fixed pseudo-random tokens in 3..53 (the policy's vocabulary, clear of pad, bos, eos),
    another sequence for every seed: sessions of one prompt would share its prefill."""
    rng = random.Random(seed)
    return [rng.randrange(3, 54) for _ in range(count)]


def run_session(
    targets: Sequence[str], sid: str, turns: int, w: Workload, seed: int
) -> tuple[float, list[float]]:
    """One session's turns back to back, its open, each turn and its close sent to one of
    `targets` picked by a generator seeded by `seed` (a load balancer that does not know where
    the session's KV is: the daemons route the turn); seconds from its open to its last turn
    done, and the seconds of each turn after the first."""
    from tltd.v1 import rollout_pb2
    from tltd_clients.client import TltClient

    sp = rollout_pb2.SamplingParams(temperature=0.0, max_new_tokens=w.answer)
    pick = random.Random(-seed)
    clients = [TltClient(t) for t in targets]
    try:
        start, per_turn = time.perf_counter(), []
        pick.choice(clients).open_session(JOB, _tokens(seed, w.prompt), session_id=sid)
        for t in range(turns):
            if t and w.env_ms:
                time.sleep(w.env_ms / 1000)  # its KV waits in the worker's prefix cache
            env = _tokens(1000 * seed + t, w.env) if t else []
            sent = time.perf_counter()
            out = pick.choice(clients).turn(sid, t, env, sampling=sp).turn
            if t:  # a first turn prefills its prompt: not comparable
                per_turn.append(time.perf_counter() - sent)
            if len(out.token_ids) != w.answer:
                raise RuntimeError(f"{sid} turn {t}: {len(out.token_ids)} tokens")
        seconds = time.perf_counter() - start
        pick.choice(clients).close_session(sid)
    finally:
        for c in clients:
            c.close()
    return seconds, per_turn


@dataclass
class Result:
    rule: str
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    turns: int = 0
    sessions: int = 0
    counts: Counts = field(default_factory=Counts)
    turn_seconds: list[float] = field(default_factory=list)  # turns after a session's first
    extra_lookups: int = 0  # lookups beyond one per turn (a turn's unit run twice)
    moves: list[int] = field(default_factory=lambda: [0, 0, 0])  # --nodes 2: see `moves`

    def add(self, counts: Counts) -> None:
        for name in ("hits", "misses"):
            into = getattr(self.counts, name)
            for k, v in getattr(counts, name).items():
                into[k] = into.get(k, 0.0) + v
        self.counts.computed += counts.computed
        self.counts.reused += counts.reused
        for k, v in counts.repins.items():
            self.counts.repins[k] = self.counts.repins.get(k, 0.0) + v

    @property
    def hit_rate(self) -> float:
        """Hits over the turns that can hit (a session's first turn has nothing kept)."""
        return sum(self.counts.hits.values()) / max(1, self.turns - self.sessions)

    def p(self, q: float) -> float:
        return _q(sorted(self.latencies), q)


def run_round(d: LocalDaemon, w: Workload, n: int, res: Result) -> None:
    """Every session of round `n` under rule `res.rule`; adds its figures to `res`."""
    d.use(res.rule)
    drive([d.target], d.counts, w, n, RULES.index(res.rule), res)


def drive(
    targets: Sequence[str], counts: Callable[[], Counts], w: Workload, n: int, index: int,
    res: Result,
) -> None:  # fmt: skip
    """Round `n`'s sessions through `targets` (all at once, or `inflight` at a time), prompts
    from seed block `index`; adds the round's figures (`counts` before and after) to `res`."""
    before = counts()
    # Prompts of their own in every round of every rule (see `_tokens`).
    first = 1 + (n * len(RULES) + index) * (w.long + w.short)
    sessions, seed = w.sessions(f"{res.rule}-r{n}", order=n), first
    start = time.perf_counter()
    # A session at a time per thread: all at once, or `inflight` of them (a closed loop).
    with ThreadPoolExecutor(w.inflight or len(sessions)) as pool:
        futures = [
            pool.submit(run_session, targets, sid, turns, w, seed + i)
            for i, (sid, turns) in enumerate(sessions)
        ]
        done = [f.result() for f in futures]
    res.wall += time.perf_counter() - start
    # The counters come with the workers' heartbeats: wait for every turn's lookup.
    deadline = time.monotonic() + 30
    while (got := counts().minus(before)).lookups < w.turns and time.monotonic() < deadline:
        time.sleep(0.2)
    if got.lookups < w.turns:
        raise RuntimeError(f"{res.rule}: {got.lookups} prefix lookups for {w.turns} turns")
    res.extra_lookups += got.lookups - w.turns
    res.latencies += [seconds for seconds, _ in done]
    res.turn_seconds += [t for _, turns in done for t in turns]
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
    nodes = "1: one daemon of two workers; 2: two `tltd serve` nodes on PostgreSQL"
    p.add_argument("--nodes", type=int, choices=(1, 2), default=1, help=nodes)
    args = p.parse_args(argv)
    if args.quick:
        args.long, args.long_turns, args.short, args.short_turns = 1, 6, 4, 2
        args.prompt, args.answer, args.env, args.rounds = 32, 4, 8, 1
    w = Workload(
        args.long, args.long_turns, args.short, args.short_turns,
        args.prompt, args.answer, args.env, args.rounds, args.env_ms, args.inflight,
    )  # fmt: skip
    where = (
        "2 torch workers in one daemon"
        if args.nodes == 1
        else "2 `tltd serve` nodes on one PostgreSQL database, 1 torch worker each"
    )
    print(
        f"workload per round: {w.long} sessions of {w.long_turns} turns and {w.short} of "
        f"{w.short_turns}, {_pace(w)} ({w.turns} turns); prompt {w.prompt} tokens, each turn "
        f"samples {w.answer} (greedy, no stop) then the environment adds {w.env} after "
        f"{w.env_ms} ms; "
        f"{w.rounds} round(s) per rule, rotated; {where}, model {MODEL.name}, SD off; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    results = run_local(args, w) if args.nodes == 1 else run_nodes(args, w)
    print(table(results))
    for r in results:
        if r.extra_lookups:
            print(f"{r.rule}: {r.extra_lookups} prefix lookups beyond one per turn")
        moved = {k: round(v) for k, v in sorted(r.counts.repins.items()) if v}
        if moved:
            print(f"{r.rule}: turns sent away from their KV by reason {moved}")
    if args.nodes == 2:
        print(node_summary(results))
    return 0


def run_local(args: argparse.Namespace, w: Workload) -> list[Result]:
    """Every rule on one in-process daemon of two workers, rule switched between rounds."""
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
    return results


def run_nodes(args: argparse.Namespace, w: Workload) -> list[Result]:
    """Each rule's round on a fresh pair of nodes on a fresh PostgreSQL database (the rule is
    a daemon's setting), rules rotated per round; the same prompts and the same node picks
    of the clients for every rule in a round."""
    from tltd.store.database import scratch_postgres

    results = [Result(rule) for rule in NODE_RULES]
    with tempfile.TemporaryDirectory(prefix="bench-placement-nodes-") as tmp:
        for n in range(w.rounds):
            for res in results:
                with scratch_postgres(PG_ADMIN_URL, "tltd_bench_place") as url:
                    node_round(url, Path(tmp) / f"{res.rule}-r{n}", args, w, n, res)
    return results


def node_round(
    url: str, scratch: Path, args: argparse.Namespace, w: Workload, n: int, res: Result
) -> None:
    """Round `n` of rule `res.rule` on a fresh pair of nodes on database `url`."""
    pair = NodePair(url, scratch, NODE_RULES[res.rule], args.capacity, args.cache_mb)
    try:
        started = time.perf_counter()
        pair.prepare(w)
        warm = time.perf_counter() - started
        print(f"round {n} {res.rule}: nodes up and warm ({warm:.0f} s of warm-up)", flush=True)
        drive(pair.targets, pair.counts, w, n, 0, res)
        res.moves = [a + b for a, b in zip(res.moves, pair.moves(), strict=True)]
    finally:
        pair.stop()


def node_summary(results: list[Result]) -> str:
    """Where the turns went across nodes, and the turns that took a second or more (the
    affinity's wait is `session_affinity_seconds`, 1 s by default)."""
    lines = []
    for r in results:
        preferring, elsewhere, switched = r.moves
        xs = sorted(r.turn_seconds)
        slow = sum(1 for x in xs if x >= 1.0)
        lines.append(
            f"{r.rule}: {preferring} turns preferred a node, {elsewhere} of them ran on the "
            f"other; {switched} of {r.turns - r.sessions} later turns ran on another node than "
            f"the turn before; their latency p50 {_q(xs, 0.5):.3f} s, p99 {_q(xs, 0.99):.3f} s, "
            f"max {xs[-1]:.3f} s, {slow} of them >= 1 s"
        )
    return "\n".join(lines)


def _q(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


if __name__ == "__main__":
    sys.exit(main())
