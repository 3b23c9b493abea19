"""A rollout worker's side of a policy broadcast: it joins the trainer's torch.distributed
group (gloo) as one more receiving rank, next to the daemon, and holds the new weights in
memory until the version is recorded. The LoadPolicy of that version then takes them from
memory instead of reading the daemon's file, and the worker switches at once.

Every rank finds the group under the keys `tltd.contract.broadcast.group_prefix` names in the
daemon's TCP store.

The receive runs on a thread of its own beside the engine's steps (a broadcast is one
collective: every rank must take part until the last tensor, whatever the engine does). Only
the newest complete broadcast is kept; one that fails is dropped, and the worker then reads
the version from the file like any other.
"""

from __future__ import annotations

import datetime
import threading
from typing import TYPE_CHECKING

from tltd.contract.broadcast import group_prefix, received_tensors
from tltd.contract.rollout_messages import JoinBroadcast

if TYPE_CHECKING:
    from torch import Tensor


def receiving_device(backend: str, engine_device: str) -> str:
    """Where a worker receives a broadcast: NCCL into its engine's CUDA device (the tensors
    then load without a host copy), gloo into host memory."""
    if backend != "nccl":
        return "cpu"
    if not engine_device.startswith("cuda"):
        raise ValueError(
            f"an nccl broadcast needs a CUDA device, this worker runs on {engine_device}"
        )
    return engine_device


class BroadcastReceiver:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._received: dict[str, dict[str, Tensor]] = {}  # version path -> tensors
        self._receiving: dict[str, threading.Event] = {}  # version path -> set when ended
        self._errors: list[str] = []
        # Bumped by every take and drop: a broadcast that ends after a load of another path
        # (or another job) began is superseded, and its tensors are not kept.
        self._loads = 0

    def join(self, m: JoinBroadcast, engine_device: str = "cpu") -> None:
        ended = threading.Event()
        with self._lock:
            self._receiving[m.path] = ended
            loads = self._loads
        threading.Thread(
            target=self._receive,
            args=(m, engine_device, ended, loads),
            name=f"broadcast-rank{m.rank}",
            daemon=True,
        ).start()

    def take(self, path: str, wait: float = 10.0) -> dict[str, Tensor] | None:
        """The tensors of the broadcast that became `path`, once (None: read the file); any
        other received weights are dropped (a version loaded by another path supersedes them).
        A version is recorded once the daemon holds every tensor; this rank may still be
        taking in the last one: wait for it, up to `wait` seconds."""
        with self._lock:
            ended = self._receiving.get(path)
        if ended is not None:
            ended.wait(wait)
        with self._lock:
            got = self._received.pop(path, None)
            self._received.clear()
            self._loads += 1
        return got

    def drop(self) -> None:
        """Forget received weights (the worker switches to another job)."""
        with self._lock:
            self._received.clear()
            self._loads += 1

    def errors(self) -> list[str]:
        """Broadcasts that failed since the last call (for the daemon's log)."""
        with self._lock:
            out, self._errors = self._errors, []
        return out

    def _receive(
        self, m: JoinBroadcast, engine_device: str, ended: threading.Event, loads: int
    ) -> None:
        try:
            self._take_in(m, engine_device, loads)
        finally:
            with self._lock:
                if self._receiving.get(m.path) is ended:
                    del self._receiving[m.path]
            ended.set()

    def _take_in(self, m: JoinBroadcast, engine_device: str, loads: int) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=m.timeout_seconds)
        try:
            device = receiving_device(m.backend, engine_device)
            store = dist.TCPStore(m.address, m.port, m.world_size, False, timeout=timeout)
            prefix = group_prefix(m.group_name, m.backend)
            received = received_tensors(
                store, prefix, m.rank, m.world_size, m.tensors, timeout, m.backend, device
            )
            tensors = dict(received)
            if device != "cpu":  # NCCL ends on its stream: done before the engine reads them
                import torch

                torch.cuda.synchronize(device)
            del store
        except Exception as exc:  # noqa: BLE001 - a thread of its own: report, read the file
            with self._lock:
                self._errors.append(f"policy broadcast to {m.path} failed: {exc}")
            return
        with self._lock:
            if self._loads == loads:  # no load began meanwhile: keep it (the newest only)
                self._received = {m.path: tensors}
