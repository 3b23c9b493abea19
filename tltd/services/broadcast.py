"""Policy weights broadcast over torch.distributed (gloo): the daemon opens a group for a push,
receives every tensor from the trainer into the push's staging file, and the push is then
committed as any other (`tltd.services.push`): checked, recorded atomically, loaded by the
workers.

The daemon hosts the group's TCP store and joins as rank 1; the trainer joins as rank 0 and
broadcasts the header's tensors in order. The job's live workers join too, as ranks 2..
(`broadcast_to_workers`): a torch worker holds the tensors in memory and, once the version is
recorded, switches to it without reading the daemon's file (`tltd_workers.rollout.broadcast`);
an SGLang engine joins through SGLang's own distributed weight update, one rank per GPU
(`tltd_workers.rollout.sglang_worker`). A worker that starts or switches to the job later
reads the file. A broadcast is one collective: a rank that dies midway fails it for all (the
client then pushes by gRPC).

With backend nccl the daemon, a CPU process that cannot be an NCCL rank, keeps its gloo group
of two with the trainer, so the version still exists only once every tensor reached its file;
the job's workers on CUDA devices join a second group on the same store (the trainer as rank
0, the workers from 1), into which the trainer broadcasts every tensor again.

The group is a process group object of its own (not torch.distributed's default group): a
trainer that already trains in a default group keeps it, and the daemon can hold several
groups at once. One tensor at a time is in the daemon's memory (the largest bounds it).
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import TYPE_CHECKING

from tltd.contract.broadcast import group_prefix, received_tensors
from tltd.contract.rollout_messages import JoinBroadcast
from tltd.domain import OpenedBroadcast, PushHeader, WorkerGroupKeys
from tltd.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    from tltd.services.push import PushService
    from tltd.settings import Settings
    from tltd.supervisor import Supervisor

log = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = 300.0
_MAX_TIMEOUT = 3600.0
# The backend of the workers' own group per backend asked for ("": the daemon's group). A
# test stands gloo in for nccl here to run the two-group layout on a CPU.
WORKER_GROUP_BACKEND = {"": "", "gloo": "", "nccl": "nccl"}


def nccl_available() -> bool:
    """This host's torch can run NCCL groups (the workers' torch is the daemon's)."""
    import torch.distributed as dist

    return dist.is_nccl_available()


class BroadcastService:
    def __init__(
        self, pushes: PushService, settings: Settings, supervisor: Supervisor | None = None
    ) -> None:
        self.pushes = pushes
        self.host = settings.host
        self.supervisor = supervisor if settings.broadcast_to_workers else None

    def open(self, header: PushHeader, backend: str, timeout_seconds: float) -> OpenedBroadcast:
        """Open the groups for the push `header` (checked and staged as a push) on a TCP store
        of the daemon's: the daemon's (gloo) and, for nccl, the workers' own. The daemon waits
        up to the timeout for the trainer to join and for each tensor; a group that fails
        leaves the push incomplete (a commit says so; the push is dropped once idle)."""
        worker_backend = self._check(header, backend, timeout_seconds)
        from torch.distributed import TCPStore  # torch: only the paths that need it

        timeout = datetime.timedelta(seconds=timeout_seconds or _DEFAULT_TIMEOUT)
        push = self.pushes.attach(header)
        group = f"tltd/{header.job_id}/{header.update_id}"
        try:
            store = TCPStore(self.host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
            workers, world = None, 2
            if not worker_backend:  # the workers join the daemon's group, from rank 2
                world += self._join_workers(header, store.port, group, "gloo", timeout, 2)
            elif ranks := self._join_workers(
                header, store.port, f"{group}/workers", worker_backend, timeout, 1
            ):
                prefix = group_prefix(f"{group}/workers", worker_backend)
                workers = WorkerGroupKeys(prefix, 1 + ranks, worker_backend)
        except BaseException:
            self.pushes.detach(push)
            raise
        prefix = group_prefix(group)
        threading.Thread(
            target=self._receive,
            args=(push, store, prefix, world, timeout),
            name=f"broadcast-{header.update_id}",
            daemon=True,
        ).start()
        log.info(
            "policy broadcast opened",
            extra={"job_id": header.job_id, "update_id": header.update_id, "world_size": world},
        )
        return OpenedBroadcast(self.host, store.port, prefix, world, workers)

    def _check(self, header: PushHeader, backend: str, timeout_seconds: float) -> str:
        """The request's arguments checked; returns the workers' group backend."""
        if backend not in WORKER_GROUP_BACKEND:
            raise InvalidArgument(f"must be gloo or nccl, got {backend!r}", field="backend")
        if backend == "nccl" and not nccl_available():
            raise FailedPrecondition(
                "nccl needs a torch with NCCL and workers on CUDA devices; this host has "
                "neither: use gloo",
                field="backend",
            )
        if not 0 <= timeout_seconds <= _MAX_TIMEOUT:
            raise InvalidArgument(
                f"must be 0 (the default, {_DEFAULT_TIMEOUT:.0f} s) to {_MAX_TIMEOUT:.0f}",
                field="timeout_seconds",
            )
        if header.base_version is not None:
            raise InvalidArgument(
                "a broadcast carries full tensors: leave it unset", field="header.base_version"
            )
        return WORKER_GROUP_BACKEND[backend]

    def _join_workers(
        self,
        h: PushHeader,
        port: int,
        group: str,
        backend: str,
        timeout: datetime.timedelta,
        first_rank: int,
    ) -> int:
        """The job's live workers join `group` from `first_rank` on (for nccl those on CUDA
        devices only); returns how many ranks they took."""
        if self.supervisor is None:
            return 0
        path = str(self.pushes.versions_root / h.job_id / h.update_id)  # the version it becomes
        tensors = tuple((t.name, t.dtype, tuple(t.shape)) for t in h.tensors)
        seconds = timeout.total_seconds()

        def join(rank: int, world: int, ranks: int) -> JoinBroadcast:
            return JoinBroadcast(
                path, self.host, port, group, rank, world, tensors, seconds, backend, ranks
            )

        cuda_only = backend == "nccl"
        return self.supervisor.join_broadcast_threadsafe(h.job_id, join, first_rank, cuda_only)

    def _receive(self, push, store, prefix: str, world: int, timeout: datetime.timedelta) -> None:
        import torch

        h = push.header
        specs = ((t.name, t.dtype, t.shape) for t in h.tensors)
        try:
            for name, t in received_tensors(store, prefix, 1, world, specs, timeout):
                self.pushes.store_tensor(push, name, t.reshape(-1).view(torch.uint8).numpy())
                del t
            log.info("policy broadcast received", extra={"job_id": h.job_id})
        except Exception:  # noqa: BLE001 - a thread of its own: log, leave the push incomplete
            log.exception("policy broadcast failed", extra={"job_id": h.job_id})
        finally:
            self.pushes.detach(push)
            del store  # the group's TCP store stops with its last reference
