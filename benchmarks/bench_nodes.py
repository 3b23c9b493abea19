"""Several `tltd serve` nodes on one PostgreSQL, simulated engines: what coordination costs,
and how many GPU nodes one PostgreSQL could coordinate (a projection from the measured costs).

K real daemons (each its own process group, port 0) share one fresh PostgreSQL database;
each has `--slots` simulated devices (backend "sim") asleep for `gpu_model`'s roofline of
Qwen2.5-7B on an H100 per decode step (`bench_control_plane.gpu_sim_config`), 64 rows at
most per device (the daemon's default `worker_max_batch`). Load through the real clients,
every caller starting on its own node and failing over to the others:
  GRPO      `--grpo` callers per node sending requests back to back: 4 prompts of 32-64
            tokens x n=8, max_new_tokens drawn from {256, 512, 1024}; the simulated answer
            lengths are log-normal (median 200 tokens, p99/p50 5) capped by it
  sessions  `--sessions` callers per node, each opening a session, running 4 turns (16
            environment tokens before each after the first, 64 new tokens at most), closing
            it, and again until the time is up
At 40% of `--seconds` the last node is killed (kill -9 of its process group). Callers stop
starting work at `--seconds`; the window ends when the last answer is in. Measured in that
window: samples/s and turns/s; claim latency (a unit's created_at to its claim, read from
work_units rows while leased, polled every 0.1 s); PostgreSQL transactions (pg_stat_database)
and CPU (every backend of the database, from /proc) per sample; the daemons' CPU (each node's
process group) per sample; what each query costs, by sampling pg_stat_activity (this server
has no pg_stat_statements preloaded); rows written per table; takeover (the kill to every unit
the node held being owned by another node or done). Before the load, an idle window measures
what K idle nodes cost PostgreSQL per second (heartbeats, claim polls). Then every request is
checked: each prompt x n exactly once, every turn done.

The projection divides what a dedicated PostgreSQL could spend (`--pg-cores` x
`--pg-busy`) by one GPU node's cost: its samples/s (8 H100 at the same roofline, batch
`--gpu-batch`, this workload's answer lengths) x the measured PostgreSQL CPU per sample, plus
the measured idle cost of a node.

    nice -n 10 .venv/bin/python benchmarks/bench_nodes.py [--nodes 2,4] [--seconds 60]
        [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_control_plane import PG_STATS_PAUSE, gpu_sim_config, process_cpu  # noqa: E402

from tltd.store.database import scratch_postgres  # noqa: E402

MODEL = ROOT / "models" / "tiny-policy"
PG_ADMIN_URL = os.environ.get("TLTD_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
JOB = "bench-nodes"
PROMPTS, N, CAPS = 4, 8, (256, 512, 1024)
MEDIAN, TAIL = 200, 5.0  # simulated answer lengths: log-normal, p99 / p50 = TAIL
TURNS, TURN_TOKENS, ENV_TOKENS = 4, 64, 16
SIM = f"{gpu_sim_config()},median={MEDIAN},tail={TAIL:g}"
# Short leases, so that a takeover fits a short run; heartbeat twice the default rate.
NODE_ENV = dict(
    lease_seconds=3, node_heartbeat_seconds=0.5, node_down_seconds=3, drafter_training="false",
    device_refresh_seconds=3600, sim_engine=SIM,
)  # fmt: skip
POLL_S = 0.1
GPUS_PER_NODE = 8
_TOKEN = re.compile(r"\b(?:FROM|UPDATE|INTO|LISTEN|NOTIFY)\s+\"?(\w+)", re.IGNORECASE)


# ---- nodes -------------------------------------------------------------------------------------


class ClusterNode:
    """`python -m tltd serve` of this checkout in its own process group, on port 0."""

    def __init__(self, node_id: str, url: str, data: Path, slots: int) -> None:
        data.mkdir(parents=True, exist_ok=True)
        self.node_id, self.port_file, self.log_path = node_id, data / "port", data / "tltd.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TLTD_")}
        env |= {f"TLTD_{k.upper()}": str(v) for k, v in NODE_ENV.items()}
        env |= {"TLTD_NODE_ID": node_id, "PYTHONPATH": _pythonpath()}
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tltd", "serve", "--port", "0", "--port-file",
             str(self.port_file), "--data-dir", str(data / "tltd"), "--database-url", url,
             "--cpu-slots", str(slots), "--log-json"],
            cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.target = ""

    def wait_port(self, deadline: float) -> None:
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.node_id} did not start: {self.log_tail()}")
            time.sleep(0.1)
        self.target = f"127.0.0.1:{self.port_file.read_text().strip()}"

    def log_tail(self) -> str:
        return self.log_path.read_text()[-3000:] if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """kill -9 of the daemon and its workers (its process group)."""
        self.signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def cpu(self) -> dict[int, float]:
        """CPU seconds of every process of its group, by pid."""
        return {pid: cpu for pid, cpu in group_cpu(self.proc.pid).items()}


def _pythonpath() -> str:
    """The parent's path entries first (a worktree's links to its client and worker
    packages), then this checkout."""
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([*parts, str(ROOT)])


def group_cpu(pgid: int) -> dict[int, float]:
    """CPU seconds of each live process in process group `pgid`, from /proc."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            out[int(entry)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def start_nodes(url: str, k: int, slots: int, tmp: Path) -> list[ClusterNode]:
    nodes: list[ClusterNode] = []
    try:
        for i in range(k):
            nodes.append(ClusterNode(f"node-{i}", url, tmp / f"node-{i}", slots))
        deadline = time.monotonic() + 240
        for node in nodes:
            node.wait_port(deadline)
        return nodes
    except BaseException:
        for node in nodes:
            node.kill()
        raise


# ---- PostgreSQL ---------------------------------------------------------------------------------


def conninfo(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


class PgReader:
    """One autocommit connection of this benchmark to the database; counts its own
    transactions so that they are taken out of the database's."""

    def __init__(self, url: str) -> None:
        import psycopg

        self.conn = psycopg.connect(conninfo(url), autocommit=True)
        # Its own polls of work_units by index: their reads stay small beside the nodes'.
        self.conn.execute("SET enable_seqscan = off")
        self.pid = self.conn.info.backend_pid
        self.xacts = 0
        self.own_reads: Counter[str] = Counter()  # table -> rows this connection read
        self.lock = threading.Lock()

    def rows(self, query: str, *params) -> list[tuple]:
        with self.lock:
            self.xacts += 1
            return list(self.conn.execute(query, params or None).fetchall())

    def counted(self, query: str, *params) -> list[tuple]:
        """`rows` in a transaction of its own, adding the rows it read per table to
        `own_reads` (pg_stat_xact_user_tables: this transaction's counts)."""
        with self.lock, self.conn.transaction():
            self.xacts += 1
            rows = list(self.conn.execute(query, params or None).fetchall())
            for table, read in self.conn.execute(
                "SELECT relname, seq_tup_read + coalesce(idx_tup_fetch, 0) "
                "FROM pg_stat_xact_user_tables"
            ).fetchall():
                self.own_reads[table] += int(read)
            return rows

    def close(self) -> None:
        self.conn.close()


@dataclass
class PgCounters:
    """What the database has done so far: transactions, and rows per table."""

    xacts: int
    tables: dict[str, tuple[int, int]]  # table -> (rows written, rows read)


def pg_counters(pg: PgReader) -> PgCounters:
    (xacts,) = pg.rows(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database "
        "WHERE datname = current_database()"
    )[0]
    tables = {
        r[0]: (int(r[1]), int(r[2]))
        for r in pg.rows(
            "SELECT relname, n_tup_ins + n_tup_upd + n_tup_del, "
            "coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables"
        )
    }
    return PgCounters(int(xacts), tables)


def pg_backends(pg: PgReader) -> list[tuple[int, str, str, str]]:
    """(pid, state, query, what it waits for) of the database's other backends."""
    return pg.rows(
        "SELECT pid, coalesce(state, ''), coalesce(query, ''), "
        "coalesce(wait_event_type || ':' || wait_event, '') "
        "FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )


def query_label(query: str) -> str:
    """A statement's verb and first table: "UPDATE work_units", "SELECT samples"."""
    text = " ".join(query.split())
    verb = text.split(" ", 1)[0].upper() if text else "?"
    table = _TOKEN.search(text)
    if verb == "WITH" and " UPDATE " in f" {text.upper()} ":
        verb = "WITH..UPDATE"
    return f"{verb} {table.group(1)}" if table else verb


class CpuLedger:
    """CPU seconds of a changing set of processes over a window: a process seen at the start
    counts from its value then, one born later from zero; the last value read counts."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def observe(self, cpu: dict[int, float], start: bool = False) -> None:
        for pid, value in cpu.items():
            self.first.setdefault(pid, value if start else 0.0)
            self.last[pid] = value

    def seconds(self) -> float:
        return sum(self.last[p] - self.first[p] for p in self.last)


class CoordinationMonitor:
    """A thread polling the database every POLL_S: the claim time of every leased unit, what
    each backend runs (a sampling profile by query) and the backends' CPU."""

    def __init__(self, url: str) -> None:
        self.pg = PgReader(url)
        self.claims: dict[tuple[str, int, int], float] = {}  # (rid, prompt, attempt) -> s
        self.owners: dict[tuple[str, int], str] = {}
        self.active: Counter[str] = Counter()  # statement -> polls that found it running
        self.in_tx = 0
        self.examples: dict[str, str] = {}
        self.polls = 0
        self.max_backends = 0  # the database's connections, most seen at once
        self.cpu = CpuLedger()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pg-monitor", daemon=True)

    def start(self) -> None:
        self.cpu.observe(self._backend_cpu(pg_backends(self.pg)), start=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.cpu.observe(self._backend_cpu(pg_backends(self.pg)))

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        backends = pg_backends(self.pg)
        self.polls += 1
        self.max_backends = max(self.max_backends, len(backends))
        for _pid, state, query, wait in backends:
            if state.startswith("idle in transaction"):
                self.in_tx += 1  # a transaction open while its node computes: locks held
            elif state == "active":
                # A row-lock wait is contention, not CPU: named apart.
                label = query_label(query) + (f" [{wait}]" if wait else "")
                self.active[label] += 1
                self.examples.setdefault(label, " ".join(query.split())[:160])
        self.cpu.observe(self._backend_cpu(backends))
        for rid, p, attempts, created, updated, owner in self.pg.counted(
            "SELECT request_id, prompt_index, attempts, created_at, updated_at, owner_node "
            "FROM work_units WHERE state = 'leased'"
        ):
            self.claims.setdefault((rid, p, attempts), (updated - created).total_seconds())
            self.owners[(rid, p)] = owner

    @staticmethod
    def _backend_cpu(backends) -> dict[int, float]:
        out = {}
        for pid, *_ in backends:
            try:
                out[pid] = process_cpu(pid)
            except (OSError, IndexError):
                continue  # ended meanwhile
        return out


# ---- load --------------------------------------------------------------------------------------


@dataclass
class LoadLedger:
    """What the callers asked for and what came back."""

    asked: dict[str, int] = field(default_factory=dict)  # request id -> prompts x n
    got: dict[str, Counter] = field(default_factory=dict)  # request id -> (prompt, sample)
    turns: dict[str, int] = field(default_factory=dict)  # session id -> turns done
    closed: set[str] = field(default_factory=set)
    failed: list[str] = field(default_factory=list)
    failovers: int = 0  # calls that moved to another node
    lock: threading.Lock = field(default_factory=threading.Lock)

    def samples(self) -> int:
        return sum(sum(c.values()) for c in self.got.values())

    def turns_done(self) -> int:
        return sum(self.turns.values())


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, 50) for _ in range(count)]  # the tiny policy's vocabulary: 54


def _rotated(targets: list[str], index: int) -> list[str]:
    i = index % len(targets)
    return targets[i:] + targets[:i]


async def grpo_caller(index: int, targets: list[str], stop_at: float, ledger: LoadLedger):
    """GRPO requests back to back until `stop_at`, starting on node `index` (round-robin
    over the others, failing over to them)."""
    from tltd_clients import AsyncRolloutClient, Backoff, TltClientError

    rng = random.Random(index)
    fast = Backoff(initial=0.05, maximum=0.5)
    async with AsyncRolloutClient(
        _rotated(targets, index), job_id=JOB, timeout=600, backoff=fast, retries=40
    ) as client:
        i = 0
        while time.monotonic() < stop_at:
            rid, i = f"bn-g{index}-{i}", i + 1
            prompts = [_tokens(rng, rng.randint(32, 64)) for _ in range(PROMPTS)]
            ledger.asked[rid], got = PROMPTS * N, Counter()
            ledger.got[rid] = got
            try:
                samples = client.stream(prompts, n=N, request_id=rid, temperature=1.0,
                                        max_new_tokens=rng.choice(CAPS))  # fmt: skip
                async for s in samples:
                    got[(s.prompt_index, s.sample_index)] += 1
            except TltClientError as exc:
                ledger.failed.append(f"{rid}: {exc}")


def _with_failover(clients: list, method: str, *args, **kwargs):
    """`method(*args, **kwargs)` of the first client that answers: a killed node's
    UNAVAILABLE moves on to the next (a retried turn attaches to the same rollout)."""
    from tltd_clients.errors import UnavailableError

    for attempt in range(60):
        try:
            return getattr(clients[0], method)(*args, **kwargs)
        except UnavailableError:
            clients.append(clients.pop(0))
            time.sleep(min(0.5, 0.05 * (attempt + 1)))
    raise RuntimeError(f"{method} {args[0]}: no node answered")


def session_caller(index: int, targets: list[str], stop_at: float, ledger: LoadLedger) -> None:
    """Sessions of TURNS turns, one after another until `stop_at` (a thread)."""
    from tltd.v1 import rollout_pb2
    from tltd_clients import TltClient, TltClientError

    rng = random.Random(10_000 + index)
    sampling = rollout_pb2.SamplingParams(n=1, temperature=1.0, max_new_tokens=TURN_TOKENS)
    clients = [TltClient(t, timeout=None) for t in _rotated(targets, index)]
    try:
        j = 0
        while time.monotonic() < stop_at:
            sid, j, prompt = f"bn-s{index}-{j}", j + 1, _tokens(rng, 32)
            try:
                _with_failover(clients, "open_session", JOB, prompt, sid)
                for t in range(TURNS):
                    env = _tokens(rng, ENV_TOKENS) if t else []
                    _with_failover(clients, "turn", sid, t, env, sampling=sampling)
                    with ledger.lock:
                        ledger.turns[sid] = t + 1
                _with_failover(clients, "close_session", sid)
                ledger.closed.add(sid)
            except (TltClientError, RuntimeError) as exc:
                ledger.failed.append(f"{sid}: {exc}")
    finally:
        for c in clients:
            c.close()


@dataclass
class Takeover:
    node: str = ""
    held: int = 0  # units the node held when killed
    seconds: float = float("nan")  # the kill to every one of them owned by another or done


def kill_and_watch(node: ClusterNode, pg: PgReader, nodes_cpu: CpuLedger) -> Takeover:
    """Freeze the node once it holds a unit, note what it holds, kill -9 its process group;
    then wait until no unit is leased to it any more."""
    held_q = "SELECT count(*) FROM work_units WHERE owner_node = %s AND state = 'leased'"
    held = 0
    for _ in range(100):
        node.signal(signal.SIGSTOP)  # what it holds now is what it holds when it dies
        held = int(pg.rows(held_q, node.node_id)[0][0])
        if held:
            break
        node.signal(signal.SIGCONT)
        time.sleep(0.05)
    nodes_cpu.observe(node.cpu())
    node.kill()
    killed_at = time.monotonic()
    while time.monotonic() - killed_at < 120:
        if not int(pg.rows(held_q, node.node_id)[0][0]):
            return Takeover(node.node_id, held, time.monotonic() - killed_at)
        time.sleep(0.05)
    return Takeover(node.node_id, held)


class _FailoverCount(logging.Handler):
    """Counts the clients' failover warnings (a call moved off the killed node) instead of
    printing each."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


async def run_load(cfg, nodes: list[ClusterNode], pg: PgReader, nodes_cpu: CpuLedger):
    """Every caller until `cfg.seconds`, the last node killed at 40% of it: the ledger, the
    takeover, the wall time to the last answer."""
    targets = [n.target for n in nodes]
    ledger = LoadLedger()
    t0 = time.monotonic()
    stop_at = t0 + cfg.seconds
    threads = [
        threading.Thread(target=session_caller, args=(i, targets, stop_at, ledger), daemon=True)
        for i in range(cfg.sessions * len(nodes))
    ]
    for t in threads:
        t.start()

    async def killer() -> Takeover:
        await asyncio.sleep(0.4 * cfg.seconds)
        return await asyncio.to_thread(kill_and_watch, nodes[-1], pg, nodes_cpu)

    callers = [grpo_caller(i, targets, stop_at, ledger) for i in range(cfg.grpo * len(nodes))]
    failovers = _FailoverCount()
    log = logging.getLogger("tltd_clients.failover")
    log.addHandler(failovers)
    log.propagate = False
    try:
        takeover, *_ = await asyncio.gather(killer(), *callers)
        for t in threads:
            await asyncio.to_thread(t.join, 600)
    finally:
        log.removeHandler(failovers)
        log.propagate = True
    ledger.failovers = failovers.count
    return ledger, takeover, time.monotonic() - t0


# ---- one run -----------------------------------------------------------------------------------


@dataclass
class NodesRun:
    """One run's figures (K nodes)."""

    nodes: int
    slots: int
    wall: float = 0.0
    samples: int = 0
    samples_asked: int = 0
    turns: int = 0
    requests: int = 0
    sessions: int = 0
    lost: int = 0
    duplicated: int = 0
    failed: list[str] = field(default_factory=list)
    failovers: int = 0
    claim_ms: list[float] = field(default_factory=list)  # first claims seen
    reclaims: int = 0
    units: int = 0
    xacts: float = 0.0  # the window's, less this benchmark's own
    pg_cpu: float = 0.0
    node_cpu: float = 0.0
    node_seconds: float = 0.0  # live nodes x seconds in the window
    idle_xacts_s: float = 0.0  # per idle node and second
    idle_cpu_s: float = 0.0
    max_backends: int = 0
    takeover: Takeover = field(default_factory=Takeover)
    queries: list[tuple[str, float, str]] = field(default_factory=list)  # label, share, text
    by_table: list[tuple[str, float]] = field(default_factory=list)  # busy samples by table
    polls: int = 0
    busy: int = 0  # backends found running a statement, over all polls
    in_tx: int = 0  # backends found idle inside a transaction
    tables: list[tuple[str, float, float]] = field(default_factory=list)  # written, read /item

    @property
    def items(self) -> int:
        """Samples and turns (a turn is one sample of its own request)."""
        return self.samples + self.turns

    def per_item(self, total: float, idle_rate: float) -> float:
        """The window's `total` less what the nodes cost idle, per sample or turn."""
        return max(0.0, total - idle_rate * self.node_seconds) / max(1, self.items)


def wait_ready(pg: PgReader, k: int, slots: int, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    query = ("SELECT count(*) FROM workers WHERE kind = 'rollout' AND state = 'ready' "
             "AND job_id = %s")  # fmt: skip
    while int(pg.rows(query, JOB)[0][0]) < k * slots:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{k * slots} simulated devices not ready in {timeout}s")
        time.sleep(0.2)


def create_job(target: str) -> None:
    from tltd_clients import RolloutClient

    with RolloutClient(target, timeout=60) as client:
        client.create_job(MODEL.resolve(), job_id=JOB, speculative="off", online_training=False,
                          backend="sim")  # fmt: skip


def idle_costs(pg: PgReader, k: int, seconds: float) -> tuple[float, float, PgCounters]:
    """Transactions and backend CPU seconds per idle node and second; the counters at the
    end (the load window's start)."""
    time.sleep(PG_STATS_PAUSE)
    cpu = CpuLedger()
    cpu.observe(CoordinationMonitor._backend_cpu(pg_backends(pg)), start=True)
    c0, own0, t0 = pg_counters(pg), pg.xacts, time.monotonic()
    time.sleep(seconds)
    time.sleep(PG_STATS_PAUSE)
    cpu.observe(CoordinationMonitor._backend_cpu(pg_backends(pg)))
    c1 = pg_counters(pg)
    span = (time.monotonic() - t0) * k
    return (c1.xacts - c0.xacts - (pg.xacts - own0)) / span, cpu.seconds() / span, c1


def run_k(cfg, k: int, tmp: Path) -> NodesRun:
    run = NodesRun(k, cfg.slots)
    with scratch_postgres(PG_ADMIN_URL, "tltd_bench_nodes") as url:
        nodes = start_nodes(url, k, cfg.slots, tmp / f"k{k}")
        pg = None
        try:
            create_job(nodes[0].target)
            monitor = CoordinationMonitor(url)
            pg = monitor.pg
            wait_ready(pg, k, cfg.slots)
            run.idle_xacts_s, run.idle_cpu_s, c0 = idle_costs(pg, k, cfg.idle)
            own0, own_reads0 = pg.xacts, Counter(pg.own_reads)
            nodes_cpu = CpuLedger()
            for node in nodes:
                nodes_cpu.observe(node.cpu(), start=True)
            monitor.start()
            ledger, run.takeover, run.wall = asyncio.run(run_load(cfg, nodes, pg, nodes_cpu))
            for node in nodes[:-1]:
                nodes_cpu.observe(node.cpu())
            time.sleep(PG_STATS_PAUSE)
            monitor.stop()
            c1 = pg_counters(pg)
            run.xacts = c1.xacts - c0.xacts - (pg.xacts - own0)
            run.pg_cpu, run.node_cpu = monitor.cpu.seconds(), nodes_cpu.seconds()
            killed_after = 0.4 * cfg.seconds + (run.takeover.seconds or 0.0)
            run.node_seconds = (k - 1) * (run.wall + PG_STATS_PAUSE) + killed_after
            record(run, ledger, monitor, c0, c1, own_reads0)
            check(run, ledger, pg)
        finally:
            if pg is not None:
                pg.close()
            for node in nodes:
                node.kill()
    return run


def record(
    run: NodesRun, ledger: LoadLedger, monitor: CoordinationMonitor, c0, c1, own_reads0: Counter
) -> None:
    run.samples, run.turns = ledger.samples(), ledger.turns_done()
    run.samples_asked, run.requests = sum(ledger.asked.values()), len(ledger.asked)
    run.sessions, run.failed = len(ledger.turns), list(ledger.failed)
    run.failovers = ledger.failovers
    run.claim_ms = sorted(1000 * s for (_, _, a), s in monitor.claims.items() if a == 1)
    run.reclaims = sum(1 for (_, _, a) in monitor.claims if a > 1)
    run.max_backends = monitor.max_backends
    run.polls, run.busy, run.in_tx = monitor.polls, sum(monitor.active.values()), monitor.in_tx
    seen = run.busy or 1
    run.queries = [(label, count / seen, monitor.examples[label])
                   for label, count in monitor.active.most_common()]  # fmt: skip
    by_table: Counter[str] = Counter()
    for label, count in monitor.active.items():
        by_table[label.split(" [")[0].split(" ", 1)[-1]] += count
    run.by_table = [(t, c / seen) for t, c in by_table.most_common(4)]
    items = max(1, run.items)
    deltas = []
    for table, (written, read) in c1.tables.items():
        w0, r0 = c0.tables.get(table, (0, 0))
        read -= monitor.pg.own_reads[table] - own_reads0[table]
        deltas.append((table, (written - w0) / items, (read - r0) / items))
    run.tables = sorted(deltas, key=lambda t: -t[1])[:5]


def check(run: NodesRun, ledger: LoadLedger, pg: PgReader) -> None:
    """Lost and duplicated samples, by the client's count and by the database's rows."""
    rows = pg.rows(
        "SELECT request_id, prompt_index, sample_index, count(*) FROM samples "
        "WHERE request_id LIKE %s AND NOT partial GROUP BY 1, 2, 3",
        "bn-g%",
    )
    stored = Counter((r[0], r[1], r[2]) for r in rows)
    dup_rows = sum(int(r[3]) - 1 for r in rows)
    dup_client = sum(c - 1 for got in ledger.got.values() for c in got.values() if c > 1)
    run.duplicated = dup_rows + dup_client
    lost = 0
    for rid, asked in ledger.asked.items():
        keys = {(p, s) for p in range(PROMPTS) for s in range(N)}
        assert asked == len(keys)
        lost += sum(1 for p, s in keys if (rid, p, s) not in stored or not ledger.got[rid][(p, s)])
    turns = pg.rows("SELECT count(*) FROM session_turns WHERE session_id LIKE %s "
                    "AND status = 'done'", "bn-s%")[0][0]  # fmt: skip
    lost += max(0, ledger.turns_done() - int(turns))
    run.lost = lost
    run.units = int(pg.rows("SELECT count(*) FROM work_units")[0][0])


# ---- projection and report ---------------------------------------------------------------------


def answer_mean(draws: int = 20_000) -> float:
    """The mean simulated answer length of the GRPO requests (log-normal, capped)."""
    from tltd.contract.sim import parse_sim

    sigma, rng = parse_sim(SIM).sigma, random.Random(0)
    total = 0
    for _ in range(draws):
        total += min(rng.choice(CAPS), max(1, round(MEDIAN * rng.lognormvariate(0.0, sigma))))
    return total / draws


def gpu_rate(batch: int) -> float:
    """Samples/s of one simulated H100 at `batch` rows: every row decodes one token a step
    (a step of `batch` rows holding half their answer on average), each sample's prefill
    on top."""
    from tltd.contract.sim import parse_sim

    sim, length, prompt = parse_sim(SIM), answer_mean(), 48
    step = sim.step_seconds(batch, batch * (prompt + length / 2))
    return 1.0 / (length * step / batch + prompt * sim.prefill_us / 1e6)


@dataclass(frozen=True)
class Projection:
    pg_cpu_ms: float  # per sample, less the idle nodes' share
    idle_cpu_ms_s: float  # per idle node and second
    node_rate: float  # samples/s of one GPU node
    nodes: float
    bottleneck: str


def project(run: NodesRun, cfg) -> Projection:
    cpu = run.per_item(run.pg_cpu, run.idle_cpu_s)
    node_rate = GPUS_PER_NODE * gpu_rate(cfg.gpu_batch)
    budget = cfg.pg_cores * cfg.pg_busy  # CPU seconds per second
    per_node = cpu * node_rate + run.idle_cpu_s
    nodes = budget / per_node if per_node > 0 else math.inf
    if run.queries:
        label, share, _ = run.queries[0]
        tables = ", ".join(f"{t} {x:.0%}" for t, x in run.by_table)
        locks = sum(x for q, x, _ in run.queries if "[Lock:" in q)
        why = (f"{label}, {share:.0%} of busy-backend samples; by table {tables}; "
               f"{locks:.0%} waiting on a row lock")  # fmt: skip
    else:
        why = "no statement sampled running"
    return Projection(1000 * cpu, 1000 * run.idle_cpu_s, node_rate, nodes, why)


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def table_rows(runs: list[NodesRun], cfg) -> list[str]:
    head = ("| nodes x devices | window s | samples/s | turns/s | claim p50 / p99 ms (seen) "
            "| PG xact / sample | PG CPU ms / sample | PG idle CPU ms/s / node "
            "| daemons CPU ms / sample | PG conns | takeover s (units) | lost | dup | failed "
            "| projected nodes / PG |")  # fmt: skip
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        p = project(r, cfg)
        out.append(
            f"| {r.nodes} x {r.slots} | {r.wall:.1f} | {r.samples / r.wall:.1f} | "
            f"{r.turns / r.wall:.2f} | {pct(r.claim_ms, 0.5):.0f} / {pct(r.claim_ms, 0.99):.0f} "
            f"({len(r.claim_ms)}/{r.units}) | {r.per_item(r.xacts, r.idle_xacts_s):.2f} | "
            f"{p.pg_cpu_ms:.2f} | {p.idle_cpu_ms_s:.1f} | "
            f"{1000 * r.node_cpu / max(1, r.items):.1f} | {r.max_backends} | "
            f"{r.takeover.seconds:.1f} ({r.takeover.held}) | {r.lost} | {r.duplicated} | "
            f"{len(r.failed)} | {math.floor(p.nodes)} |"
        )  # fmt: skip
    return out


def details(run: NodesRun) -> list[str]:
    out = [f"\n{run.nodes} nodes: {run.requests} GRPO requests ({run.samples} of "
           f"{run.samples_asked} samples), {run.sessions} sessions ({run.turns} turns); "
           f"re-claims seen {run.reclaims}; client failovers {run.failovers}; PG "
           f"transactions {run.xacts:.0f}, PG CPU "
           f"{run.pg_cpu:.1f} s, daemons' CPU {run.node_cpu:.1f} s in the window"]  # fmt: skip
    out.append(f"  busiest statements: share of {run.busy} backends found running one in "
               f"{run.polls} polls of pg_stat_activity ({run.in_tx} found idle inside a "
               "transaction):")  # fmt: skip
    out += [f"    {x:6.1%}  {label:<44} {text[:90]}" for label, x, text in run.queries[:8]]
    out.append("  tables, rows written / rows read per sample or turn:")
    out += [f"    {t:<20} {w:8.2f} {r:10.1f}" for t, w, r in run.tables]
    out += [f"  failed: {f}" for f in run.failed[:5]]
    return out


def report(runs: list[NodesRun], cfg) -> None:
    print(f"\nsimulated devices: sim_engine {SIM!r} (H100 roofline of Qwen2.5-7B, asleep); "
          f"load average now {' '.join(f'{x:.2f}' for x in os.getloadavg())}, "
          f"{os.cpu_count()} CPUs for everything")  # fmt: skip
    print("\n".join(table_rows(runs, cfg)))
    for run in runs:
        print("\n".join(details(run)))
    run = max(runs, key=lambda r: r.nodes)
    p = project(run, cfg)
    print(f"\nPROJECTION from this machine's measured costs (K={run.nodes}), not a measured "
          f"cluster: a GPU node = {GPUS_PER_NODE} x H100 at the simulated roofline, batch "
          f"{cfg.gpu_batch}, mean answer {answer_mean():.0f} tokens: {p.node_rate:.0f} "
          f"samples/s; it costs PostgreSQL {p.pg_cpu_ms:.2f} ms CPU per sample x that + "
          f"{p.idle_cpu_ms_s:.1f} ms/s idle; one dedicated PostgreSQL of {cfg.pg_cores} cores "
          f"at {cfg.pg_busy:.0%} busy = {cfg.pg_cores * cfg.pg_busy:.1f} CPU s/s; connections "
          f"{run.max_backends / run.nodes:.1f} a node (max_connections bounds them)")  # fmt: skip
    print(f"projected nodes per PostgreSQL: {math.floor(p.nodes)} (bottleneck: {p.bottleneck})")


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="2,4", help="K values, comma separated (2-8)")
    parser.add_argument("--slots", type=int, default=2, help="simulated devices per node")
    parser.add_argument("--seconds", type=float, default=60.0, help="callers start work this long")
    parser.add_argument("--idle", type=float, default=3.0, help="idle window, seconds")
    parser.add_argument("--grpo", type=int, default=3, help="GRPO callers per node")
    parser.add_argument("--sessions", type=int, default=2, help="session callers per node")
    parser.add_argument("--gpu-batch", type=int, default=256, help="rows per H100 (projection)")
    parser.add_argument("--pg-cores", type=int, default=16, help="dedicated PostgreSQL cores")
    parser.add_argument("--pg-busy", type=float, default=0.7, help="their usable share")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep logs here")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--quick", action="store_true", help="7 s, 2 nodes (a smoke test)")
    cfg = parser.parse_args(argv)
    if cfg.quick:
        cfg.nodes, cfg.seconds, cfg.idle, cfg.grpo, cfg.sessions = "2", 7.0, 1.0, 2, 1
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="tltd-bench-nodes-") as scratch:
        tmp = Path(cfg.work_dir or scratch)
        for k in (int(x) for x in cfg.nodes.split(",")):
            if k < 2:
                raise SystemExit("--nodes: at least 2 (one of them is killed)")
            runs.append(run_k(cfg, k, tmp))
    report(runs, cfg)
    if cfg.json:
        figures = [asdict(r) | {"projection": asdict(project(r, cfg))} for r in runs]
        cfg.json.write_text(json.dumps(figures, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
