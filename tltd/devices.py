"""Device inventory: GPUs through NVML (behind a Protocol), CPU slots where there is no NVML."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import pynvml

from tltd.domain import Device, DeviceKind, DeviceProcess, DeviceState

log = logging.getLogger(__name__)

MIB = 1 << 20


class Nvml(Protocol):
    """The slice of NVML the inventory needs (a fake implements it in tests).

    Methods raise `pynvml.NVMLError` (or a subclass) on failure, like pynvml itself.
    """

    def init(self) -> None: ...
    def shutdown(self) -> None: ...
    def device_count(self) -> int: ...
    def uuid(self, index: int) -> str: ...
    def name(self, index: int) -> str: ...
    def memory(self, index: int) -> tuple[int, int]:
        """(total bytes, used bytes)."""
        ...

    def utilization(self, index: int) -> float:
        """GPU busy fraction over the last sample period, 0..1."""
        ...

    def processes(self, index: int) -> list[tuple[int, int]]:
        """Running compute processes as (pid, used memory bytes)."""
        ...


class PynvmlBackend:
    """Nvml over the real `pynvml` (nvidia-ml-py)."""

    def init(self) -> None:
        pynvml.nvmlInit()

    def shutdown(self) -> None:
        pynvml.nvmlShutdown()

    def device_count(self) -> int:
        return int(pynvml.nvmlDeviceGetCount())

    def _handle(self, index: int) -> object:
        return pynvml.nvmlDeviceGetHandleByIndex(index)

    def uuid(self, index: int) -> str:
        return str(pynvml.nvmlDeviceGetUUID(self._handle(index)))

    def name(self, index: int) -> str:
        return str(pynvml.nvmlDeviceGetName(self._handle(index)))

    def memory(self, index: int) -> tuple[int, int]:
        info = pynvml.nvmlDeviceGetMemoryInfo(self._handle(index))
        return int(info.total), int(info.used)

    def utilization(self, index: int) -> float:
        return float(pynvml.nvmlDeviceGetUtilizationRates(self._handle(index)).gpu) / 100.0

    def processes(self, index: int) -> list[tuple[int, int]]:
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self._handle(index))
        # usedGpuMemory is None where the driver cannot attribute memory (e.g. some MIG/WDDM).
        return [(int(p.pid), int(p.usedGpuMemory or 0)) for p in procs]


def discover(nvml: Nvml | None, cpu_slots: int, our_pids: Collection[int]) -> list[Device]:
    """The devices of this node: one per GPU when NVML works, else `cpu_slots` CPU slots.

    `nvml=None` means "do not look for GPUs". A GPU running a compute process whose pid is
    not in `our_pids` is marked foreign (not ours to schedule on).
    """
    if nvml is None:
        log.info("inventory: NVML disabled, using %d CPU slot(s)", cpu_slots)
        return cpu_devices(cpu_slots)
    try:
        nvml.init()
    except pynvml.NVMLError as exc:
        log.info("inventory: NVML unavailable (%s), using %d CPU slot(s)", exc, cpu_slots)
        return cpu_devices(cpu_slots)
    try:
        count = nvml.device_count()
        devices = [_gpu(nvml, i, our_pids) for i in range(count)]
    except pynvml.NVMLError as exc:
        log.warning("inventory: NVML failed (%s), using %d CPU slot(s)", exc, cpu_slots)
        return cpu_devices(cpu_slots)
    finally:
        _shutdown(nvml)
    if not devices:
        log.info("inventory: NVML reports no GPU, using %d CPU slot(s)", cpu_slots)
        return cpu_devices(cpu_slots)
    log.info("inventory: NVML found %d GPU(s)", len(devices))
    return devices


def _shutdown(nvml: Nvml) -> None:
    try:
        nvml.shutdown()
    except pynvml.NVMLError as exc:  # nothing to do about it; the next refresh inits again
        log.debug("inventory: NVML shutdown failed: %s", exc)


def _gpu(nvml: Nvml, index: int, our_pids: Collection[int]) -> Device:
    device_id = f"cuda:{index}"
    try:
        total, used = nvml.memory(index)
        procs = tuple(
            DeviceProcess(pid=pid, used_memory_bytes=mem, ours=pid in our_pids)
            for pid, mem in nvml.processes(index)
        )
        device = Device(
            device_id=device_id,
            kind=DeviceKind.CUDA,
            index=index,
            uuid=nvml.uuid(index),
            name=nvml.name(index),
            memory_total_bytes=total,
            memory_used_bytes=used,
            utilization=min(max(nvml.utilization(index), 0.0), 1.0),
            processes=procs,
        )
    except pynvml.NVMLError as exc:
        # One broken GPU (fallen off the bus, ...) must not hide the others.
        log.warning("inventory: %s unreadable: %s", device_id, exc)
        return Device(
            device_id=device_id,
            kind=DeviceKind.CUDA,
            index=index,
            state=DeviceState.UNAVAILABLE,
            state_reason=f"NVML error: {exc}",
        )
    foreign = [p for p in procs if not p.ours]
    if foreign:
        # NB: in a container without the host pid namespace NVML reports host pids, so our
        # own workers would look foreign; run with --pid=host (or equivalent) on such nodes.
        listed = ", ".join(f"pid {p.pid} ({p.used_memory_bytes // MIB} MiB)" for p in foreign)
        return replace(device, foreign=True, state_reason=f"foreign process: {listed}")
    return device


def cpu_devices(slots: int, meminfo: Path = Path("/proc/meminfo")) -> list[Device]:
    """`slots` CPU devices "cpu:0".., each owning an equal share of host memory."""
    total, used = host_memory(meminfo)
    slots = max(slots, 0)
    share = max(slots, 1)
    util = _cpu_utilization()
    return [
        Device(
            device_id=f"cpu:{i}",
            kind=DeviceKind.CPU,
            index=i,
            name=f"cpu slot {i}",
            memory_total_bytes=total // share,
            memory_used_bytes=used // share,
            utilization=util,
        )
        for i in range(slots)
    ]


def host_memory(meminfo: Path = Path("/proc/meminfo")) -> tuple[int, int]:
    """(total, used) bytes of host memory; used = MemTotal - MemAvailable."""
    try:
        fields = {}
        for line in meminfo.read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                fields[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        total = fields["MemTotal"]
        return total, total - fields.get("MemAvailable", fields.get("MemFree", 0))
    except (OSError, KeyError, ValueError) as exc:
        log.debug("inventory: cannot read %s (%s), using sysconf", meminfo, exc)
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total = page * os.sysconf("SC_PHYS_PAGES")
        avail = page * os.sysconf("SC_AVPHYS_PAGES")
        return total, total - avail
    except (OSError, ValueError):
        return 0, 0


def _cpu_utilization() -> float:
    """Busy fraction of the host's cores from the 1-minute load average (no psutil needed)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 0.0
    return min(load / (os.cpu_count() or 1), 1.0)
