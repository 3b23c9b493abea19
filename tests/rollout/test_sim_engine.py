"""The simulated engine: refused unless asked for and allowed, marked wherever its samples go."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import grpc
import pytest

from tests.api.support import (
    DaemonThread,
    fails,
    make_settings,
    sampling,
    seed_devices,
    write_model_dir,
)
from tests.rollout.support import InProcessDaemon, make_checkpoint
from tltd.contract.rollout_messages import (
    AddWork,
    Cancel,
    EngineSpec,
    Finished,
    Heartbeat,
    LoadModel,
    Ready,
)
from tltd.contract.sim import SimConfig, parse_sim
from tltd.domain import FinishReason, SamplingParams
from tltd.errors import ConfigError
from tltd.metrics import METRICS
from tltd.v1 import common_pb2, rollout_pb2

STOP = 7
NO_TRAINING = common_pb2.SpeculativeConfig(online_training=False)


def _cpu_seconds(pid: int) -> float:
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- settings ------------------------------------------------------------------------------


def test_parse_sim() -> None:
    assert parse_sim("zero") == SimConfig()
    cfg = parse_sim("step_ms=6.3, kv_ns=20,median=1500,tail=10,seed=3")
    assert (cfg.step_ms, cfg.kv_ns, cfg.median, cfg.seed) == (6.3, 20, 1500, 3)
    # 64 rows of 1,000 tokens: 6.3 ms + 64,000 x 20 ns
    assert cfg.step_seconds(64, 64_000) == pytest.approx((6.3 + 1.28) / 1e3)
    for bad in ("fast", "step_ms=x", "step_ms=-1", "tail=0.5", "gpu=1"):
        with pytest.raises(ValueError, match="sim_engine"):
            parse_sim(bad)


def test_settings_refuse_sim_as_default_and_bad_config(tmp_path) -> None:
    with pytest.raises(ConfigError, match="default_backend"):
        make_settings(tmp_path, default_backend="sim", sim_engine="zero")
    with pytest.raises(ConfigError, match="sim_engine"):
        make_settings(tmp_path, sim_engine="step_ms=fast")


# ---- refusal at the API ----------------------------------------------------------------------


def _api_daemon(store, tmp_path, **settings) -> DaemonThread:
    seed_devices(store)
    return DaemonThread(make_settings(tmp_path, **settings), store).start()


def test_sim_job_refused_on_a_daemon_that_does_not_allow_it(sqlite_store, tmp_path) -> None:
    model = write_model_dir(tmp_path / "model")
    d = _api_daemon(sqlite_store, tmp_path)
    try:
        with d.client() as c:
            with fails(grpc.StatusCode.FAILED_PRECONDITION, "backend", "sim_engine"):
                c.create_job(str(model), backend=common_pb2.BACKEND_SIM, speculative=NO_TRAINING)
            job = c.create_job(str(model))  # a job that did not ask for it: the default engine
            assert job.backend == common_pb2.BACKEND_TORCH
    finally:
        d.stop()
    assert [j.backend.value for j in sqlite_store.jobs.list()] == ["torch"]


def test_sim_job_must_turn_online_training_off(sqlite_store, tmp_path) -> None:
    model = write_model_dir(tmp_path / "model")
    d = _api_daemon(sqlite_store, tmp_path, sim_engine="zero")
    try:
        with d.client() as c:
            with fails(grpc.StatusCode.INVALID_ARGUMENT, "speculative.online_training"):
                c.create_job(str(model), backend=common_pb2.BACKEND_SIM)
            job = c.create_job(str(model), backend=common_pb2.BACKEND_SIM, speculative=NO_TRAINING)
            assert job.backend == common_pb2.BACKEND_SIM
            # Allowed on the daemon, still never a job's default.
            assert c.create_job(str(model)).backend == common_pb2.BACKEND_TORCH
    finally:
        d.stop()


# ---- the worker process over its pipe ----------------------------------------------------------


class SimProcess:
    """A real simulated rollout worker process (spawn) on a pipe."""

    def __init__(self, config: str) -> None:
        from tltd_workers.rollout.sim_worker import main

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=main, args=(child, 1, 0.2, config), daemon=True)
        self.proc.start()
        child.close()
        self.pending: list = []

    def recv(self, kind, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.pending and self.conn.poll(0.1):
                got = self.conn.recv()
                self.pending.extend(got if isinstance(got, list) else [got])
            while self.pending:
                m = self.pending.pop(0)
                if isinstance(m, kind):
                    return m
        raise TimeoutError(f"no {kind.__name__} within {timeout}s")

    def close(self) -> None:
        self.proc.kill()
        self.proc.join(10)


@pytest.fixture
def model(tmp_path) -> Path:
    return write_model_dir(tmp_path / "model", vocab=50)


def _load(w: SimProcess, model: Path, max_batch: int = 8) -> None:
    w.recv(Ready)
    w.conn.send(LoadModel("job", str(model), 3, EngineSpec(max_batch=max_batch, max_seq_len=64)))
    assert w.recv(Ready).policy_version == 3


def _work(seq: int, rid: str, n: int, max_new: int, seed: int | None = 1) -> AddWork:
    params = SamplingParams(n=n, max_new_tokens=max_new, stop_token_ids=(STOP,), seed=seed)
    return AddWork(seq, rid, 0, tuple(range(n)), (1, 2, 3), params)


def test_worker_draws_marked_seeded_samples(model) -> None:
    w = SimProcess("median=6,tail=4")
    try:
        _load(w, model)
        runs = []
        for rid in ("a", "b"):
            w.conn.send(_work(1, rid, 16, 12))
            runs.append(
                sorted((w.recv(Finished).sample for _ in range(16)), key=lambda s: s.sample_index)
            )
    finally:
        w.close()
    a, b = runs
    assert [s.token_ids for s in a] == [s.token_ids for s in b]  # the same seed, the same draw
    reasons = {s.finish_reason for s in a}
    assert reasons == {FinishReason.STOP, FinishReason.LENGTH}  # median 6 under a cap of 12
    for s in a:
        assert s.simulated and s.policy_version == 3 and not s.partial
        assert 1 <= len(s.token_ids) <= 12 and len(s.logprobs) == len(s.token_ids)
        assert all(0 <= t < 50 for t in s.token_ids) and all(lp <= 0 for lp in s.logprobs)
        ends = s.token_ids[-1] == STOP
        assert ends == (s.finish_reason is FinishReason.STOP)
        assert STOP not in s.token_ids[:-1]
        if s.finish_reason is FinishReason.LENGTH:
            assert len(s.token_ids) == 12


def test_worker_sleeps_its_step_time_and_cancels(model) -> None:
    # 2 ms a step + 0.5 ms a row: 4 rows x 40 tokens cost 40 x 4 ms = 0.16 s, asleep.
    w = SimProcess("step_ms=2,row_us=500")
    try:
        _load(w, model)
        cpu0, t0 = _cpu_seconds(w.proc.pid), time.monotonic()
        w.conn.send(_work(1, "timed", 4, 40))
        got = [w.recv(Finished).sample for _ in range(4)]
        wall, cpu = time.monotonic() - t0, _cpu_seconds(w.proc.pid) - cpu0
        assert all(len(s.token_ids) == 40 and s.finish_reason is FinishReason.LENGTH for s in got)
        assert wall >= 0.16
        assert cpu < 0.5 * wall, (cpu, wall)  # slept, not spun
        beat = w.recv(Heartbeat)
        assert beat.stats["simulated"] is True
        assert beat.stats["sim_seconds"] == pytest.approx(0.16, rel=1e-6)
        # A long request cancelled halfway comes back CANCELLED with its tokens so far.
        w.conn.send(_work(2, "long", 2, 60, seed=None))
        time.sleep(0.1)
        w.conn.send(Cancel("long"))
        cut = [w.recv(Finished).sample for _ in range(2)]
        assert all(s.finish_reason is FinishReason.CANCELLED and s.simulated for s in cut)
        assert all(0 < len(s.token_ids) < 60 for s in cut)
    finally:
        w.close()


def test_worker_of_a_node_that_does_not_allow_it_loads_nothing(model) -> None:
    from tltd.contract.rollout_messages import LoadFailed

    w = SimProcess("")
    try:
        w.recv(Ready)
        w.conn.send(LoadModel("job", str(model), 1, EngineSpec()))
        assert "sim_engine is not set" in w.recv(LoadFailed).message
    finally:
        w.close()


# ---- the daemon: store, API, metrics -----------------------------------------------------------


@pytest.fixture
def sim_daemon(store, tmp_path):
    settings = make_settings(
        tmp_path,
        cpu_slots=1,
        worker_max_batch=16,
        worker_max_seq_len=256,
        worker_heartbeat_seconds=0.2,
        device_refresh_seconds=3600.0,
        sim_engine="median=5,tail=3,step_ms=1",
    )
    d = InProcessDaemon(settings, store).start()
    try:
        yield d
    finally:
        d.kill()


def test_daemon_marks_simulated_samples_and_keeps_real_jobs_real(sim_daemon, tmp_path) -> None:
    model = make_checkpoint(tmp_path / "policy")
    before = METRICS.simulated_samples.labels("sim")._value.get()
    with sim_daemon.client() as c:
        c.create_job(str(model), job_id="sim", backend=common_pb2.BACKEND_SIM,
                     speculative=NO_TRAINING)  # fmt: skip
        c.create_job(str(model), job_id="real", speculative=NO_TRAINING)
        params = sampling(n=4, max_new_tokens=10, seed=5, stop_token_ids=[STOP])
        sim = list(c.generate("sim", [[1, 2, 3], [4, 5]], sampling=params, request_id="r-sim"))
        real = list(c.generate("real", [[1, 2, 3]], sampling=params, request_id="r-real"))
        stored = c.get_request("r-sim", include_samples=True).samples
        stored_real = c.get_request("r-real", include_samples=True).samples
    assert len(sim) == 8 and all(s.simulated for s in sim)
    assert all(s.finish_reason in (rollout_pb2.FINISH_REASON_STOP, rollout_pb2.FINISH_REASON_LENGTH)
               for s in sim)  # fmt: skip
    assert len(stored) == 8 and all(s.simulated for s in stored)
    assert len(real) == 4 and not any(s.simulated for s in real)
    assert not any(s.simulated for s in stored_real)
    rows = sim_daemon.store.samples.list("r-sim")
    assert len(rows) == 8 and all(s.simulated for s in rows)
    assert not any(s.simulated for s in sim_daemon.store.samples.list("r-real"))
    assert METRICS.simulated_samples.labels("sim")._value.get() - before == 8
    assert METRICS.simulated_samples.labels("real")._value.get() == 0


# ---- the store's column ------------------------------------------------------------------------


def test_simulated_column_migrates_up_and_down(db_url: str) -> None:
    from sqlalchemy import inspect

    from tltd.store import migrate
    from tltd.store.database import make_engine

    def columns() -> set[str]:
        engine = make_engine(db_url)
        try:
            return {c["name"] for c in inspect(engine).get_columns("samples")}
        finally:
            engine.dispose()

    migrate.upgrade(db_url)
    assert "simulated" in columns()
    migrate.check(db_url)  # the model and the migrated schema agree
    migrate.downgrade(db_url, "0014_step_bounds")
    assert "simulated" not in columns()
    migrate.upgrade(db_url)
    migrate.check(db_url)
