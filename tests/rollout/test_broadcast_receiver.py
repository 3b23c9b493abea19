"""A worker's side of a policy broadcast, in one process: a real gloo group of two ranks, the
trainer's rank here and the receiver's on its own thread; which device it receives on, and
which workers the supervisor puts in which group with which ranks."""

from __future__ import annotations

import asyncio
import datetime
import queue
import types

import pytest
import torch
import torch.distributed as dist

from tltd.contract.broadcast import group_prefix
from tltd.contract.rollout_messages import JoinBroadcast
from tltd.domain import Backend, Device, DeviceKind
from tltd.supervisor.worker_process import Phase, WorkerHandle
from tltd_workers.rollout.broadcast import BroadcastReceiver, receiving_device

WAIT = datetime.timedelta(seconds=30)
TENSORS = {
    "a": torch.randn(3, 5).to(torch.bfloat16),
    "b": torch.arange(7, dtype=torch.float32),
}
CODES = {torch.bfloat16: "BF16", torch.float32: "F32"}


def _broadcast(receiver: BroadcastReceiver, path: str) -> None:
    """Open a group, have `receiver` join it as rank 1 and broadcast TENSORS from rank 0."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=WAIT)
    specs = tuple((n, CODES[t.dtype], tuple(t.shape)) for n, t in TENSORS.items())
    receiver.join(JoinBroadcast(path, "127.0.0.1", store.port, "g", 1, 2, specs, 30.0))
    group = dist.ProcessGroupGloo(dist.PrefixStore(group_prefix("g"), store), 0, 2, WAIT)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for t in TENSORS.values():
        group.broadcast([t.clone()], opts).wait()


def test_received_tensors_are_bit_identical_and_taken_once():
    r = BroadcastReceiver()
    _broadcast(r, "/v/1")
    got = r.take("/v/1")  # waits for the receiving thread to end
    assert got is not None and got.keys() == TENSORS.keys()
    for name, t in TENSORS.items():
        assert got[name].dtype == t.dtype
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8))
    assert r.take("/v/1") is None and r.errors() == []


def test_a_version_loaded_by_another_path_drops_what_was_received():
    r = BroadcastReceiver()
    _broadcast(r, "/v/1")
    assert r.take("/v/2") is None  # e.g. a newer version from the file
    assert r.take("/v/1") is None  # dropped: no stale copy of the model stays in memory


def test_a_broadcast_nobody_sends_fails_and_is_reported():
    r = BroadcastReceiver()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=WAIT)
    r.join(JoinBroadcast("/v/1", "127.0.0.1", store.port, "g", 1, 2, (("a", "F32", (2,)),), 1.0))
    assert r.take("/v/1", wait=30) is None
    errors = r.errors()
    assert len(errors) == 1 and errors[0].startswith("policy broadcast to /v/1 failed")


def test_a_worker_receives_an_nccl_broadcast_on_its_engines_device_and_gloo_on_the_host():
    assert receiving_device("nccl", "cuda:3") == "cuda:3"
    assert receiving_device("gloo", "cuda:3") == "cpu"
    assert receiving_device("gloo", "cpu") == "cpu"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        receiving_device("nccl", "cpu")


def test_an_nccl_join_on_a_cpu_worker_fails_and_is_reported_without_joining():
    r = BroadcastReceiver()
    r.join(JoinBroadcast("/v/1", "127.0.0.1", 1, "g", 1, 2, (), 1.0, "nccl"), "cpu")
    assert r.take("/v/1", wait=30) is None
    (error,) = r.errors()
    assert "needs a CUDA device" in error


def _handle(worker_id: str, kind: DeviceKind, backend: Backend = Backend.TORCH) -> WorkerHandle:
    index = int(worker_id[-1])
    device = Device(f"{kind.value}:{index}", kind, index)
    h = WorkerHandle(worker_id, device, backend, phase=Phase.READY, job_id="job")
    h.outbox = queue.Queue()
    return h


def test_the_supervisor_gives_ranks_by_group_and_only_cuda_workers_join_nccl():
    from tltd.supervisor.supervisor import Supervisor

    handles = [
        _handle("w0", DeviceKind.CUDA),
        _handle("w1", DeviceKind.CPU),
        _handle("w2", DeviceKind.CUDA, Backend.SGLANG),
    ]
    busy = {"w3": 2}  # an SGLang engine with samples running takes no part
    handles += [
        _handle("w3", DeviceKind.CUDA, Backend.SGLANG),
        _handle("w4", DeviceKind.CUDA, Backend.SGLANG),
    ]
    handles[4].broadcast_path = "/v/older"  # still in another broadcast: it would refuse
    stub = types.SimpleNamespace(
        handles={h.worker_id: h for h in handles},
        queue=types.SimpleNamespace(inflight=lambda worker_id: busy.get(worker_id, 0)),
    )

    def join(rank, world, ranks):
        return JoinBroadcast("/v", "h", 1, "g", rank, world, (), 1.0, ranks=ranks)

    def sent():
        return {h.worker_id: h.outbox.get_nowait() for h in handles if not h.outbox.empty()}

    # gloo: every worker of the job, after the trainer (0) and the daemon (1).
    assert asyncio.run(Supervisor._join_broadcast(stub, "job", join, 2, False)) == 3
    assert {w: (m.rank, m.world_size) for w, m in sent().items()} == {
        "w0": (2, 5),
        "w1": (3, 5),
        "w2": (4, 5),
    }
    assert handles[2].broadcast_path == "/v" and handles[3].broadcast_path == ""
    # nccl: the workers' own group, from rank 1, CUDA devices only; w2 is in the gloo one.
    handles[2].broadcast_path = ""
    assert asyncio.run(Supervisor._join_broadcast(stub, "job", join, 1, True)) == 2
    assert {w: (m.rank, m.world_size) for w, m in sent().items()} == {"w0": (1, 3), "w2": (2, 3)}


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"
)
def test_an_nccl_broadcast_lands_on_the_workers_gpu():
    """The real NCCL path: the trainer's rank on cuda:0, the worker's receiver on cuda:1."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=WAIT)
    specs = tuple((n, CODES[t.dtype], tuple(t.shape)) for n, t in TENSORS.items())
    r = BroadcastReceiver()
    r.join(JoinBroadcast("/v/1", "127.0.0.1", store.port, "g", 1, 2, specs, 60.0, "nccl"), "cuda:1")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = WAIT
    keys = dist.PrefixStore(group_prefix("g", "nccl"), store)
    group = dist.ProcessGroupNCCL(keys, 0, 2, opts)
    bopts = dist.BroadcastOptions()
    bopts.rootRank = 0
    for t in TENSORS.values():
        group.broadcast([t.to("cuda:0")], bopts).wait()
    torch.cuda.synchronize("cuda:0")
    got = r.take("/v/1", wait=60)
    assert got is not None and r.errors() == []
    for name, t in TENSORS.items():
        assert got[name].device == torch.device("cuda:1")
        assert torch.equal(got[name].cpu().view(torch.uint8), t.view(torch.uint8))
