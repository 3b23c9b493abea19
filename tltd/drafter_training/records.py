"""The drafter trainers' one writer: every store row drafter training writes (a trainer's worker
row, the state of the device it holds, its versions, its lease) goes through one
`tltd.supervisor.writes.OrderedWrites`, one at a time in call order (a READY is never overtaken
by a BUSY written after it), off the event loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tltd.domain import DeviceState, WorkerState
from tltd.errors import Fenced, TltError
from tltd.metrics import METRICS
from tltd.supervisor.writes import OrderedWrites, upsert_worker

if TYPE_CHECKING:
    from tltd.drafter_training.runs import TrainerRun
    from tltd.store import Store

log = logging.getLogger(__name__)


class TrainingRecords:
    """`write(fn, *args)`: fn(*args) through the writer; errors logged, not raised (Fenced is,
    with `fenced`): a launch or a stop must still give its device back and stop its processes
    when the store refuses or fails a write."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._writes = OrderedWrites()
        self._writer: asyncio.Task | None = None

    def start(self) -> None:
        """Start the writer on the running loop (once)."""
        if self._writer is None:
            self._writes.bind()
            self._writer = asyncio.ensure_future(self._writes.run())

    async def close(self, *, wait: bool = True) -> None:
        """Write what is queued (unless not `wait`: a crash), then stop the writer (later
        writes are logged, not written)."""
        if self._writer is None:
            return
        if wait:
            await self._writes.join(self._writer)
        self._writer.cancel()
        await asyncio.gather(self._writer, return_exceptions=True)
        self._writes.close()

    async def write(self, fn: Callable[..., Any], *args: Any, fenced: bool = False) -> Any:
        try:
            return await self._writes.write(fn, *args)
        except Fenced:
            if fenced:
                raise
            log.warning("training store write fenced", extra={"fn": fn.__name__})
            return None
        except TltError as exc:
            log.warning("training store write refused: %s", exc)
            return None
        except Exception:
            # e.g. "database is locked" past the busy timeout, a dropped PostgreSQL connection.
            log.exception("training store write failed", extra={"fn": fn.__name__})
            return None

    async def worker(
        self, run: TrainerRun, state: WorkerState, reason: str, pid: int | None = None
    ) -> None:
        """The trainer's row in the workers table."""
        await self.write(upsert_worker, self.store, run.as_worker(state, reason, pid))

    async def device(self, device_id: str, state: DeviceState, why: str) -> None:
        """The state of a device a trainer holds or gives back (and its metrics)."""
        METRICS.set_device_state(device_id, state.value)  # exact training seconds
        if state is not DeviceState.TRAINING:
            METRICS.set_trainer_loading(device_id, False)
        await self.write(self.store.devices.set_state, device_id, state, why)
