"""Device inventory: the real NVML-absent path here, and the GPU path over a fake NVML."""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path

import pynvml
import pytest

from tltd.devices import Nvml, PynvmlBackend, cpu_devices, discover, host_memory
from tltd.domain import DeviceKind, DeviceProcess, DeviceState

GIB = 1 << 30


class FakeNvml:
    """An Nvml at the hardware boundary: GPUs described by dicts, failures injectable."""

    def __init__(self, gpus: list[dict], *, init_error: Exception | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.initialized = 0

    def init(self) -> None:
        if self.init_error:
            raise self.init_error
        self.initialized += 1

    def shutdown(self) -> None:
        self.initialized -= 1

    def device_count(self) -> int:
        return len(self.gpus)

    def _gpu(self, index: int) -> dict:
        gpu = self.gpus[index]
        if "error" in gpu:
            raise gpu["error"]
        return gpu

    def uuid(self, index: int) -> str:
        return self._gpu(index)["uuid"]

    def name(self, index: int) -> str:
        return self._gpu(index)["name"]

    def memory(self, index: int) -> tuple[int, int]:
        g = self._gpu(index)
        return g["total"], g["used"]

    def utilization(self, index: int) -> float:
        return self._gpu(index)["util"]

    def processes(self, index: int) -> list[tuple[int, int]]:
        return self._gpu(index).get("procs", [])


def _gpu(i: int, **kw) -> dict:
    return {
        "uuid": f"GPU-{i}",
        "name": "NVIDIA H100",
        "total": 80 * GIB,
        "used": GIB,
        "util": 0.25,
        **kw,
    }


def _protocol_methods() -> dict[str, inspect.Signature]:
    return {
        name: inspect.signature(member)
        for name, member in vars(Nvml).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }


@pytest.mark.parametrize("impl", [FakeNvml, PynvmlBackend])
def test_implements_the_protocol(impl: type) -> None:
    """The fake and the real backend have every method of `Nvml` with its exact signature
    (names, kinds, annotations): no type checker runs in CI, so this is the check."""
    methods = _protocol_methods()
    assert {"init", "device_count", "memory", "processes"} <= methods.keys()
    for name, signature in methods.items():
        assert inspect.isfunction(getattr(impl, name, None)), f"{impl.__name__}.{name} missing"
        assert inspect.signature(getattr(impl, name)) == signature, f"{impl.__name__}.{name}"


def test_real_pynvml_absent_falls_back_to_cpu_slots(caplog) -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML; the fallback is tested with FakeNvml")
    with caplog.at_level(logging.INFO, logger="tltd.devices"):
        devices = discover(PynvmlBackend(), cpu_slots=3, our_pids={os.getpid()})
    assert [d.device_id for d in devices] == ["cpu:0", "cpu:1", "cpu:2"]
    assert [d.name for d in devices] == ["cpu slot 0", "cpu slot 1", "cpu slot 2"]
    assert all(d.kind == DeviceKind.CPU and d.schedulable for d in devices)
    total, _ = host_memory()
    assert devices[0].memory_total_bytes == total // 3 > 0
    assert "NVML unavailable" in caplog.text and "3 CPU slot(s)" in caplog.text


def test_gpu_path_memory_utilization_and_ownership(caplog) -> None:
    ours, theirs = os.getpid(), 999_999
    nvml = FakeNvml(
        [
            _gpu(0, procs=[(ours, 3 * GIB)]),
            _gpu(1, used=9 * GIB, util=0.9, procs=[(ours, GIB), (theirs, 8 * GIB)]),
            _gpu(2, util=1.7),  # NVML glitches are clamped
        ]
    )
    with caplog.at_level(logging.INFO, logger="tltd.devices"):
        d0, d1, d2 = discover(nvml, cpu_slots=4, our_pids={ours})
    assert nvml.initialized == 0  # shut down again
    assert "NVML found 3 GPU(s)" in caplog.text
    assert (d0.device_id, d0.kind, d0.index, d0.uuid, d0.name) == (
        "cuda:0",
        DeviceKind.CUDA,
        0,
        "GPU-0",
        "NVIDIA H100",
    )
    assert (d0.memory_total_bytes, d0.memory_used_bytes, d0.utilization) == (80 * GIB, GIB, 0.25)
    assert d0.processes == (DeviceProcess(pid=ours, used_memory_bytes=3 * GIB, ours=True),)
    assert not d0.foreign and d0.schedulable and d0.state_reason == ""
    assert d1.foreign and not d1.schedulable
    assert d1.state_reason == f"foreign process: pid {theirs} (8192 MiB)"
    assert (d1.memory_used_bytes, d1.utilization) == (9 * GIB, 0.9)
    assert [p.ours for p in d1.processes] == [True, False]
    assert d2.utilization == 1.0


def test_one_broken_gpu_does_not_hide_the_others() -> None:
    nvml = FakeNvml([_gpu(0), {"error": pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)}])
    d0, d1 = discover(nvml, cpu_slots=1, our_pids=set())
    assert d0.state == DeviceState.IDLE
    assert d1.state == DeviceState.UNAVAILABLE and "NVML error" in d1.state_reason
    # A GPU the inventory cannot read gets no work (admission, the scheduler, admin stats).
    assert not d1.schedulable and not (d1.foreign or d1.cordoned or d1.draining)


def test_nvml_errors_and_no_gpus_fall_back_to_cpu() -> None:
    lib_missing = FakeNvml([], init_error=pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    assert [d.device_id for d in discover(lib_missing, 2, set())] == ["cpu:0", "cpu:1"]
    assert [d.device_id for d in discover(FakeNvml([]), 1, set())] == ["cpu:0"]
    assert [d.device_id for d in discover(None, 2, set())] == ["cpu:0", "cpu:1"]


def test_host_memory_parses_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemFree:  100 kB\nMemAvailable:    400 kB\n")
    assert host_memory(meminfo) == (1000 * 1024, 600 * 1024)
    (slot,) = cpu_devices(1, meminfo)
    assert (slot.memory_total_bytes, slot.memory_used_bytes) == (1000 * 1024, 600 * 1024)
    total, used = host_memory(tmp_path / "missing")  # falls back to sysconf
    assert total > 0 and 0 <= used <= total


def test_refresh_into_store_keeps_cordon_and_tracks_foreign(store) -> None:
    ours = os.getpid()
    nvml = FakeNvml([_gpu(0), _gpu(1)])
    store.devices.upsert(discover(nvml, 1, {ours}))
    store.devices.set_flags("cuda:0", cordoned=True, reason="operator")
    nvml.gpus[1]["procs"] = [(4321, GIB)]  # someone else's job lands on GPU 1
    d0, d1 = store.devices.upsert(discover(nvml, 1, {ours}))
    assert d0.cordoned and not d0.foreign
    assert d1.foreign and "pid 4321" in d1.state_reason and not d1.schedulable
    nvml.gpus[1]["procs"] = []  # ...and leaves
    d0, d1 = store.devices.upsert(discover(nvml, 1, {ours}))
    assert d0.cordoned and d1.schedulable and d1.state_reason == ""


@pytest.mark.gpu
def test_real_nvml_inventory() -> None:
    """On a GPU machine: the real backend reads every field, and our own CUDA context is ours."""
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no NVML here: {exc}")
    devices = discover(PynvmlBackend(), cpu_slots=1, our_pids={os.getpid()})
    assert devices and all(d.kind == DeviceKind.CUDA for d in devices)
    for d in devices:
        assert d.uuid.startswith(("GPU-", "MIG-")) and d.name
        assert d.memory_total_bytes > d.memory_used_bytes >= 0
        assert 0.0 <= d.utilization <= 1.0
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        return
    x = torch.ones(1 << 20, device="cuda:0")  # creates a CUDA context: a compute process
    torch.cuda.synchronize()
    d0 = discover(PynvmlBackend(), 1, {os.getpid()})[0]
    mine = [p for p in d0.processes if p.pid == os.getpid()]
    assert mine and mine[0].ours, d0.processes
    others = discover(PynvmlBackend(), 1, set())[0]
    assert others.foreign and str(os.getpid()) in others.state_reason
    del x
