"""The daemon's own cost per request and per sample, beside the floors it cannot go below.

A real `tltd serve` (SQLite and/or PostgreSQL) serves 1 new token per sample, so what is left
is the control plane: admission, SQL writes, the scheduler tick, the pipe, the stream back.
Each engine in one run (`--engines`), a daemon of its own each:
  torch    the shipped policy with SD off (the engine computes the token)
  sim0     the simulated engine at zero cost (backend "sim", `sim_engine` "zero"): the
           daemon alone, its workers only draw a token
  simgpu   the simulated engine asleep for a GPU's step: `benchmarks/gpu_model.py`'s roofline
           of Qwen2.5-7B on an H100 as SimConfig's linear form (a projection's cost, not a
           measured GPU)
`AsyncRolloutClient` in this process sends requests from concurrent tasks (CLIENTSxN); the
table gives requests/s, samples/s, p50/p99 latency per request, the daemon process's CPU ms per
request and per sample (its own, read from /proc: not its workers') and, on PostgreSQL, the
database's transactions per sample (pg_stat_database, every connection of the daemon).

Floors measured in the same run, on the same machine, for the same request:
  engine   the engine in this process (one thread), the same prompt, n and 1 token
  echo     a bare gRPC server (another process) answering the same GenerateRequest with the
           same n samples, as the daemon does (one message of n with `batch_samples`)
  sql      one transaction per request inserting the same rows (request, unit, n samples)
  store    the store and stream path alone (no engine, no gRPC) for samples of 1, 256 and
           4,096 tokens with logprobs: the supervisor's sample write, the stream's read, the
           protobuf encoding; CPU ms per sample of this process. Requests of one prompt, and
           of 512 prompts of 200 tokens (an RL step's request: its prompts are its largest
           column)

`--src DIR` (repeatable) runs each scenario against the daemon of another checkout as well
(e.g. a `git worktree` of the commit before a change), in rotation with this one, so that a
before/after comparison shares one machine's load.

    nice -n 10 .venv/bin/python benchmarks/bench_control_plane.py [--db sqlite,postgresql]
        [--engines torch,sim0,simgpu] [--scenarios 1x1,16x1,64x1,16x16] [--seconds 10]
        [--repeats 3] [--src ../before]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tltd.store.database import scratch_postgres  # noqa: E402

MODEL = ROOT / "models" / "tiny-policy"
PG_ADMIN_URL = os.environ.get("TLTD_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
JOB = "bench-cp"
PG_STATS_PAUSE = 1.5  # seconds: every backend's counts reported (they report at most 1/s)
_TICK = os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    """user + system CPU seconds of one process (not its children), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def gpu_sim_config() -> str:
    """`sim_engine` for a GPU-like step: `gpu_model`'s roofline of Qwen2.5-7B on an H100 in
    SimConfig's linear form. A decode step streams the weights once (`forward_ms` at one row,
    no context: 5.9 ms) and every row's KV cache (bytes per token over the usable bandwidth:
    21 ns a token held); a prompt token costs its compute at the GEMM efficiency (26 us)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_model as g

    dev, shape = g.H100, g.QWEN25_7B
    step_ms = g.forward_ms(dev, shape, 1, 1, 0)
    kv_ns = 1e9 * shape.kv_bytes() / (dev.hbm_bytes_s * dev.mem_eff)
    prefill_us = 1e6 * 2 * shape.streamed_params() / (dev.bf16_flops * dev.gemm_eff)
    return f"step_ms={step_ms:.3f},kv_ns={kv_ns:.2f},prefill_us={prefill_us:.2f}"


# Engine name -> the daemon's sim_engine ("" : the torch engine computes).
ENGINES = {"torch": "", "sim0": "zero", "simgpu": gpu_sim_config()}


def pg_transactions(url: str) -> int:
    """Transactions committed and rolled back in database `url` so far (pg_stat_database;
    a backend reports its counts when idle, at most once a second: read after a pause)."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database "
                "WHERE datname = current_database()")).scalar_one())  # fmt: skip
    finally:
        engine.dispose()


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---- databases and daemons ----------------------------------------------------------------------


@contextmanager
def database(kind: str, tmp: Path) -> Iterator[str]:
    """A fresh database: a SQLite file, or a new PostgreSQL database dropped afterwards."""
    if kind == "sqlite":
        path = tmp / f"db-{uuid.uuid4().hex[:8]}.sqlite"
        yield f"sqlite:///{path}"
        return
    with scratch_postgres(PG_ADMIN_URL, "tltd_bench") as url:
        yield url


def source_env(src: Path, scratch: Path) -> dict[str, str]:
    """The environment that imports every package from checkout `src`: this venv installs
    `tltd_workers` and `tltd_clients` from this checkout's folders (by name), so a
    `PYTHONPATH` of links puts `src`'s first, for the daemon and the workers it forks."""
    links = scratch / f"path-{abs(hash(str(src))):x}"
    links.mkdir(parents=True, exist_ok=True)
    for name, folder in (
        ("tltd", "tltd"),
        ("tltd_workers", "workers"),
        ("tltd_clients", "clients"),
    ):
        link = links / name
        if not link.exists():
            link.symlink_to(src / folder, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TLTD_")}
    env["PYTHONPATH"] = str(links)
    return env


class Daemon:
    """`tltd serve` from checkout `src` (its daemon and workers) on a free port, on database
    `url`; `env`: more TLTD_* settings."""

    def __init__(
        self, src: Path, url: str, data: Path, cpu_slots: int, prefix: list[str], sim: str = "",
        env: dict[str, str] | None = None,
    ):  # fmt: skip
        data.mkdir(parents=True, exist_ok=True)
        port_file = data / "port"
        extra, env = env or {}, source_env(src, data.parent)
        env["TLTD_DRAFTER_TRAINING"] = "false"
        if sim:
            env["TLTD_SIM_ENGINE"] = sim
        env |= extra
        self.log_path = data / "tltd.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "tltd", "serve", "--port", "0",
             "--port-file", str(port_file), "--data-dir", str(data / "tltd"),
             "--database-url", url, "--cpu-slots", str(cpu_slots)],
            cwd=src, env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 180
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tltd did not start: {self.log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        self.target = f"127.0.0.1:{port_file.read_text().strip()}"
        self.url, self.sim = url, sim
        self.pid = self._daemon_pid() if prefix else self.proc.pid

    def _daemon_pid(self) -> int:
        """The daemon's pid under a profiler prefix (which runs it as its child)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        for kid in children.read_text().split() if children.exists() else []:
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes().split(b"\0")
            if b"serve" in cmd and b"tltd" in cmd:
                return int(kid)
        return self.proc.pid

    def stop(self) -> None:
        self.proc.send_signal(2)  # SIGINT: a profiler prefix writes its output then
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


# ---- load ------------------------------------------------------------------------------------


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    requests: int = 0
    samples: int = 0
    cpu: float = 0.0  # daemon CPU seconds
    failed: int = 0  # requests that ended in an error (not counted in the rates)
    xacts: float = float("nan")  # PostgreSQL transactions in the run (nan: SQLite)

    def add(self, other: Result) -> None:
        self.latencies += other.latencies
        self.wall += other.wall
        self.requests += other.requests
        self.samples += other.samples
        self.cpu += other.cpu
        self.failed += other.failed
        self.xacts += other.xacts

    @property
    def rps(self) -> float:
        return self.requests / self.wall if self.wall else 0.0

    @property
    def sps(self) -> float:
        return self.samples / self.wall if self.wall else 0.0

    def pct(self, q: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def drive(send, clients: int, seconds: float, min_requests: int) -> Result:
    """`clients` tasks each sending requests back to back for `seconds` (and until
    `min_requests` have finished in all): latency of each, wall time of all."""
    from tltd_clients.errors import TltClientError

    out = Result()
    stop_at = time.perf_counter() + seconds

    async def one_client(c: int) -> None:
        i = 0
        while time.perf_counter() < stop_at or out.requests < min_requests:
            t0 = time.perf_counter()
            i += 1
            try:
                got = await send(c * 1_000_000 + i)
            except TltClientError as exc:  # counted, shown, and not taken for a result
                out.failed += 1
                print(f"request failed: {exc}", file=sys.stderr)
                continue
            out.latencies.append(time.perf_counter() - t0)
            out.requests += 1
            out.samples += got

    t0 = time.perf_counter()
    await asyncio.gather(*(one_client(c) for c in range(clients)))
    out.wall = time.perf_counter() - t0
    return out


async def run_daemon_load(
    daemon: Daemon, prompt: list[int], n: int, clients: int, seconds: float, warm: int
) -> Result:
    from tltd_clients import AsyncRolloutClient

    pg = daemon.url if daemon.url.startswith("postgresql") else ""
    async with AsyncRolloutClient(daemon.target, timeout=600) as client:
        await client.create_job(MODEL.resolve(), job_id=JOB, speculative="off",
                                online_training=False,
                                backend="sim" if daemon.sim else "torch")  # fmt: skip

        async def send(seed: int) -> int:
            got = await client.generate([prompt], n=n, max_new_tokens=1, temperature=1.0,
                                        seed=seed)  # fmt: skip
            assert len(got) == n, len(got)
            return len(got)

        for i in range(warm):  # workers load the model; connections open
            await send(10**9 + i)
        if pg:
            await asyncio.sleep(PG_STATS_PAUSE)
            xacts0 = pg_transactions(pg)
        cpu0 = process_cpu(daemon.pid)
        result = await drive(send, clients, seconds, clients)
        result.cpu = process_cpu(daemon.pid) - cpu0
        if pg:
            await asyncio.sleep(PG_STATS_PAUSE)
            result.xacts = pg_transactions(pg) - xacts0 - 1  # less the first read's own
        return result


# ---- floors ----------------------------------------------------------------------------------


def engine_floor(prompt: list[int], n: int, repeats: int) -> float:
    """Seconds per request of the engine alone (in this process, one thread)."""
    import torch

    from tltd.domain import SamplingParams
    from tltd_workers.engine.engine import Engine, EngineConfig, Request
    from tltd_workers.engine.transformer import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_model(MODEL)
        engine = Engine(model, EngineConfig(max_batch=64, max_seq_len=len(prompt) + 8,
                                            spec_mode="off"))  # fmt: skip
        times = []
        for i in range(repeats + 3):
            params = SamplingParams(n=n, temperature=1.0, max_new_tokens=1, seed=i)
            t0 = time.perf_counter()
            outs = engine.generate([Request(f"r{i}", prompt, params, prompt_index=0)])
            times.append(time.perf_counter() - t0)
            assert len(outs) == n
        return statistics.median(times[3:])
    finally:
        torch.set_num_threads(threads)


def canned_response(tokens: int, logprobs: bool = True):
    """A GenerateResponse as the daemon sends for a `tokens`-token sample."""
    from tltd.api.convert import sample_to_pb
    from tltd.domain import FinishReason, Sample
    from tltd.v1 import rollout_pb2

    ids = tuple(range(3, 3 + tokens))
    lps = tuple(-0.5 - (i % 7) * 0.01 for i in range(tokens)) if logprobs else ()
    sample = Sample("req-" + "0" * 32, 0, 0, ids, lps, FinishReason.LENGTH)
    return rollout_pb2.GenerateResponse(sample=sample_to_pb(sample))


def echo_server(port_file: str) -> None:
    """A bare gRPC server: Generate answers n canned 1-token samples (no store, no engine),
    as the daemon sends them: in one message when the call sets `batch_samples` (the
    project's clients do), else one message each."""
    import grpc

    from tltd.v1 import rollout_pb2

    response = canned_response(1)

    async def generate(request, context):
        if request.batch_samples:
            yield rollout_pb2.GenerateResponse(samples=[response.sample] * request.sampling.n)
            return
        for _ in range(request.sampling.n):
            yield response

    async def serve() -> None:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "bench.Echo",
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    generate,
                    request_deserializer=rollout_pb2.GenerateRequest.FromString,
                    response_serializer=rollout_pb2.GenerateResponse.SerializeToString,
                )
            },
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        Path(port_file).write_text(str(port))
        await server.wait_for_termination()

    asyncio.run(serve())


async def run_echo_load(
    target: str, prompt: list[int], n: int, clients: int, seconds: float
) -> Result:
    import grpc

    from tltd.v1 import rollout_pb2
    from tltd_clients.rollout import _generate_request, _new_request_id, _sampling

    async with grpc.aio.insecure_channel(target) as channel:
        call = channel.unary_stream(
            "/bench.Echo/Generate",
            request_serializer=rollout_pb2.GenerateRequest.SerializeToString,
            response_deserializer=rollout_pb2.GenerateResponse.FromString,
        )

        async def send(seed: int) -> int:
            params = _sampling(n, None, {"max_new_tokens": 1, "temperature": 1.0, "seed": seed})
            req = _generate_request(JOB, [prompt], params, _new_request_id(), None)
            return sum([max(1, len(r.samples)) async for r in call(req)])

        await send(0)
        return await drive(send, clients, seconds, clients)


def sql_floor(url: str, prompt: list[int], n: int, requests: int) -> float:
    """Seconds per request of one transaction inserting the rows a request leaves: the
    request, its work unit, its n samples (SQLAlchemy Core, no ORM)."""
    from sqlalchemy import insert

    from tltd.domain import Job, RolloutRequest, SamplingParams
    from tltd.store import Store, convert
    from tltd.store.migrate import upgrade
    from tltd.store.tables import RolloutRequestRow, SampleRow, WorkUnitRow, utcnow

    upgrade(url)
    store = Store(url)
    try:
        store.jobs.create(Job(job_id=JOB, model_path=str(MODEL)))
        sample_row = _columns(convert.sample_to_row(sample_from_response(canned_response(1))))
        times = []
        for i in range(requests + 2):
            rid, now = f"sql-{i}-{uuid.uuid4().hex[:8]}", utcnow()
            req = RolloutRequest(rid, JOB, (tuple(prompt),), SamplingParams(n=n, seed=i))
            req_row = _columns(convert.request_to_row(req))
            t0 = time.perf_counter()
            with store.db.engine.begin() as conn:
                conn.execute(insert(RolloutRequestRow), [{
                    **req_row, "status": "queued", "status_reason": "", "samples_done": 0,
                    "policy_version": 0, "created_at": now, "updated_at": now}])  # fmt: skip
                conn.execute(insert(WorkUnitRow), [{
                    "request_id": rid, "prompt_index": 0, "samples": n, "prompt_key": "k",
                    "priority": 0, "state": "queued", "owner_epoch": 0, "attempts": 0,
                    "reason": "", "created_at": now, "updated_at": now}])  # fmt: skip
                conn.execute(insert(SampleRow), [
                    {**sample_row, "request_id": rid, "sample_index": s, "created_at": now}
                    for s in range(n)])  # fmt: skip
            times.append(time.perf_counter() - t0)
        return statistics.median(times[2:])
    finally:
        store.close()


def sample_from_response(resp):
    from tltd.api.convert import sample_from_pb

    return sample_from_pb(resp.sample)


def _columns(row) -> dict:
    """A row object's column values (those set), for a Core insert."""
    return {
        c.key: getattr(row, c.key)
        for c in row.__table__.columns
        if c.key != "id" and getattr(row, c.key) is not None
    }


def store_stream_micro(
    url: str, tokens: int, samples: int, prompts: int = 1
) -> tuple[float, float]:
    """CPU ms per sample of this process for the store path (the supervisor's sample write)
    and for the stream path (the stream's read of what was stored, the protobuf encoding as
    the project's clients get it: one message of the request's samples, `batch_samples`):
    `samples` samples of `tokens` tokens with logprobs, n=16 per request, the request of
    `prompts` prompts (200 tokens each when more than one); the samples of prompt 0 are
    written and read."""
    from tltd.api.convert import generate_batch_responses
    from tltd.domain import Job, RolloutRequest, SamplingParams
    from tltd.store import Store
    from tltd.store.migrate import upgrade
    from tltd.supervisor.writes import add_samples

    upgrade(url)
    store = Store(url, node_id="bench")
    template = sample_from_response(canned_response(tokens))
    try:
        store.jobs.create(Job(job_id=JOB, model_path=str(MODEL)))
        n = 16
        write_cpu = read_cpu = 0.0
        request_prompts = ((1, 2, 3),) if prompts == 1 else (tuple(range(4, 204)),) * prompts
        for r in range(max(1, samples // n)):
            rid = f"micro-{r}"
            store.requests.create(RolloutRequest(
                rid, JOB, request_prompts, SamplingParams(n=n, max_new_tokens=tokens)))  # fmt: skip
            batch = [_replace_sample(template, request_id=rid, sample_index=s) for s in range(n)]
            c0 = time.process_time()
            add_samples(store, batch)
            c1 = time.process_time()
            _, _, got, _ = store.leases.stream_state(rid, 0)
            wire = [m.SerializeToString() for m in generate_batch_responses(got)]
            c2 = time.process_time()
            assert len(got) == n and wire
            write_cpu += c1 - c0
            read_cpu += c2 - c1
        done = max(1, samples // n) * n
        return 1000 * write_cpu / done, 1000 * read_cpu / done
    finally:
        store.close()


# The store micro's shapes: (tokens a sample, prompts a request).
MICROS = ((1, 1), (256, 1), (4096, 1), (256, 512))


def store_stream_micros_of(
    src: Path, warm_url: str, runs: list[tuple]
) -> list[tuple[float, float]]:
    """`store_stream_micro(*run)` of checkout `src` for each of `runs` (url, tokens, samples,
    prompts), in one process of its own (the store's code is what differs between checkouts; a
    checkout whose copy of this file predates the micro's `prompts` needs this copy put in its
    benchmarks/). A warm-up run on database `warm_url` goes first: a process's first run pays
    imports and first-call costs that the others would not."""
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); "
            "from bench_control_plane import store_stream_micro as m; "
            f"m({warm_url!r}, 1, 16, 1); runs = {runs!r}; "
            "print(json.dumps([m(*r) for r in runs]))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], cwd=src, check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return [(w, r) for w, r in json.loads(out.strip().splitlines()[-1])]


def _replace_sample(sample, **changes):
    from dataclasses import replace

    return replace(sample, **changes)


# ---- main ------------------------------------------------------------------------------------


def parse_scenarios(text: str) -> list[tuple[int, int]]:
    """ "16x1,64x16" -> [(clients, n), ...]"""
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s]  # type: ignore[misc]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", default="sqlite,postgresql")
    parser.add_argument("--engines", default="torch,sim0,simgpu",
                        help=f"comma separated, of {', '.join(ENGINES)}")  # fmt: skip
    parser.add_argument("--scenarios", default="1x1,16x1,64x1,16x16",
                        help="CLIENTSxN, comma separated")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=10.0, help="per scenario and repeat")
    parser.add_argument("--repeats", type=int, default=3, help="results are medians of these")
    parser.add_argument("--cpu-slots", type=int, default=2)
    parser.add_argument("--src", type=Path, action="append", default=[],
                        help="another checkout's daemon to run beside this one")  # fmt: skip
    parser.add_argument("--micro-samples", type=int, default=256)
    parser.add_argument("--profile", type=Path, default=None,
                        help="py-spy the daemon (GIL holder), flame data here")  # fmt: skip
    parser.add_argument("--no-floors", action="store_true")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep the daemons' data and logs here")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="SQLite, 2 short scenarios")
    parser.add_argument("--echo-server", help=argparse.SUPPRESS)
    cfg = parser.parse_args(argv)
    if cfg.quick:
        cfg.db, cfg.scenarios, cfg.seconds, cfg.repeats = "sqlite", "1x1,4x4", 0.5, 1
        cfg.micro_samples, cfg.cpu_slots = 16, 1
    return cfg


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.echo_server:
        echo_server(cfg.echo_server)
        return 0
    from examples.task.workload import rollout_prompts

    prompt = list(rollout_prompts(1, seed=7, model_dir=MODEL)[0][1])
    scenarios = parse_scenarios(cfg.scenarios)
    sources = [("this", ROOT)] + [(p.name or str(p), p.resolve()) for p in cfg.src]
    print(f"load average at start: {load_average()}  ({os.cpu_count()} CPUs)")
    floors = {} if cfg.no_floors else measure_floors(cfg, prompt, scenarios)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tltd-bench-cp-") as scratch:
        tmp = Path(cfg.work_dir or scratch)
        for db in cfg.db.split(","):
            rows += run_db(cfg, db, sources, tmp, prompt, scenarios)
            if not cfg.no_floors:
                measure_db_floors(cfg, db, sources, tmp, prompt, scenarios, floors)
    print(f"load average at end: {load_average()}")
    print_tables(cfg, rows, floors, len(prompt))
    return 0


def run_db(cfg, db: str, sources, tmp: Path, prompt, scenarios) -> list:
    """Every source and engine on database kind `db`, `cfg.repeats` times in rotation:
    rows (db, source, engine, clients, n, runs)."""
    results: dict[tuple[str, str, int, int], list[Result]] = {}
    runs = [(name, src, engine) for engine in cfg.engines.split(",") for name, src in sources]
    for rep in range(cfg.repeats):
        for name, src, engine in runs[rep % len(runs) :] + runs[: rep % len(runs)]:
            for (clients, n), r in run_source(cfg, db, src, tmp, prompt, scenarios, rep,
                                              engine).items():  # fmt: skip
                results.setdefault((name, engine, clients, n), []).append(r)
    return [(db, name, engine, c, n, r) for (name, engine, c, n), r in results.items()]


def measure_db_floors(cfg, db: str, sources, tmp: Path, prompt, scenarios, floors) -> None:
    with database(db, tmp) as url:
        for n in sorted({n for _, n in scenarios}):
            floors[("sql", db, n)] = sql_floor(url, prompt, n, 5 if cfg.quick else 50)
    for _ in range(cfg.repeats):  # each source in turn, a new database for each micro
        for name, src in sources:
            with ExitStack() as stack:
                warm, *urls = [stack.enter_context(database(db, tmp)) for _ in range(5)]
                runs = [
                    (url, t, cfg.micro_samples, p) for url, (t, p) in zip(urls, MICROS, strict=True)
                ]
                got = store_stream_micros_of(src, warm, runs)
            for (tokens, prompts), write_read in zip(MICROS, got, strict=True):
                floors.setdefault(("store", db, tokens, name, prompts), []).append(write_read)


def run_source(cfg, db: str, src: Path, tmp: Path, prompt, scenarios, rep: int, engine: str):
    out = {}
    prefix = []
    if cfg.profile is not None:
        cfg.profile.mkdir(parents=True, exist_ok=True)
        flame = cfg.profile / f"{db}-{src.name}-{engine}-{rep}.txt"
        prefix = [str(Path(sys.executable).parent / "py-spy"), "record", "--gil", "-r", "200",
                  "-f", "raw", "-o", str(flame), "--"]  # fmt: skip
    with database(db, tmp) as url:
        data = tmp / f"d-{uuid.uuid4().hex[:6]}"
        daemon = Daemon(src, url, data, cfg.cpu_slots, prefix, ENGINES[engine])
        try:
            for clients, n in scenarios:
                warm = 2 * cfg.cpu_slots if (clients, n) == scenarios[0] else 1
                out[(clients, n)] = asyncio.run(run_daemon_load(
                    daemon, prompt, n, clients, cfg.seconds, warm))  # fmt: skip
        finally:
            daemon.stop()
    return out


def measure_floors(cfg, prompt, scenarios) -> dict:
    floors: dict = {}
    for n in sorted({n for _, n in scenarios}):
        floors[("engine", n)] = engine_floor(prompt, n, 5 if cfg.quick else 20)
    with tempfile.TemporaryDirectory(prefix="tltd-bench-echo-") as tmp:
        port_file = Path(tmp) / "port"
        proc = subprocess.Popen([sys.executable, __file__, "--echo-server", str(port_file)])
        try:
            deadline = time.monotonic() + 60
            while not (port_file.exists() and port_file.read_text().strip()):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the echo server did not start")
                time.sleep(0.05)
            target = f"127.0.0.1:{port_file.read_text().strip()}"
            for clients, n in scenarios:
                cpu0 = process_cpu(proc.pid)
                r = asyncio.run(run_echo_load(target, prompt, n, clients, cfg.seconds))
                r.cpu = process_cpu(proc.pid) - cpu0
                floors[("echo", clients, n)] = r
        finally:
            proc.kill()
            proc.wait()
    return floors


def _median(runs: list[Result], fn) -> float:
    return statistics.median(fn(r) for r in runs)


def engine_ms(engine: str, n: int, prompt_len: int, floors: dict) -> float:
    """The engine's own time for one request of n samples of 1 token: measured for torch
    (alone, in this process), the cost model's for the simulated engine (one step of n rows
    and their prefill)."""
    if not ENGINES[engine]:
        return 1000 * floors.get(("engine", n), float("nan"))
    from tltd.contract.sim import parse_sim

    sim = parse_sim(ENGINES[engine])
    return 1000 * sim.step_seconds(n, n * prompt_len) + n * prompt_len * sim.prefill_us / 1e3


def print_tables(cfg, rows, floors, prompt_len: int) -> None:
    print(f"\n1 new token per sample, SD off, {cfg.cpu_slots} CPU slot(s); medians of "
          f"{cfg.repeats} x {cfg.seconds:g} s; engines: torch = the shipped policy "
          f"{MODEL.name}, sim0 = simulated at zero cost, simgpu = simulated asleep for "
          f"{ENGINES['simgpu']} (H100 Qwen2.5-7B roofline, a projection)")  # fmt: skip
    head = ("| db | daemon | engine | clients | n | req/s | samples/s | p50 ms | p99 ms "
            "| daemon CPU ms/req | daemon CPU ms/sample | PG xact/sample | engine ms/req "
            "| p50 - engine ms | echo req/s | req/s vs echo | sql ms/req | failed |")  # fmt: skip
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for db, name, engine, clients, n, runs in rows:
        rps = _median(runs, lambda r: r.rps)
        sps = _median(runs, lambda r: r.sps)
        p50 = 1000 * _median(runs, lambda r: r.pct(0.5))
        p99 = 1000 * _median(runs, lambda r: r.pct(0.99))
        cpu_req = 1000 * _median(runs, lambda r: r.cpu / max(1, r.requests))
        cpu = 1000 * _median(runs, lambda r: r.cpu / max(1, r.samples))
        xacts = _median(runs, lambda r: r.xacts / max(1, r.samples))
        eng = engine_ms(engine, n, prompt_len, floors)
        echo = floors.get(("echo", clients, n))
        echo_rps = echo.rps if echo else float("nan")
        sql = 1000 * floors.get(("sql", db, n), float("nan"))
        print(f"| {db} | {name} | {engine} | {clients} | {n} | {rps:.1f} | {sps:.1f} | "
              f"{p50:.1f} | {p99:.1f} | {cpu_req:.2f} | {cpu:.2f} | {xacts:.2f} | {eng:.2f} | "
              f"{p50 - eng:.1f} | {echo_rps:.0f} | {rps / echo_rps:.3f} | {sql:.2f} | "
              f"{sum(r.failed for r in runs)} |")  # fmt: skip
    micro = [k for k in floors if k[0] == "store"]
    if micro:
        print(f"\nstore and stream path alone, medians of {cfg.repeats}:")
        print("| db | daemon | tokens/sample (with logprobs) | prompts/request | store CPU "
              "ms/sample | stream read + encode CPU ms/sample | total [min-max] |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for key in micro:
            runs = floors[key]
            w = statistics.median(x for x, _ in runs)
            r = statistics.median(y for _, y in runs)
            tot = [x + y for x, y in runs]
            print(f"| {key[1]} | {key[3]} | {key[2]} | {key[4]} | {w:.3f} | {r:.3f} | "
                  f"{statistics.median(tot):.3f} [{min(tot):.3f}-{max(tot):.3f}] |")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
