"""Policy weights broadcast over torch.distributed (gloo): the daemon opens a group for a push,
receives every tensor from the trainer into the push's staging file, and the push is then
committed as any other (`tltd.services.push`): checked, recorded atomically, loaded by the
workers from the daemon's disk.

The daemon hosts the group's TCP store and joins as rank 1; the trainer joins as rank 0 and
broadcasts the header's tensors in order. The group is a process group object of its own
(not torch.distributed's default group): a trainer that already trains in a default group
keeps it, and the daemon can hold several groups at once. One tensor at a time is in the
daemon's memory (the largest bounds it).
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import TYPE_CHECKING

from tltd.domain import PushHeader
from tltd.errors import InvalidArgument

if TYPE_CHECKING:
    from tltd.services.push import PushService
    from tltd.settings import Settings

log = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = 300.0
_MAX_TIMEOUT = 3600.0
_TORCH_DTYPES = ("F32", "float32"), ("BF16", "bfloat16"), ("F16", "float16"), ("F64", "float64")


class BroadcastService:
    def __init__(self, pushes: PushService, settings: Settings) -> None:
        self.pushes = pushes
        self.host = settings.host

    def open(
        self, header: PushHeader, backend: str, timeout_seconds: float
    ) -> tuple[str, int, str]:
        """Open a group for the push `header` (checked and staged as a push); returns the TCP
        store's (address, port, prefix). The daemon waits up to the timeout for the trainer
        to join and for each tensor; a group that fails leaves the push incomplete (a commit
        says so; the push is dropped once idle)."""
        if backend not in ("", "gloo"):
            raise InvalidArgument(f"{backend!r} is not available here: gloo", field="backend")
        if not 0 <= timeout_seconds <= _MAX_TIMEOUT:
            raise InvalidArgument(
                f"must be 0 (the default, {_DEFAULT_TIMEOUT:.0f} s) to {_MAX_TIMEOUT:.0f}",
                field="timeout_seconds",
            )
        if header.base_version is not None:
            raise InvalidArgument(
                "a broadcast carries full tensors: leave it unset", field="header.base_version"
            )
        from torch.distributed import TCPStore  # torch: only the paths that need it

        timeout = datetime.timedelta(seconds=timeout_seconds or _DEFAULT_TIMEOUT)
        push = self.pushes.attach(header)
        try:
            store = TCPStore(
                self.host, 0, 2, is_master=True, wait_for_workers=False, timeout=timeout
            )
        except BaseException:
            self.pushes.detach(push)
            raise
        prefix = f"tltd/{header.job_id}/{header.update_id}"
        threading.Thread(
            target=self._receive,
            args=(push, store, prefix, timeout),
            name=f"broadcast-{header.update_id}",
            daemon=True,
        ).start()
        return self.host, store.port, prefix

    def _receive(self, push, store, prefix: str, timeout: datetime.timedelta) -> None:
        import torch
        import torch.distributed as dist

        dtypes = {code: getattr(torch, name) for code, name in _TORCH_DTYPES}
        h = push.header
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 1, 2, timeout)
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            for spec in h.tensors:
                t = torch.empty(spec.shape, dtype=dtypes[spec.dtype])
                group.broadcast([t], opts).wait()
                self.pushes.store_tensor(push, spec.name, t.reshape(-1).view(torch.uint8).numpy())
                del t
            log.info("policy broadcast received", extra={"job_id": h.job_id})
        except Exception:  # noqa: BLE001 - a thread of its own: log, leave the push incomplete
            log.exception("policy broadcast failed", extra={"job_id": h.job_id})
        finally:
            self.pushes.detach(push)
            del store  # the group's TCP store stops with its last reference
