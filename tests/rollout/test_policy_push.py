"""Pushed policy weights through a real daemon and real workers: the workers run the pushed
weights, and a push whose trainer was killed midway leaves the old version serving."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from tests.api.support import sampling
from tests.rollout.support import direct_outputs, wait_until
from tltd.domain import SamplingParams
from tltd_clients.errors import NotFoundError

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
GREEDY = dict(n=2, temperature=0.0, max_new_tokens=16)
ROOT = Path(__file__).resolve().parents[2]


def _by_key(samples) -> dict:
    return {(s.prompt_index, s.sample_index): tuple(s.token_ids) for s in samples}


def test_workers_run_the_pushed_weights(sqlite_daemon, ckpt, ckpt2):
    d = sqlite_daemon
    sd = load_file(str(ckpt2 / "model.safetensors"))
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        before = list(c.generate("job", PROMPTS, sampling=sampling(**GREEDY)))
        got = c.push_policy("job", sd, chunk_bytes=4096)
        assert got.policy.version == 1
        after = list(c.generate("job", PROMPTS, sampling=sampling(**GREEDY)))
        stored = load_file(str(Path(got.policy.path) / "model.safetensors"))
        # Read from the daemon's file: only a broadcast leaves weights in the workers' memory.
        assert {h.policy_source for h in d.supervisor.handles.values()} == {""}
    assert {s.policy_version for s in before} == {0}
    assert {s.policy_version for s in after} == {1}
    assert stored.keys() == sd.keys() and all(stored[k].equal(sd[k]) for k in sd)
    # The tokens prove which weights the workers ran, not just the label.
    assert _by_key(before) == direct_outputs(ckpt, PROMPTS, SamplingParams(**GREEDY))
    assert _by_key(after) == direct_outputs(ckpt2, PROMPTS, SamplingParams(**GREEDY))


_SLOW_PUSHER = """
import sys, time
from safetensors.torch import load_file
from tltd_clients.client import TltClient

sd = load_file(sys.argv[2])
with TltClient(sys.argv[1]) as c:
    c.push_policy("job", sd, update_id="doomed", chunk_bytes=512,
                  progress=lambda p: time.sleep(0.05))
"""


def test_a_push_killed_midway_leaves_no_version_and_the_old_one_serving(sqlite_daemon, ckpt, ckpt2):
    d = sqlite_daemon
    with d.client() as c:
        c.create_job(str(ckpt), job_id="job")
        d.wait_workers_ready(2)
        trainer = subprocess.Popen(
            [sys.executable, "-c", _SLOW_PUSHER, d.target, str(ckpt2 / "model.safetensors")],
            cwd=ROOT,
            env=os.environ | {"PYTHONPATH": str(ROOT)},
        )
        try:

            def held() -> int:
                try:
                    return c.get_push("job", "doomed").bytes_received
                except NotFoundError:
                    return 0

            wait_until(lambda: held() > 0, timeout=60, what="push under way")
        finally:
            os.kill(trainer.pid, signal.SIGKILL)
            trainer.wait()
        status = c.get_push("job", "doomed")
        assert 0 < status.bytes_received < status.bytes_total and status.version == 0
        assert c.get_job("job").policy_version == 0
        samples = list(c.generate("job", PROMPTS, sampling=sampling(**GREEDY)))
        assert {s.policy_version for s in samples} == {0}
        assert _by_key(samples) == direct_outputs(ckpt, PROMPTS, SamplingParams(**GREEDY))
        # Abandoned: dropped with its files once idle for push_idle_seconds.
        pushes = d.daemon.services.pushes
        staged = pushes.staging_root / "job" / "doomed"
        assert staged.is_dir()
        wait_until(lambda: not pushes._pushes["job", "doomed"].attached, what="stream gone")
        assert pushes.collect(time.monotonic() + pushes.idle_seconds + 1) == ["doomed"]
        assert not staged.exists() and not (pushes.versions_root / "job").exists()
        try:
            c.get_push("job", "doomed")
            raise AssertionError("the dropped push is still known")
        except NotFoundError:
            pass
        assert [v.version for v in d.store.policies.list("job")] == [0]


_BROADCASTER = """
import json, sys
from safetensors.torch import load_file
from tltd_clients.client import TltClient

sd = load_file(sys.argv[2])
timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 120
with TltClient(sys.argv[1]) as c:
    got = c.broadcast_policy("job", sd, update_id="by-gloo", timeout=timeout)
print(json.dumps({"version": got.policy.version, "path": got.policy.path}))
"""


def _run_trainer(
    d, c, ckpt: Path, script: str, new: Path, *args: str, before=lambda: None
) -> subprocess.CompletedProcess:
    """Create the job, wait until both workers hold it, call `before`, then run `script` (a
    trainer process sending `new`'s weights) to its end."""
    c.create_job(str(ckpt), job_id="job")
    d.wait_workers_ready(2)
    handles = d.supervisor.handles.values()
    wait_until(lambda: all(h.job_id == "job" for h in handles), what="the job preloaded")
    before()
    return subprocess.run(
        [sys.executable, "-c", script, d.target, str(new / "model.safetensors"), *args],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_gloo_broadcast_from_the_trainer_becomes_the_version_the_workers_run(
    sqlite_daemon, ckpt, ckpt2
):
    """The workers holding the job join the trainer's group (ranks 2 and 3 beside the daemon)
    and switch to the new version from the tensors they received, not from the file."""
    d = sqlite_daemon
    handles = d.supervisor.handles.values()
    with d.client() as c:
        out = _run_trainer(d, c, ckpt, _BROADCASTER, ckpt2)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["version"] == 1
        assert c.get_policy("job", 1).source == "push"
        samples = list(c.generate("job", PROMPTS, sampling=sampling(**GREEDY)))
        assert {(h.policy_version, h.policy_source) for h in handles} == {(1, "broadcast")}
    sd = load_file(str(ckpt2 / "model.safetensors"))
    stored = load_file(str(Path(got["path"]) / "model.safetensors"))
    assert stored.keys() == sd.keys() and all(stored[k].equal(sd[k]) for k in sd)
    assert {s.policy_version for s in samples} == {1}
    assert _by_key(samples) == direct_outputs(ckpt2, PROMPTS, SamplingParams(**GREEDY))


_BROADCASTER_DYING = """
import datetime, os, sys
import torch.distributed as dist
from safetensors.torch import load_file
from tltd.v1 import policy_pb2
from tltd_clients.client import TltClient
from tltd_clients.push import Weights, header_pb

sd = load_file(sys.argv[2])
with TltClient(sys.argv[1]) as c:
    header = header_pb("job", "dies", Weights(sd), "", None)
    req = policy_pb2.OpenBroadcastRequest(header=header, timeout_seconds=10)
    g = c.call(c.policy.OpenBroadcast, req)
    wait = datetime.timedelta(seconds=10)
    store = dist.TCPStore(g.address, g.port, g.world_size, False, timeout=wait)
    pg = dist.ProcessGroupGloo(dist.PrefixStore(g.prefix, store), g.rank, g.world_size, wait)
    opts = dist.BroadcastOptions()
    opts.rootRank = g.rank
    first = header.tensors[0].name
    pg.broadcast([sd[first].contiguous()], opts).wait()
    print(g.world_size, flush=True)
    os._exit(1)  # the trainer dies after its first tensor
"""


def test_a_broadcast_whose_trainer_dies_leaves_the_workers_on_the_old_version(
    sqlite_daemon, ckpt, ckpt2, caplog
):
    d = sqlite_daemon
    handles = d.supervisor.handles.values()
    with d.client() as c:
        out = _run_trainer(d, c, ckpt, _BROADCASTER_DYING, ckpt2)
        assert out.returncode == 1 and out.stdout.split() == ["4"], out.stderr
        # Every receiving rank (the daemon and both workers) sees the group fail.
        failed = "policy broadcast to"
        wait_until(
            lambda: sum(failed in getattr(r, "error", "") for r in caplog.records) == 2,
            timeout=60,
            what="both workers report the failed broadcast",
        )
        status = c.get_push("job", "dies")
        assert 0 < status.bytes_received < status.bytes_total and status.version == 0
        samples = list(c.generate("job", PROMPTS, sampling=sampling(**GREEDY)))
        assert {s.policy_version for s in samples} == {0}
        assert _by_key(samples) == direct_outputs(ckpt, PROMPTS, SamplingParams(**GREEDY))
        # The workers still join the next broadcast, and run what it carried.
        sd = load_file(str(ckpt2 / "model.safetensors"))
        assert c.broadcast_policy("job", sd, update_id="again", timeout=120).policy.version == 1
        after = list(c.generate("job", PROMPTS, sampling=sampling(**GREEDY)))
        assert {(h.policy_version, h.policy_source) for h in handles} == {(1, "broadcast")}
    assert _by_key(after) == direct_outputs(ckpt2, PROMPTS, SamplingParams(**GREEDY))


def test_a_broadcast_a_worker_cannot_join_falls_back_to_a_grpc_push(sqlite_daemon, ckpt, ckpt2):
    """A worker that does not take part (stopped here; dead or stalled in the field) fails the
    broadcast after its timeout; the client then pushes by gRPC, and the workers run that."""
    d = sqlite_daemon
    stopped: list[int] = []

    def stop_one_worker() -> None:
        stopped.append(next(iter(d.supervisor.handles.values())).proc.pid)
        os.kill(stopped[0], signal.SIGSTOP)

    with d.client() as c:
        try:
            out = _run_trainer(d, c, ckpt, _BROADCASTER, ckpt2, "5", before=stop_one_worker)
        finally:
            try:
                os.kill(stopped[0], signal.SIGCONT)
            except ProcessLookupError:
                pass  # killed as unresponsive meanwhile: a new worker took its place
        assert out.returncode == 0, out.stderr
        assert "policy broadcast by-gloo failed" in out.stderr and "by gRPC instead" in out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["version"] == 1 and not got["path"].endswith("by-gloo")
        samples = list(c.generate("job", PROMPTS, sampling=sampling(**GREEDY)))
    assert {s.policy_version for s in samples} == {1}
    assert _by_key(samples) == direct_outputs(ckpt2, PROMPTS, SamplingParams(**GREEDY))


def test_an_sglang_worker_joins_the_broadcast_through_sglangs_distributed_update(
    sqlite_store, ckpt, ckpt2, tmp_path, monkeypatch
):
    """A daemon on a GPU (NVML faked) whose worker runs the SGLang backend over the fake
    engine: the engine joins the trainer's gloo group through SGLang's
    init_weights_update_group / update_weights_from_distributed, receives every tensor, and
    the recorded version only names the weights it holds (no file read)."""
    import hashlib

    import torch

    from tests.api.support import make_settings
    from tests.rollout import fake_sglang
    from tests.rollout.support import InProcessDaemon
    from tests.store.test_devices import FakeNvml, _gpu
    from tltd.domain import Backend, Job

    log = tmp_path / "engine.jsonl"
    monkeypatch.setenv(fake_sglang.LOG_ENV, str(log))  # the worker process inherits it
    settings = make_settings(
        tmp_path, worker_heartbeat_seconds=0.2, device_refresh_seconds=3600.0,
        drafter_training=False, default_backend="sglang",
        sglang_engine_factory="tests.rollout.fake_sglang:factory",
    )  # fmt: skip
    d = InProcessDaemon(settings, sqlite_store, nvml=FakeNvml([_gpu(0)])).start()
    try:
        with d.client() as c:
            # As from a GPU node sharing the database: this host has no sglang to create it.
            d.store.jobs.create(Job("job", str(ckpt), backend=Backend.SGLANG))
            d.wait_workers_ready(1)
            handles = d.supervisor.handles.values()
            wait_until(lambda: all(h.job_id == "job" for h in handles), what="the job loaded")
            out = subprocess.run(
                [sys.executable, "-c", _BROADCASTER, d.target, str(ckpt2 / "model.safetensors")],
                cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)},
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
            assert "by gRPC instead" not in out.stderr
            assert json.loads(out.stdout.strip().splitlines()[-1])["version"] == 1
            samples = list(c.generate("job", PROMPTS, sampling=sampling(**GREEDY)))
            assert {(h.policy_version, h.policy_source) for h in handles} == {(1, "broadcast")}
    finally:
        d.kill()
    assert {s.policy_version for s in samples} == {1}
    events = [json.loads(line) for line in log.read_text().splitlines()]
    (received,) = [e for e in events if e["event"] == "received"]
    sd = load_file(str(ckpt2 / "model.safetensors"))
    expected = {
        n: hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for n, t in sd.items()
    }
    assert received["group"] == "tltd/job/by-gloo" and received["checksums"] == expected
    kinds = [e["event"] for e in events]
    after = kinds[kinds.index("received") :]
    assert "update_weights" in after and {"event": "weight_version", "version": "1"} in events
    assert not [e for e in events if e["event"] == "update_weights" and e["kind"] == "disk"]


_BROADCASTER_NCCL = _BROADCASTER.replace(
    'update_id="by-gloo", timeout=timeout',
    'update_id="two", timeout=timeout, backend="nccl", device="cpu"',
)


def test_an_nccl_broadcast_reaches_the_workers_in_their_own_group(
    sqlite_daemon, ckpt, ckpt2, monkeypatch
):
    """The nccl layout with gloo standing in for NCCL (no GPU here): the daemon receives in
    its gloo group of two and writes the version's file; the workers receive in a group of
    their own (the trainer and ranks 1..), and switch from memory once it is recorded."""
    from tltd.services import broadcast

    monkeypatch.setattr(broadcast, "nccl_available", lambda: True)
    monkeypatch.setitem(broadcast.WORKER_GROUP_BACKEND, "nccl", "gloo")
    opened: list = []
    real_open = broadcast.BroadcastService.open

    def open_(self, *args):
        opened.append(real_open(self, *args))
        return opened[-1]

    monkeypatch.setattr(broadcast.BroadcastService, "open", open_)
    d = sqlite_daemon
    handles = d.supervisor.handles.values()
    with d.client() as c:
        out = _run_trainer(d, c, ckpt, _BROADCASTER_NCCL, ckpt2)
        assert out.returncode == 0, out.stderr
        assert "by gRPC instead" not in out.stderr
        got = json.loads(out.stdout.strip().splitlines()[-1])
        samples = list(c.generate("job", PROMPTS, sampling=sampling(**GREEDY)))
        assert {(h.policy_version, h.policy_source) for h in handles} == {(1, "broadcast")}
    (o,) = opened
    assert o.world_size == 2  # the trainer and the daemon
    assert o.workers == broadcast.WorkerGroupKeys(
        "tltd/job/two/workers/tltd/job/two/workers//cpu/", 3, "gloo"
    )
    sd = load_file(str(ckpt2 / "model.safetensors"))
    stored = load_file(str(Path(got["path"]) / "model.safetensors"))  # the daemon's file
    assert got["version"] == 1 and stored.keys() == sd.keys()
    assert all(stored[k].equal(sd[k]) for k in sd)
    assert {s.policy_version for s in samples} == {1}
    assert _by_key(samples) == direct_outputs(ckpt2, PROMPTS, SamplingParams(**GREEDY))
