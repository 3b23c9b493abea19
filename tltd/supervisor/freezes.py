"""Jobs paused with their requests kept in place (vLLM's `pause?mode=keep`, SGLang's
`in_place` / `retract`): this node's workers holding such a job stop stepping their engines,
so its running samples keep their tokens and KV cache and generate nothing until the job is
resumed; then they continue from where they stood (on a new policy version if one was loaded
meanwhile and the job switches running samples). The pause is a row of the store; every
tick sends each worker the `Freeze` its job's row asks for, so it holds on every node (here
at once, elsewhere at that node's next tick) and for workers started while it lasts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping

from tltd.contract import rollout_messages as msg
from tltd.errors import Unavailable
from tltd.supervisor.worker_process import WorkerHandle

_POLL_SECONDS = 0.01


class Freezes:
    """The Freeze commands of this node's workers."""

    def __init__(self, handles: Mapping[str, WorkerHandle]) -> None:
        self.handles = handles

    def apply(self, frozen_jobs: frozenset[str], *, thaw: bool = True) -> None:
        """Freeze the workers of `frozen_jobs` and (with `thaw`) thaw the others that were.
        A tick freezes before it sends any work and thaws after its policy loads: a version
        recorded while a job was frozen is loaded before its samples take another step."""
        for h in self.handles.values():
            want = h.job_id in frozen_jobs
            if h.answered and h.frozen != want and (want or thaw):
                h.send(msg.Freeze(want))
                h.frozen = want

    def stopped(self, job_id: str) -> tuple[int, int]:
        """(workers of `job_id` here that said they stopped stepping, those still to say so);
        a worker whose backend cannot freeze is neither."""
        stopped = pending = 0
        for h in self.handles.values():
            if not (h.alive and h.frozen and h.job_id == job_id):
                continue
            said = h.heartbeat.frozen if h.heartbeat is not None else False
            stopped += said is True
            pending += said is False
        return stopped, pending

    async def wait_stopped(self, job_id: str, timeout: float) -> int:
        """Wait until every worker of `job_id` here that was told to freeze has said it
        stopped (its heartbeat answering the command: no step runs after it); returns how
        many did. A worker ends the step it is in first."""
        deadline = time.monotonic() + timeout
        while True:
            stopped, pending = self.stopped(job_id)
            if not pending:
                return stopped
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"{pending} workers of job {job_id} did not stop within {timeout:.0f} s "
                    "(the job stays paused; they stop at their next step)"
                )
            await asyncio.sleep(_POLL_SECONDS)
